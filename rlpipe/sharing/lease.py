"""The lease runs naming the same `sharing.lease` take turns on one device by: a lock file on storage they all see,
`<sharing.lease_root>/leases/<name>/` (lease_root defaults to storage.root). kubernetes_lease.py holds the same turn
on a coordination.k8s.io/v1 Lease; `lease_backend` says which one a process uses.

lease.json mirrors a Lease's spec, plus the queue and what fairness needs ("" holder: free):
  {holderIdentity, leaseDurationSeconds, acquireTime, renewTime, leaseTransitions,
   waiting: [{identity, owner, since, seen}], lastServed: {owner: when its last turn ended}}
Each change is a short read-modify-write under an exclusive flock on lease.lock (never held while a turn runs), the
record replaced by a rename. A turn:
  1. enqueue, then poll every POLL_S until the lease is free or expired (now > renewTime + leaseDurationSeconds)
     and the policy picks this waiter; take it (acquireTime = renewTime = now, leaseTransitions + 1);
  2. while it is held, a daemon thread renews it (renewTime = now) every leaseDurationSeconds / 3;
  3. release it on exit, also on an exception: holder "", lastServed[owner] = now.
Policies: fifo, the earliest `since`; least_recently_served (gke-labs/open-rl's LRS, "anti-platoon"), the owner
whose last turn ended longest ago, never served first, ties by `since`. The owner, the fairness unit, is the run;
the identity is one of its processes. A waiter refreshes `seen` while it polls; one not seen for a lease duration
died and leaves the queue.

Times are wall-clock seconds (time.time()) written into the record. client-go measures expiry from the local time it
saw the record change instead, which tolerates skewed clocks. Here the record's time is compared by processes on
one machine (a device lives on one host) or by hosts that NTP keeps milliseconds apart, far below a lease duration;
and it makes expiry a fact every waiter agrees on: one arriving after the holder died need not watch the record for
a whole duration first.

flock works on local filesystems and NFS (v4 clients lock on the server); Lustre needs its `flock` mount option.
An object store (gs://, s3://) has no lock: check_lease_root refuses it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from rlpipe.store.run_root import is_local

if TYPE_CHECKING:
    from rlpipe.spec import RunSpec

Policy = Literal["fifo", "least_recently_served"]
Record = dict[str, Any]
Transact = Callable[[Callable[[Record], Any]], Any]  # one atomic read-modify-write of the record: the change's result

POLL_S = 0.15
LAST_SERVED_KEPT = 64
BACKEND_ENV = "RLPIPE_LEASE_BACKEND"
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Waiter:
    identity: str  # holderIdentity: one process
    owner: str  # the fairness unit: its run


def lease_backend() -> Literal["file", "kubernetes"]:
    """RLPIPE_LEASE_BACKEND (file | kubernetes) when set; otherwise the Kubernetes Lease inside a pod
    (KUBERNETES_SERVICE_HOST set), the lock file elsewhere."""
    asked = os.environ.get(BACKEND_ENV)
    if asked and asked not in ("file", "kubernetes"):
        raise ValueError(f"{BACKEND_ENV}={asked!r}: set it to file or kubernetes, or unset it")
    if asked:
        return "file" if asked == "file" else "kubernetes"
    return "kubernetes" if os.environ.get("KUBERNETES_SERVICE_HOST") else "file"


def check_lease_root(spec: RunSpec) -> str | None:
    """The problem with the lease's directory (pre-flight's check), None when there is none or the Kubernetes
    Lease is used."""
    if not spec.sharing.lease or lease_backend() == "kubernetes":
        return None
    return _root_problem(spec)


def _root_problem(spec: RunSpec) -> str | None:
    root = spec.sharing.lease_root or spec.storage.root
    if is_local(root):
        return None
    key = "sharing.lease_root" if spec.sharing.lease_root else "storage.root (sharing.lease_root is not set)"
    return (
        f"sharing.lease needs a directory every run sharing it sees: {key} is {root}, where no file can be locked; "
        "set sharing.lease_root to a shared mount, or run on a cluster where the Kubernetes Lease is used"
    )


def lease_directory(spec: RunSpec) -> Path:
    """<lease_root>/leases/<sharing.lease>, absolute; ValueError when the root is not a local path."""
    problem = _root_problem(spec)
    if problem or not spec.sharing.lease:
        raise ValueError(problem or "sharing.lease is not set: this run has no lease")
    root = (spec.sharing.lease_root or spec.storage.root).removeprefix("file://")
    return Path(root).expanduser().resolve() / "leases" / spec.sharing.lease


# --- the record: one waiter's look, a renewal, a release (pure: both backends run them in their transaction) ---


def empty_record() -> Record:
    return {
        "holderIdentity": "",
        "leaseDurationSeconds": None,
        "acquireTime": None,
        "renewTime": None,
        "leaseTransitions": 0,
        "waiting": [],
        "lastServed": {},
    }


def is_free(record: Record, now: float) -> bool:
    """No holder, or one that stopped renewing: now > renewTime + leaseDurationSeconds."""
    return not record["holderIdentity"] or now > record["renewTime"] + record["leaseDurationSeconds"]


def next_waiter(record: Record, policy: Policy) -> dict[str, Any] | None:
    """Who gets the lease next. fifo: min since. least_recently_served: min lastServed[owner] (never served: 0),
    then since."""
    waiting = record["waiting"]
    if not waiting:
        return None
    if policy == "fifo":
        return min(waiting, key=lambda w: (w["since"], w["identity"]))
    served = record["lastServed"]
    return min(waiting, key=lambda w: (served.get(w["owner"], 0.0), w["since"], w["identity"]))


def poll(record: Record, me: Waiter, now: float, policy: Policy, duration_s: float) -> bool:
    """A waiter's look: its entry enqueued or refreshed, dead waiters (not seen for duration_s) dropped; True when
    the lease was free or expired and the policy picked it, which then holds it."""
    alive = [w for w in record["waiting"] if w["identity"] == me.identity or now - w["seen"] <= duration_s]
    mine = next((w for w in alive if w["identity"] == me.identity), None)
    if mine is None:
        mine = {"identity": me.identity, "owner": me.owner, "since": now, "seen": now}
        alive.append(mine)
    elif now - mine["seen"] >= duration_s / 3:  # as often as a holder renews, not at every poll: fewer writes
        mine["seen"] = now
    record["waiting"] = alive
    chosen = next_waiter(record, policy)
    if not is_free(record, now) or chosen is None or chosen["identity"] != me.identity:
        return False
    record["waiting"] = [w for w in alive if w["identity"] != me.identity]
    record["holderIdentity"] = me.identity
    record["leaseDurationSeconds"] = duration_s
    record["acquireTime"] = record["renewTime"] = now
    record["leaseTransitions"] += 1
    return True


def renew(record: Record, me: Waiter, now: float) -> bool:
    """The holder's renewal; False when the lease is no longer its own (it stalled past a duration, another took it)."""
    if record["holderIdentity"] != me.identity:
        return False
    record["renewTime"] = now
    return True


def release(record: Record, me: Waiter, now: float) -> None:
    """Out of the queue; the lease freed if held, and the owner's turn recorded as ended now."""
    record["waiting"] = [w for w in record["waiting"] if w["identity"] != me.identity]
    if record["holderIdentity"] == me.identity:
        record["holderIdentity"] = ""
        served = record["lastServed"] | {me.owner: now}
        # the latest owners only (a Lease's annotations are small); one forgotten counts as never served: first
        record["lastServed"] = dict(sorted(served.items(), key=lambda item: item[1])[-LAST_SERVED_KEPT:])


# --- a turn, on any backend's transaction ---


@contextlib.contextmanager
def turn(transact: Transact, me: Waiter, policy: Policy, duration_s: float, poll_s: float = POLL_S) -> Iterator[None]:
    """The lease held while the block runs: waited for, renewed, released (also when waiting is interrupted)."""
    try:
        while not transact(lambda record: poll(record, me, time.time(), policy, duration_s)):
            time.sleep(poll_s)
        with _renewing(transact, me, duration_s):
            yield
    finally:
        try:
            transact(lambda record: release(record, me, time.time()))
        except Exception as err:  # the block's own error matters more; the lease expires anyway
            log.warning("could not release the lease (%s): the next holder waits %.0f s for it", err, duration_s)


@contextlib.contextmanager
def _renewing(transact: Transact, me: Waiter, duration_s: float) -> Iterator[None]:
    """A daemon thread renews the lease every duration_s / 3 while the block runs."""
    stop = threading.Event()

    def renew_until_stopped() -> None:
        while not stop.wait(duration_s / 3):
            try:
                if not transact(lambda record: renew(record, me, time.time())):
                    log.error(
                        "%s lost the lease (no renewal for %.0f s): another holder took it", me.identity, duration_s
                    )
                    return
            except Exception as err:  # a passing storage or API error: the next renewal tries again
                log.warning("could not renew the lease (%s); trying again in %.1f s", err, duration_s / 3)

    thread = threading.Thread(target=renew_until_stopped, name="lease-renewal", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=duration_s)


# --- the file backend ---


def file_transact(directory: Path) -> Transact:
    """Read-modify-write of <directory>/lease.json under an exclusive flock on <directory>/lease.lock."""
    record_path, lock_path = directory / "lease.json", directory / "lease.lock"

    def transact(change: Callable[[Record], Any]) -> Any:
        directory.mkdir(parents=True, exist_ok=True)
        with lock_path.open("a") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX)  # let go when the file closes, also when the process dies
            except OSError as err:
                raise OSError(
                    f"cannot lock {lock_path} ({err}): sharing.lease_root must be on a filesystem with file locks "
                    "(local, NFS; Lustre mounted with -o flock)"
                ) from err
            record = _read_record(record_path)
            before = json.dumps(record, sort_keys=True)
            result = change(record)
            if json.dumps(record, sort_keys=True) != before:
                making = record_path.with_name("lease.json.tmp")  # one writer at a time: the lock's holder
                making.write_text(json.dumps(record, indent=2, sort_keys=True))
                os.replace(making, record_path)
        return result

    return transact


def _read_record(path: Path) -> Record:
    if not path.exists():
        return empty_record()
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(
            f"{path} is not a lease record ({err}): delete it, the runs sharing it write it again"
        ) from None


def file_lease_turn(
    directory: str | Path,
    identity: str,
    owner: str,
    policy: Policy = "fifo",
    duration_s: float = 30.0,
    poll_s: float = POLL_S,
) -> contextlib.AbstractContextManager[None]:
    """A turn on the file lease in `directory` (lease_directory(spec))."""
    return turn(file_transact(Path(directory)), Waiter(identity, owner), policy, duration_s, poll_s)
