"""MLflow tracking and the model registries, low in the house: it imports only the spec and the store.

uri                which MLflow server a run tracks into, and where a person finds the run
mlflow_runs        one MLflow run per RL run: committed metrics, artifacts and tables, flushed
registration       the evaluated weight versions in the MLflow Model Registry
kubeflow_registry  the same versions in the Kubeflow Model Registry (tracking.model_registry)
"""
