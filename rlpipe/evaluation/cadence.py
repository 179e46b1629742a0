"""When the loop evaluates and when its eval gate stops it (loop.eval_every, loop.stop_when), from the
spec and state.json; torch-free, so the plan and evaluate steps decide before importing torch.

    iteration N is due an eval when N == 0, N % loop.eval_every == 0 or N == loop.iterations;
    the loop stops after an eval whose metrics pass loop.stop_when ("eval/accuracy_greedy >= 0.7"),
    and stays stopped while the spec keeps that gate (state.json records it: rlpipe.store.commit).
"""

from __future__ import annotations

import operator
import re

from rlpipe.spec import RunSpec
from rlpipe.store.run_root import eval_metrics_uri, filesystem, read_state


def eval_due(spec: RunSpec, iteration: int) -> bool:
    return iteration == 0 or iteration % spec.loop.eval_every == 0 or iteration == spec.loop.iterations


def eval_sets_due(spec: RunSpec, iteration: int) -> list:
    """The evaluation.sets evaluated at iteration N, an eval's: those whose `every` divides N (all when
    null), and every set at the first and last."""
    if not eval_due(spec, iteration):
        return []
    return [
        held_out
        for held_out in spec.evaluation.sets
        if iteration in (0, spec.loop.iterations) or iteration % (held_out.every or spec.loop.eval_every) == 0
    ]


STOP_OPERATORS = {">=": operator.ge, "<=": operator.le, ">": operator.gt, "<": operator.lt}


def parse_gate(stop_when: str) -> tuple[str, str, float]:
    """loop.stop_when's (metric, operator, threshold): "eval/accuracy_greedy >= 0.7"."""
    name, op, threshold = re.fullmatch(r"\s*(\S+?)\s*(>=|<=|>|<)\s*(\S+)\s*", stop_when).groups()
    return name, op, float(threshold)


def stop_reason(spec: RunSpec, metrics: dict[str, float]) -> str | None:
    """Why the loop stops after an eval with `metrics` (loop.stop_when holds), or None."""
    if not spec.loop.stop_when:
        return None
    name, op, threshold = parse_gate(spec.loop.stop_when)
    if name not in metrics:
        return None
    value = metrics[name]
    return f"{name} {value:.4g} {op} {threshold:g}" if STOP_OPERATORS[op](value, threshold) else None


def stopped_by_gate(spec: RunSpec, state: dict) -> dict | None:
    """state.json's record of the eval gate that stopped the loop, while the spec still has that gate
    (changing or removing loop.stop_when lets a stopped run go on)."""
    stopped = state.get("stopped")
    return stopped if stopped and spec.loop.stop_when and stopped.get("when") == spec.loop.stop_when else None


def iterations_to_next_eval(spec: RunSpec, iteration: int) -> int:
    """From committed `iteration`, how many iterations until the next one due an eval (eval_due)."""
    k = 1
    while not eval_due(spec, iteration + k) and iteration + k < spec.loop.iterations:
        k += 1
    return k


def evaluation_pending(spec: RunSpec, run_root: str, iteration: int) -> bool:
    """Due for `iteration`, committed, and not yet recorded (so a rerun after a kill evaluates once)."""
    state = read_state(run_root) or {}
    if not eval_due(spec, iteration) or state.get("iteration", -1) < iteration:
        return False
    fs, path = filesystem(eval_metrics_uri(run_root, iteration))
    return not fs.exists(path)
