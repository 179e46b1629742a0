from kfp import dsl

from rlpipe.components import STEP_IMAGE


@dsl.component(base_image=STEP_IMAGE, install_kfp_package=False)
def track(spec: str, run_root: str, status: dsl.PipelineTaskFinalStatus) -> str:
    """Exit task: log what MLflow lacks of the committed run (metrics, eval samples, registered versions),
    even when an iteration failed (what was committed is kept). Returns the MLflow run id."""
    import os

    from rlpipe.spec import spec_from_json
    from rlpipe.tracking.mlflow_runs import LIVE_TRACKING_ENV, flush

    done = flush(spec_from_json(spec), run_root, driver_s=10.0 if os.environ.get(LIVE_TRACKING_ENV) else 0.0)
    print(f"MLflow run {done['run_id']}: {done}; pipeline {status.state}")
    return done["run_id"]
