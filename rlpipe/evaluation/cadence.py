"""When the loop evaluates (loop.eval_every), from the spec and state.json; torch-free, so the plan and
evaluate steps decide before importing torch.

    iteration N is due an eval when N == 0, N % loop.eval_every == 0 or N == loop.iterations
    (the eval gate, loop.stop_when, which ends the loop after an eval: rlpipe.evaluation.stopping)
"""

from __future__ import annotations

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
