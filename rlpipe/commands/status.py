"""Where a run stands (`rlpipe status RUN`): from its run root alone, so it works for a local run, a
killed one, or a cluster run whose root is mounted here."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from rlpipe.metric_keys import EVAL_ACCURACY, EVAL_STRICT, EVAL_WEIGHTS_VERSION, REWARD_MEAN
from rlpipe.store.run_root import filesystem, join, list_metrics, read_json, read_state

SERVICES = ("trainer", "sampler", "producer")  # long-lived processes `rlpipe run` records in <kind>s/fleet.json


def alive(pid: int | None, marker: str) -> bool:
    """A local process with this PID runs and its command line names `marker` (PIDs are reused)."""
    try:
        return bool(pid) and marker in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False


def run_status(run_root: str) -> dict[str, Any]:
    """The run's committed iteration and target, weights versions kept, the latest reward, every eval, why
    it stopped, where it was forked from, its MLflow run, and which of its local processes run."""
    state = read_state(run_root)
    spec = read_json(join(run_root, "spec.json")) or {}
    if state is None:
        return {"run_root": run_root, "initialized": False}
    fs, weights = filesystem(join(run_root, "weights"))
    versions = sorted(
        int(p.rsplit("/v", 1)[-1]) for p in fs.ls(weights, detail=False) if p.rsplit("/", 1)[-1][1:].isdigit()
    )
    iterations = list_metrics(run_root, "iter")
    last = iterations.get(state["iteration"], {})
    running = {}
    for kind in SERVICES:
        fleet = read_json(join(run_root, f"{kind}s", "fleet.json")) or {}
        pids = [r.get("pid") for r in fleet.get("replicas", [])]
        running[kind] = sum(alive(pid, kind) for pid in pids)
    log = Path(run_root) / "logs" / "kfp-local.log"
    evals = list_metrics(run_root, "eval")
    return {
        "run_root": run_root,
        "initialized": True,
        "name": spec.get("name"),
        "iteration": state["iteration"],
        "iterations": (spec.get("loop") or {}).get("iterations"),
        "weights_version": state["weights_version"],
        "weights_sha256": state["weights_sha256"],
        "versions_kept": versions,
        "reward_mean": last.get(REWARD_MEAN),
        "evals": {n: m[EVAL_ACCURACY] for n, m in sorted(evals.items())},
        "evals_strict": {n: m[EVAL_STRICT] for n, m in sorted(evals.items()) if EVAL_STRICT in m},
        "last_eval": last_eval(evals),
        "stopped": state.get("stopped"),
        "forked_from": state.get("forked_from"),
        "mlflow_run_id": state.get("mlflow_run_id"),
        "running": running,
        "last_activity_s": time.time() - max(state.get("updated_at", 0.0), log.stat().st_mtime if log.exists() else 0),
    }


def last_eval(evals: dict[int, dict[str, float]]) -> dict[str, Any] | None:
    """The last eval's held-out metrics beyond greedy accuracy (sampled: mean_at_k, pass_at_j, maj_at_k;
    the evaluation.sets'), with its iteration; None before any."""
    if not evals:
        return None
    iteration = max(evals)
    shown = {
        key: value
        for key, value in sorted(evals[iteration].items())
        if key.startswith("eval/") and key not in (EVAL_ACCURACY, EVAL_STRICT, EVAL_WEIGHTS_VERSION)
    }
    return {"iteration": iteration, "metrics": shown}


def describe(status: dict[str, Any]) -> str:
    """`run_status` as lines a person reads."""
    if not status["initialized"]:
        return f"{status['run_root']}: not initialized (no state.json): `rlpipe run` starts it"
    lines = [f"run {status['name']} at {status['run_root']}"]
    versions = ", ".join(map(str, status["versions_kept"]))
    sha = status["weights_sha256"][:12]
    lines.append(
        f"  iteration   {status['iteration']} of {status['iterations']} committed "
        f"(weights v{status['weights_version']}, sha256 {sha}...); versions kept: {versions}"
    )
    if status["reward_mean"] is not None:
        lines.append(f"  reward      {status['reward_mean']:.3f} (mean, iteration {status['iteration']})")
    if status["evals"]:
        shown = ", ".join(f"{n}: {a:.3f}" for n, a in status["evals"].items())
        lines.append(f"  held-out    greedy accuracy by iteration  {shown}")
    if status["evals_strict"]:
        shown = ", ".join(f"{n}: {a:.3f}" for n, a in status["evals_strict"].items())
        lines.append(f"              strict accuracy by iteration  {shown}")
    if status.get("last_eval") and status["last_eval"]["metrics"]:
        shown = ", ".join(f"{k.removeprefix('eval/')} {v:.3f}" for k, v in status["last_eval"]["metrics"].items())
        lines.append(f"              at iteration {status['last_eval']['iteration']}: {shown}")
    if stopped := status["stopped"]:
        lines.append(f"  stopped     at iteration {stopped['iteration']}: {stopped['reason']}")
        if stopped.get("sign"):  # a degenerate start or no reward (rlpipe.evaluation.diagnosis), not the eval gate
            lines.append(f"              likely causes: {stopped['causes']}")
            lines.append(f"              try: {stopped['remedy']}; then start a new run (a resumed run keeps its spec)")
    if status["forked_from"]:
        parent = status["forked_from"]
        lines.append(f"  forked from {parent['run_root']} at iteration {parent['iteration']}")
    if status["mlflow_run_id"]:
        lines.append(f"  MLflow run  {status['mlflow_run_id']}")
    busy = [f"{n} {kind}(s)" for kind, n in status["running"].items() if n]
    idle = f"last change {status['last_activity_s']:.0f} s ago"
    lines.append(f"  running     {', '.join(busy) if busy else 'nothing here'} ({idle})")
    return "\n".join(lines)


def as_json(status: dict[str, Any]) -> str:
    return json.dumps(status, indent=2, default=str)
