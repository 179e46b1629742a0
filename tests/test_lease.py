"""The lease runs sharing one device take turns by (rlpipe/sharing/lease.py, kubernetes_lease.py): exclusion between
real processes, fifo and least-recently-served order, a holder or a waiter killed with SIGKILL, renewal, the refusal
of an object store, and the Kubernetes Lease against a stub API server."""

from __future__ import annotations

import copy
import json
import re
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import kubernetes.client
import kubernetes_validate
import pytest

from rlpipe.http_json import reply_json
from rlpipe.sharing import kubernetes_lease, turns
from rlpipe.sharing.kubernetes_lease import kubernetes_lease_turn, lease_transact, to_record
from rlpipe.sharing.lease import (
    LAST_SERVED_KEPT,
    Waiter,
    check_lease_root,
    empty_record,
    file_lease_turn,
    file_transact,
    lease_directory,
    next_waiter,
    poll,
    release,
)
from rlpipe.spec import RunSpec, parse_spec

# one process taking `turns` turns of `hold_s` on the file lease; "began" and "ended" lines appended to `out`
TAKER = """
import json, sys, time
from rlpipe.sharing.lease import file_lease_turn
directory, identity, turns, hold_s, duration_s, out = sys.argv[1:]
def note(event, turn):
    with open(out, "a") as f:
        f.write(json.dumps({"identity": identity, "turn": turn, "event": event, "at": time.time()}) + "\\n")
for turn in range(int(turns)):
    with file_lease_turn(directory, identity, identity, "fifo", float(duration_s)):
        note("began", turn)
        time.sleep(float(hold_s))
        note("ended", turn)
"""
MARGIN_S = 1.5  # polling (0.15 s) plus a loaded 2-core machine's scheduling


@pytest.fixture(autouse=True)
def _file_backend(monkeypatch):
    monkeypatch.delenv("RLPIPE_LEASE_BACKEND", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)


def _spec(root: str, **sharing: Any) -> RunSpec:
    return parse_spec(
        {
            "name": "x",
            "storage": {"root": root},
            "trainer": {"resident": True},
            "rollout": {"engine": "sampler"},
            "sharing": {"enabled": True, "lease": "gpu0", **sharing},
        }
    )


def _taker(directory: Path, identity: str, out: Path, turns: int, hold_s: float, duration_s: float):
    args = [str(directory), identity, str(turns), str(hold_s), str(duration_s), str(out)]
    return subprocess.Popen([sys.executable, "-c", TAKER, *args])


def _events(out: Path) -> list[dict]:
    return [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []


def _record(directory: Path) -> dict:
    path = directory / "lease.json"
    return json.loads(path.read_text()) if path.exists() else empty_record()


def _wait_for(condition, timeout_s: float = 30.0) -> None:
    deadline = time.time() + timeout_s
    while not condition():
        assert time.time() < deadline, "timed out"
        time.sleep(0.05)


def _intervals(events: list[dict]) -> list[tuple[float, float]]:
    began = {(e["identity"], e["turn"]): e["at"] for e in events if e["event"] == "began"}
    ended = {(e["identity"], e["turn"]): e["at"] for e in events if e["event"] == "ended"}
    return sorted((began[key], ended[key]) for key in began)


def _assert_disjoint(intervals: list[tuple[float, float]]) -> None:
    for (_, ended), (began, _) in zip(intervals, intervals[1:]):
        assert began >= ended, f"two turns overlap: {intervals}"


def test_three_processes_never_hold_the_lease_at_once(tmp_path):
    directory, out = tmp_path / "leases" / "gpu0", tmp_path / "turns.jsonl"
    takers = [_taker(directory, f"run-{i}", out, turns=5, hold_s=0.2, duration_s=5.0) for i in range(3)]
    for taker in takers:
        assert taker.wait(timeout=60) == 0
    intervals = _intervals(_events(out))
    assert len(intervals) == 15
    _assert_disjoint(intervals)
    record = _record(directory)
    assert (record["holderIdentity"], record["waiting"], record["leaseTransitions"]) == ("", [], 15)
    assert set(record["lastServed"]) == {"run-0", "run-1", "run-2"}


def test_next_waiter_by_policy():
    waiting = [
        {"identity": "b", "owner": "B", "since": 1.0},
        {"identity": "c", "owner": "C", "since": 2.0},
        {"identity": "d", "owner": "D", "since": 3.0},
    ]
    record = {"waiting": waiting, "lastServed": {"B": 50.0, "C": 10.0}}
    assert next_waiter(record, "fifo")["identity"] == "b"
    assert next_waiter(record, "least_recently_served")["identity"] == "d"  # never served goes first
    record["lastServed"]["D"] = 20.0
    assert next_waiter(record, "least_recently_served")["identity"] == "c"
    record["lastServed"] = {"B": 10.0, "C": 10.0, "D": 10.0}
    assert next_waiter(record, "least_recently_served")["identity"] == "b"  # a tie: the earliest since


def test_release_frees_the_lease_and_keeps_the_latest_owners():
    record = empty_record() | {"lastServed": {f"run-{i}": float(i) for i in range(LAST_SERVED_KEPT)}}
    me = Waiter("p", "run-new")
    assert poll(record, me, 1000.0, "fifo", 10.0) and record["holderIdentity"] == "p"
    release(record, me, 1001.0)
    assert record["holderIdentity"] == "" and record["waiting"] == []
    assert len(record["lastServed"]) == LAST_SERVED_KEPT
    assert record["lastServed"]["run-new"] == 1001.0 and "run-0" not in record["lastServed"]


@pytest.mark.parametrize("policy, expected", [("fifo", ["b", "c"]), ("least_recently_served", ["c", "b"])])
def test_who_goes_next_after_the_holder(tmp_path, policy, expected):
    """A holds; B then C enqueue; C's run was served longer ago than B's. fifo hands the lease to B, the
    least-recently-served policy to C."""
    directory = tmp_path / "gpu0"
    file_transact(directory)(lambda record: record["lastServed"].update({"B": time.time() - 10, "C": time.time() - 60}))
    order: list[str] = []
    release_a = threading.Event()

    def take(identity: str, owner: str, hold: threading.Event | None = None) -> None:
        with file_lease_turn(directory, identity, owner, policy, duration_s=10.0):
            order.append(identity)
            if hold:
                hold.wait(30)

    a = threading.Thread(target=take, args=("a", "A", release_a))
    a.start()
    _wait_for(lambda: order == ["a"])
    threads = []
    for identity in ("b", "c"):
        threads.append(threading.Thread(target=take, args=(identity, identity.upper())))
        threads[-1].start()
        _wait_for(lambda: identity in _waiting(directory))
    release_a.set()
    for thread in (a, *threads):
        thread.join(30)
    assert order == ["a", *expected]


def test_a_killed_holder_loses_the_lease_after_one_duration(tmp_path):
    directory, out, duration_s = tmp_path / "gpu0", tmp_path / "turns.jsonl", 2.0
    holder = _taker(directory, "doomed", out, turns=1, hold_s=600, duration_s=duration_s)
    _wait_for(lambda: _events(out))
    time.sleep(1.0)  # it renews (every duration / 3) while it holds
    took: list[float] = []
    waiter = threading.Thread(target=lambda: _take_once(directory, "survivor", duration_s, took))
    waiter.start()
    _wait_for(lambda: "survivor" in _waiting(directory))
    holder.send_signal(signal.SIGKILL)
    killed_at = time.time()
    holder.wait()
    last_renewal = _record(directory)["renewTime"]
    waiter.join(duration_s + 10)
    assert last_renewal > _events(out)[0]["at"], "the holder never renewed"
    assert took[0] >= last_renewal + duration_s, "taken before the killed holder's lease expired"
    assert took[0] - killed_at <= duration_s + MARGIN_S
    assert _record(directory)["leaseTransitions"] == 2


def _take_once(directory: Path, identity: str, duration_s: float, took: list[float]) -> None:
    with file_lease_turn(directory, identity, identity, "fifo", duration_s):
        took.append(time.time())


def test_a_killed_waiter_leaves_the_queue_after_one_duration(tmp_path):
    """A holds; W (a process) queues, then is killed; B queues behind it. When A releases, B waits for W's entry to
    go stale (one duration after W last refreshed it), no longer."""
    directory, out, duration_s = tmp_path / "gpu0", tmp_path / "turns.jsonl", 2.0
    release_a, took = threading.Event(), []
    a = threading.Thread(target=lambda: _hold(directory, "a", duration_s, release_a))
    a.start()
    _wait_for(lambda: _record(directory)["holderIdentity"] == "a")
    dead = _taker(directory, "w", out, turns=1, hold_s=0, duration_s=duration_s)
    _wait_for(lambda: "w" in _waiting(directory))
    dead.send_signal(signal.SIGKILL)
    dead.wait()
    last_seen = _waiting(directory)["w"]["seen"]
    b = threading.Thread(target=lambda: _take_once(directory, "b", duration_s, took))
    b.start()
    _wait_for(lambda: "b" in _waiting(directory))
    release_a.set()
    b.join(duration_s + 10)
    a.join(5)
    assert not _events(out), "the killed waiter had a turn"
    assert last_seen + duration_s <= took[0] <= last_seen + duration_s + MARGIN_S
    assert _waiting(directory) == {}


def _hold(directory: Path, identity: str, duration_s: float, until: threading.Event) -> None:
    with file_lease_turn(directory, identity, identity, "fifo", duration_s):
        until.wait(30)


def _waiting(directory: Path) -> dict[str, dict]:
    return {w["identity"]: w for w in _record(directory)["waiting"]}


def test_a_living_holder_keeps_the_lease_for_many_durations(tmp_path):
    directory, duration_s, turns_taken = tmp_path / "gpu0", 1.0, []

    def take(identity: str, hold_s: float) -> None:
        with file_lease_turn(directory, identity, identity, "fifo", duration_s):
            began = time.time()
            time.sleep(hold_s)
            turns_taken.append((began, time.time()))

    long = threading.Thread(target=take, args=("long", 3.5))
    long.start()
    _wait_for(lambda: _record(directory)["holderIdentity"] == "long")
    acquired = _record(directory)["acquireTime"]
    other = threading.Thread(target=take, args=("other", 0.0))
    other.start()
    time.sleep(2.5)
    record = _record(directory)
    assert (record["holderIdentity"], record["acquireTime"]) == ("long", acquired)
    assert record["renewTime"] > acquired + duration_s  # renewed, else "other" could have taken it by now
    long.join(10)
    other.join(10)
    _assert_disjoint(sorted(turns_taken))
    assert _record(directory)["leaseTransitions"] == 2


def test_an_object_store_is_refused(tmp_path, monkeypatch):
    problem = check_lease_root(_spec("gs://bucket/runs"))
    assert problem is not None
    assert "sharing.lease needs a directory every run sharing it sees" in problem
    assert "storage.root (sharing.lease_root is not set) is gs://bucket/runs" in problem
    assert "set sharing.lease_root to a shared mount, or run on a cluster where the Kubernetes Lease is used" in problem
    assert "sharing.lease_root is s3://b/leases" in check_lease_root(_spec(str(tmp_path), lease_root="s3://b/leases"))
    with pytest.raises(ValueError, match="sharing.lease needs a directory"):
        lease_directory(_spec("gs://bucket/runs"))
    with pytest.raises(ValueError, match="sharing.lease needs a directory"):
        with turns.device_turn(_spec("gs://bucket/runs"), "gs://bucket/runs/x", "train", 1):
            pass
    assert check_lease_root(_spec("gs://bucket/runs", lease_root=str(tmp_path))) is None
    assert check_lease_root(_spec(str(tmp_path))) is None
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")  # in a pod: the Kubernetes Lease, no directory
    assert check_lease_root(_spec("gs://bucket/runs")) is None


def test_device_turn_takes_the_file_lease(tmp_path):
    spec = _spec(str(tmp_path / "runs"), lease_root=str(tmp_path / "shared"))
    run_root = str(tmp_path / "runs" / "x")
    with turns.device_turn(spec, run_root, "train", 3):
        record = _record(tmp_path / "shared" / "leases" / "gpu0")
        assert record["holderIdentity"] == turns.holder_identity(run_root)
    record = _record(tmp_path / "shared" / "leases" / "gpu0")
    assert (record["holderIdentity"], record["leaseTransitions"], list(record["lastServed"])) == ("", 1, [run_root])
    (turn,) = (tmp_path / "runs" / "x" / "sharing" / "turns").glob("000003-train-*.json")
    assert json.loads(turn.read_text())["phase"] == "train"


# --- the Kubernetes Lease ---


class LeaseApiStub:
    """STUB of the Kubernetes API server's coordination.k8s.io/v1 leases (no API server can run here): GET, POST and
    PUT of /apis/coordination.k8s.io/v1/namespaces/<ns>/leases[/<name>]. Each write gets a new
    metadata.resourceVersion; a PUT carrying another (a stale read) is answered 409 Conflict, a POST of an existing
    name 409 AlreadyExists, as the API server answers them. `answers` records (method, status)."""

    PATH = re.compile(r"/apis/coordination\.k8s\.io/v1/namespaces/([^/]+)/leases(?:/([^/]+))?")

    def __init__(self) -> None:
        self.leases: dict[tuple[str, str], dict] = {}
        self.answers: list[tuple[str, int]] = []
        self.version = 0
        self.lock = threading.Lock()
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _handle(self, method: str) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                status, payload = stub.route(method, self.path.split("?")[0], body)
                stub.answers.append((method, status))
                reply_json(self, status, payload)

            def do_GET(self) -> None:  # noqa: N802 (http.server API)
                self._handle("GET")

            def do_POST(self) -> None:  # noqa: N802
                self._handle("POST")

            def do_PUT(self) -> None:  # noqa: N802
                self._handle("PUT")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.host = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def route(self, method: str, path: str, body: Any) -> tuple[int, dict]:
        match = self.PATH.fullmatch(path)
        if not match:
            return 404, _status(404, "NotFound", path)
        namespace, name = match.groups()
        with self.lock:
            if method == "GET" and name:
                found = self.leases.get((namespace, name))
                return (200, found) if found else (404, _status(404, "NotFound", f"leases {name!r} not found"))
            if method == "POST" and not name:
                name = body["metadata"]["name"]
                if (namespace, name) in self.leases:
                    return 409, _status(409, "AlreadyExists", f"leases {name!r} already exists")
                return 201, self._store(namespace, name, body)
            if method == "PUT" and name:
                found = self.leases.get((namespace, name))
                if found is None:
                    return 404, _status(404, "NotFound", f"leases {name!r} not found")
                if body["metadata"].get("resourceVersion") != found["metadata"]["resourceVersion"]:
                    return 409, _status(
                        409, "Conflict", "the object has been modified; apply your changes to the latest version"
                    )
                return 200, self._store(namespace, name, body)
        return 405, _status(405, "MethodNotAllowed", method)

    def _store(self, namespace: str, name: str, body: dict) -> dict:
        self.version += 1
        stored = copy.deepcopy(body)
        stored["metadata"] |= {"namespace": namespace, "resourceVersion": str(self.version)}
        self.leases[(namespace, name)] = stored
        return stored

    def api(self) -> Any:
        configuration = kubernetes.client.Configuration(host=self.host)
        return kubernetes.client.CoordinationV1Api(kubernetes.client.ApiClient(configuration))


def _status(code: int, reason: str, message: str) -> dict:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


@pytest.fixture
def stub():
    stub = LeaseApiStub()
    yield stub
    stub.server.shutdown()


def test_kubernetes_lease_excludes_and_validates(stub):
    intervals: list[tuple[float, float]] = []

    def take(identity: str) -> None:
        for _ in range(3):
            with kubernetes_lease_turn("gpu0", identity, identity, "fifo", 5.0, "rl", stub.api(), poll_s=0.05):
                began = time.time()
                time.sleep(0.15)
                intervals.append((began, time.time()))

    threads = [threading.Thread(target=take, args=(identity,)) for identity in ("run-a", "run-b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert len(intervals) == 6
    _assert_disjoint(sorted(intervals))
    lease = stub.leases[("rl", "gpu0")]
    assert lease["spec"]["holderIdentity"] == "" and lease["spec"]["leaseTransitions"] == 6
    assert lease["spec"]["leaseDurationSeconds"] == 5
    assert set(json.loads(lease["metadata"]["annotations"]["rlpipe.dev/last-served"])) == {"run-a", "run-b"}
    kubernetes_validate.validate(lease, "1.34.0", strict=True)


def test_a_stale_write_is_refused_and_retried(stub):
    """Another process writes between our reads and our writes: its POST creates the Lease first (ours: 409
    AlreadyExists), its PUT lands before ours (ours: 409 Conflict). Each time ours reads again and writes on top,
    so no process's change is lost."""
    ours, theirs = stub.api(), stub.api()
    real_read = ours.read_namespaced_lease
    them = [Waiter("first", "first"), Waiter("second", "second")]

    def read_then_someone_writes(name: str, namespace: str) -> Any:
        try:
            return real_read(name, namespace)
        finally:
            if them:
                waiter = them.pop(0)
                lease_transact(theirs, namespace, name)(lambda r: poll(r, waiter, time.time(), "fifo", 60.0))

    ours.read_namespaced_lease = read_then_someone_writes
    me = Waiter("ours", "ours")
    assert lease_transact(ours, "rl", "gpu0")(lambda r: poll(r, me, time.time(), "fifo", 60.0)) is False
    assert [answer for answer in stub.answers if answer[1] == 409] == [("POST", 409), ("PUT", 409)]
    record = to_record(real_read("gpu0", "rl"))
    assert record["holderIdentity"] == "first"
    assert [w["identity"] for w in record["waiting"]] == ["second", "ours"]
    kubernetes_validate.validate(stub.leases[("rl", "gpu0")], "1.34.0", strict=True)


def test_a_kubernetes_lease_expires_when_its_holder_stops_renewing(stub):
    gone = Waiter("gone", "gone")
    lease_transact(stub.api(), "rl", "gpu0")(lambda r: poll(r, gone, time.time(), "fifo", 2.0))  # holds, never renews
    renewed = to_record(stub.api().read_namespaced_lease("gpu0", "rl"))["renewTime"]
    with kubernetes_lease_turn("gpu0", "next", "next", "fifo", 2.0, "rl", stub.api(), poll_s=0.05):
        took = time.time()
    assert renewed + 2.0 <= took <= renewed + 2.0 + MARGIN_S
    lease = stub.leases[("rl", "gpu0")]
    assert (lease["spec"]["holderIdentity"], lease["spec"]["leaseTransitions"]) == ("", 2)


def test_device_turn_takes_the_kubernetes_lease_in_a_pod(stub, monkeypatch, tmp_path):
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    monkeypatch.setattr(kubernetes_lease, "_default_api", stub.api)
    spec = _spec(str(tmp_path), lease_root="gs://bucket/leases")  # not read: the Lease is the record
    run_root = str(tmp_path / "x")
    with turns.device_turn(spec, run_root, "sample", 2):
        assert stub.leases[("default", "gpu0")]["spec"]["holderIdentity"] == turns.holder_identity(run_root)
    assert stub.leases[("default", "gpu0")]["spec"]["holderIdentity"] == ""
