"""Long-lived local servers that `rlpipe run` owns: the vLLM samplers and the resident trainer.

Each server leads its own process group (a vLLM server and its engine core die together), is
started (samplers: once the weight store has a published version), restarted when it exits (as a
Deployment would, up to MAX_RESTARTS), and stopped by PID when the driver exits; PDEATHSIG
stops it if the driver is SIGKILLed. A server that exits before it ever answered /health is a
misconfiguration more often than bad luck: after STARTUP_ATTEMPTS it is marked failed with its
log's last error line, which a step waiting for it reports at once (store.run_root.failed_services).
One killed by a signal from outside (SIGKILL, SIGTERM, SIGINT) is restarted as a crash is.
A record file (`<run root>/<kind>s/fleet.json`) keeps URL, PID, state and log of each, so a later
`rlpipe run` stops servers that a killed driver left behind.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from rlpipe.http_json import is_healthy
from rlpipe.store.run_root import filesystem, fleet_uri, join

MAX_RESTARTS = 5
START_MARKER = "--- rlpipe: starting"  # the line each start writes to the server's log
STARTUP_ATTEMPTS = 2
KILLED = {-signal.SIGKILL, -signal.SIGTERM, -signal.SIGINT}  # exit statuses of a server stopped from outside
# port -> (argv, extra environment)
Launch = Callable[[int], tuple[list[str], dict[str, str]]]


@dataclass
class Replica:
    url: str
    port: int
    log: str
    pid: int | None = None
    state: str = "waiting for weights"  # -> starting -> ready; restarting; failed; stopped
    restarts: int = 0
    served: bool = False  # answered /health at least once
    error: str | None = None  # why it failed: the last error line of its log


def die_with_parent() -> None:
    """SIGTERM this process when its parent dies, even by SIGKILL (Linux): set in a server's child
    before exec (its parent: the driver), and in each torchrun process (its parent: the launcher)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def last_error_line(log: Path) -> str:
    """What a server said last before it exited: the last `SomeError: message` line of its latest
    start in its log (the end of a Python traceback), else its last line."""
    try:
        text = log.read_text(errors="replace").rsplit(START_MARKER, 1)[-1]
    except OSError:
        return f"it exited, and its log {log} cannot be read"
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if re.match(r"^([A-Za-z_][\w.]*)?(Error|Exception|Exit)\w*: ", line)]
    if errors:
        return re.sub(r"^(?:[a-z_][\w]*\.)+", "", errors[-1])  # without the module path
    return lines[-1] if lines else "it exited without a word"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_recorded(fleet_file: Path, marker: str) -> None:
    """Stop servers recorded in `fleet_file` that still run (left by a killed driver), with their
    child processes: each server led its own process group, and a live group id is never reused.
    `marker` must appear in the recorded PID's command line (the PID may be reused by now)."""
    if not fleet_file.exists():
        return
    for replica in json.loads(fleet_file.read_text()).get("replicas", []):
        pid = replica.get("pid")
        if not pid:
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            cmdline = None  # the server is gone; its group may live on
        if cmdline is not None and not (marker in cmdline and f"\0{replica['port']}\0" in cmdline):
            continue  # the pid now belongs to something else
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def stop_group(process: subprocess.Popen, grace_s: float = 15.0) -> None:
    """SIGTERM a server's process group (server + children), SIGKILL what is left."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    deadline = time.time() + grace_s
    while time.time() < deadline:
        try:
            os.killpg(process.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.2)
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.poll()


class LocalServers:
    """`count` servers of one kind on loopback, supervised by one thread."""

    def __init__(
        self, kind: str, run_root: str, count: int, launch: Launch, marker: str, wait_for_weights: bool = True
    ):
        self.kind, self.run_root, self.launch, self.marker = kind, run_root, launch, marker
        self.wait_for_weights = wait_for_weights
        self.dir = Path(run_root) / f"{kind}s"
        self.fleet_file = Path(fleet_uri(run_root, kind))
        logs = Path(run_root) / "logs"
        self.replicas = [
            Replica(url=f"http://127.0.0.1:{port}", port=port, log=str(logs / f"{kind}-{i}.log"))
            for i, port in enumerate(free_port() for _ in range(count))
        ]
        self.processes: dict[int, subprocess.Popen] = {}
        self.started_pids: list[int] = []  # every server ever started (restarts included)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._supervise, name=f"{kind}-servers", daemon=True)

    @property
    def urls(self) -> list[str]:
        return [r.url for r in self.replicas]

    def start(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        Path(self.replicas[0].log).parent.mkdir(parents=True, exist_ok=True)
        stop_recorded(self.fleet_file, self.marker)
        self._record()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        for index, process in self.processes.items():
            stop_group(process)
            self.replicas[index].state = "stopped"
        self._record()

    def kill(self, index: int, sig: int = signal.SIGKILL) -> None:
        """Kill one server process, as a crash would (tests and failure drills); the supervisor
        cleans up its process group and restarts it."""
        os.kill(self.processes[index].pid, sig)

    def _record(self) -> None:
        data = {"driver_pid": os.getpid(), "replicas": [asdict(r) for r in self.replicas]}
        tmp = self.fleet_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=2))
        tmp.replace(self.fleet_file)

    def _spawn(self, index: int) -> None:
        replica = self.replicas[index]
        argv, env = self.launch(replica.port)
        with open(replica.log, "ab") as log:
            log.write(f"\n{START_MARKER} {self.kind} on {replica.url}\n".encode())
            log.flush()
            process = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **env},
                start_new_session=True,  # its own process group: the server and its children
                preexec_fn=die_with_parent,
            )
        self.processes[index] = process
        self.started_pids.append(process.pid)
        replica.pid, replica.state = process.pid, "starting"

    def _supervise(self) -> None:
        latest = join(self.run_root, "weights", "LATEST")
        while not self._stop.is_set():
            changed = False
            for index, replica in enumerate(self.replicas):
                process = self.processes.get(index)
                if replica.state == "failed":
                    continue
                if process is None:
                    if not self.wait_for_weights or filesystem(latest)[0].exists(filesystem(latest)[1]):
                        self._spawn(index)
                        changed = True
                elif process.poll() is not None:
                    stop_group(process)  # a vLLM engine core outlives a crashed server
                    replica.restarts += 1
                    # killed from outside (a person, a test, the out-of-memory killer): bad luck, not a
                    # misconfiguration, even if it died before this loop (every 0.5 s) saw it answer /health
                    crash = replica.served or process.returncode in KILLED
                    if replica.restarts >= (MAX_RESTARTS + 1 if crash else STARTUP_ATTEMPTS):
                        replica.state, replica.error = "failed", last_error_line(Path(replica.log))
                    else:
                        self._spawn(index)
                        replica.state = "restarting"
                    changed = True
                elif replica.state != "ready" and is_healthy(replica.url):
                    replica.state, replica.served = "ready", True
                    changed = True
            if changed:
                self._record()
            self._stop.wait(0.5)
