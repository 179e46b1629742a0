"""Pre-flight: check a run spec against the world before the first step runs (`rlpipe check SPEC`,
and the start of every `rlpipe run`).

Each check returns one line saying what it found, or raises CheckFailed saying what to change.
`preflight` runs them all and reports every failure at once, so one edit fixes them all.

    machine     the packages and the device (check_installed, check_device)
    storage     the run root, the cache, the tracking store, a Kubeflow Model Registry and the lease runs
                share (check_run_root, check_tracking, check_model_registry, check_lease)
    inputs      the model and the data's prompts, and how they tokenize (check_model, check_data)
    behaviour   the algorithm, rewards, environment and evaluation (check_algorithm, check_rewards,
                check_environment, check_evaluation), and the steps cluster.secrets names (check_secrets)
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from pathlib import Path

from rlpipe.preflight.behaviour import (
    check_algorithm,
    check_environment,
    check_evaluation,
    check_rewards,
    check_secrets,
)
from rlpipe.preflight.inputs import check_data, check_model
from rlpipe.preflight.machine import check_device, check_installed, cuda_builds_beside_cpu_torch, gpus_problem
from rlpipe.preflight.probe import CheckFailed
from rlpipe.preflight.storage import (
    check_lease,
    check_model_registry,
    check_run_root,
    check_tracking,
    tracking_store_problem,
)
from rlpipe.spec import RunSpec


class PreflightError(ValueError):
    """Some pre-flight checks failed; the message lists each with what to change."""


def preflight(spec: RunSpec, run_root: str, say: Callable[[str], None] = lambda _: None) -> None:
    """Run every check; say each result; raise PreflightError listing every failure. What the libraries
    log meanwhile (gcsfs's retries, with tracebacks) goes to <cache>/logs/preflight.log, not the terminal."""
    checks: list[Callable[[], str]] = [
        lambda: check_installed(spec),
        lambda: check_device(spec),
        lambda: check_run_root(spec, run_root),
        lambda: check_data(spec),
        lambda: check_algorithm(spec),
        lambda: check_model(spec),
        lambda: check_rewards(spec),
        lambda: check_environment(spec),
        lambda: check_evaluation(spec),
        lambda: check_tracking(spec, run_root),
        *([lambda: check_model_registry(spec)] if spec.tracking.model_registry else []),
        *([lambda: check_secrets(spec)] if spec.cluster.secrets else []),
        *([lambda: check_lease(spec)] if spec.sharing.lease else []),
    ]
    failures = []
    log_path = Path(spec.cache_root) / "logs" / "preflight.log"
    with library_logs_to(log_path) as logged:
        for check in checks:
            try:
                say(f"  ok  {check()}")
            except CheckFailed as err:
                failures.append(str(err))
                say(f"  FAIL {err}")
    libraries = f"(the libraries' messages: {log_path})" if logged() else ""
    if libraries:
        say(f"  {libraries}")
    if failures:
        message = "pre-flight check failed (no step ran):\n  - " + "\n  - ".join(failures)
        raise PreflightError(message + (f"\n  {libraries}" if libraries else ""))


@contextlib.contextmanager
def library_logs_to(path: Path) -> Iterator[Callable[[], bool]]:
    """Route the Python logging records of warnings and errors (the root logger's: a library's without a
    handler of its own) to the file `path` while the block runs; yields whether any was written."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handler: logging.Handler = logging.FileHandler(path, delay=True)
    except OSError:  # check_run_root names an unwritable cache
        handler = logging.NullHandler()
    handler.setLevel(logging.WARNING)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s: %(message)s"))
    written: list[bool] = []

    def note(record: logging.LogRecord) -> bool:
        written.append(True)
        return True  # the record is written

    handler.addFilter(note)
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        yield lambda: bool(written)
    finally:
        root.removeHandler(handler)
        handler.close()


__all__ = [
    "CheckFailed",
    "PreflightError",
    "check_algorithm",
    "check_data",
    "check_device",
    "check_environment",
    "check_evaluation",
    "check_installed",
    "check_lease",
    "check_model",
    "check_model_registry",
    "check_rewards",
    "check_run_root",
    "check_secrets",
    "check_tracking",
    "cuda_builds_beside_cpu_torch",
    "gpus_problem",
    "library_logs_to",
    "preflight",
    "tracking_store_problem",
]
