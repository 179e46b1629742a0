"""One phase's turn on the shared device: the trainer's ("train": its update, its evals) or the samplers'
("sample": wake, serve the new version, generate). Each turn is recorded in the run root,
<run_root>/sharing/turns/<iteration>-<phase>-<began>.json (an iteration's evaluate and update are both the
trainer's): {phase, iteration, holder, waited_s, began, ended} (wall-clock seconds), so that tests and the docs can
show that no two phases overlapped."""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Iterator
from typing import Literal

from rlpipe.sharing.kubernetes_lease import kubernetes_lease_turn
from rlpipe.sharing.lease import file_lease_turn, lease_backend, lease_directory
from rlpipe.spec import RunSpec
from rlpipe.store.run_root import join, write_json

Phase = Literal["train", "sample"]


def holder_identity(run_root: str) -> str:
    """Who holds a turn: the run (its root) and the process (host, pid), as a Lease's holderIdentity reads."""
    return f"{run_root}@{socket.gethostname()}:{os.getpid()}"


@contextlib.contextmanager
def device_turn(spec: RunSpec, run_root: str, phase: Phase, iteration: int) -> Iterator[dict[str, float]]:
    """The device for `phase` while the block runs; yields the turn's metrics (sharing/<phase>_wait_s: the wait for
    the lease), which the caller adds to its own. Without sharing.enabled: no turn, no record."""
    if not spec.sharing.enabled:
        yield {}
        return
    asked = time.time()
    with _lease(spec, run_root):
        began = time.time()
        metrics = {f"sharing/{phase}_wait_s": began - asked}
        try:
            yield metrics
        finally:
            record: dict[str, object] = {"phase": phase, "iteration": iteration, "holder": holder_identity(run_root)}
            record |= {"waited_s": began - asked, "began": began, "ended": time.time()}
            write_json(join(run_root, "sharing", "turns", f"{iteration:06d}-{phase}-{began:.3f}.json"), record)


def _lease(spec: RunSpec, run_root: str) -> contextlib.AbstractContextManager[None]:
    """The lease that orders this run's turns among the runs that name it (sharing.lease): a Kubernetes Lease in a
    pod, a lock file under sharing.lease_root elsewhere (lease.lease_backend); none without sharing.lease. The
    holder is this process, the owner whose turns least_recently_served evens out is the run."""
    sharing = spec.sharing
    if not sharing.lease:
        return contextlib.nullcontext()
    identity = holder_identity(run_root)
    if lease_backend() == "kubernetes":
        return kubernetes_lease_turn(sharing.lease, identity, run_root, sharing.policy, sharing.lease_duration_s)
    return file_lease_turn(lease_directory(spec), identity, run_root, sharing.policy, sharing.lease_duration_s)
