"""Thin KFP components, one subpackage per step (`component.py`), over the step functions in rlpipe/.

Component bodies import rlpipe inside the function: KFP ships only the function's source
to the container, which has rlpipe installed (images/). The helpers below are the step
process's own bookkeeping.
"""

from __future__ import annotations

import atexit
import importlib
import logging
import os
import sys
import time
from typing import TYPE_CHECKING

from rlpipe.spec import ClusterSpec

# the images the components name; `cluster.trainer.image` / `cluster.step.image` replace them at compile time
TRAINER_IMAGE = ClusterSpec().trainer.image  # torch + transformers + rlpipe (generate, update, ...)
STEP_IMAGE = ClusterSpec().step.image  # rlpipe without torch (score, advantages, sync, ...)

if TYPE_CHECKING:
    from kfp.dsl import Metrics

    from rlpipe.spec import RunSpec


def start(step: str, spec: str, entered_at: float) -> tuple[RunSpec, dict[str, float]]:
    """The parsed spec (the JSON of rlpipe.spec.spec_to_json), after importing what `step` computes
    with (rlpipe.steps.modules_for: torch, transformers, or only a service's client);
    overhead/<step>_import_s times it from `entered_at`."""
    from rlpipe.spec import spec_from_json
    from rlpipe.steps import modules_for

    run_spec = spec_from_json(spec)
    for module in modules_for(step, run_spec):
        importlib.import_module(module)
    return run_spec, {f"overhead/{step}_import_s": time.time() - entered_at}


def finish(metrics: Metrics, values: dict[str, float]) -> None:
    """Log the step's metrics to its KFP Metrics artifact (the KFP UI shows them), then let the
    process exit fast once the executor has written the outputs. Not with KFP's MLflow integration
    (rlpipe.tracking.uri.kfp_mlflow): its launcher would log them again to the task's MLflow run, beside
    the RL run's record of them by iteration."""
    from rlpipe.tracking.uri import kfp_mlflow

    if kfp_mlflow() is None:
        for key, value in values.items():
            metrics.log_metric(key, value)
    exit_without_teardown()


def exit_without_teardown() -> None:
    """End this KFP step process right after the executor has written its outputs.

    Python's shutdown frees every module the step imported (pyarrow, numpy, fsspec, torch):
    ~0.1 s per light step, and an iteration runs five steps. Registered last, this atexit hook
    runs first: it flushes logging and stdio and exits 0 at once, unless an uncaught exception is
    on its way out (the executor failed to write the outputs), whose normal exit reports it.
    Only in a process started by the KFP executor (`python -m kfp.dsl.executor_main`)."""
    main_spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if getattr(main_spec, "name", None) == "kfp.dsl.executor_main":
        atexit.register(_exit_now)


def _exit_now() -> None:
    if getattr(sys, "last_value", None) is not None or getattr(sys, "last_exc", None) is not None:
        return
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
