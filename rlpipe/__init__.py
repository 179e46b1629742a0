"""rlpipe: RL post-training for LLMs as Kubeflow Pipelines."""

__version__ = "0.1.0"
