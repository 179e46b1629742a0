"""Thin KFP components, one subpackage per step (`component.py`), over the step functions in rlpipe/.

Component bodies import rlpipe inside the function: KFP ships only the function's source
to the container, which has rlpipe installed (images/). The helpers below are the step
process's own bookkeeping.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import time

TRAINER_IMAGE = "ghcr.io/rlpipe/trainer:0.1.0"  # torch + transformers + rlpipe (generate, update, ...)
STEP_IMAGE = "ghcr.io/rlpipe/step:0.1.0"  # rlpipe without torch (score, advantages, sync, ...)


def import_overhead(step: str, entered_at: float) -> dict[str, float]:
    """overhead/<step>_import_s: component body entered -> step function imported (torch, transformers, ...)."""
    return {f"overhead/{step}_import_s": time.time() - entered_at}


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
