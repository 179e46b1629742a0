"""Which train rows each iteration's prompts are: consecutive slices of a per-epoch shuffle, and dynamic
sampling's refill (algorithm.dynamic_sampling). The generate step, the rollout buffer and the producer
all ask here, so every path takes the same prompts for the same iteration."""

from __future__ import annotations

import math
import random
from typing import TYPE_CHECKING

from rlpipe.metric_keys import ZERO_VARIANCE_GROUPS

if TYPE_CHECKING:
    from rlpipe.spec import RunSpec


def prompt_indices(num_rows: int, per_iteration: int, iteration: int, seed: int) -> list[int]:
    """Rows for `iteration` (1-based): consecutive slices of a per-epoch shuffle of the train set.

    data cursor = (iteration - 1) * per_iteration; epoch e uses permutation Random((seed, e)).
    """
    cursor = (iteration - 1) * per_iteration
    indices: list[int] = []
    while len(indices) < per_iteration:
        epoch, offset = divmod(cursor, num_rows)
        order = list(range(num_rows))
        random.Random(f"{seed}-{epoch}").shuffle(order)
        take = order[offset : offset + per_iteration - len(indices)]
        indices += take
        cursor += len(take)
    return indices


REFILL_MARGIN = 1.1  # dynamic sampling samples 10% more than the last informative fraction asks for


def iteration_prompts(spec: RunSpec, run_root: str, num_rows: int, iteration: int) -> list[int]:
    """The iteration's prompt rows: its slice of the data (`prompt_indices`), then, with dynamic
    sampling (algorithm.dynamic_sampling), refill prompts drawn apart from that slice:
        sampled = clamp(ceil(margin P / f), P, floor(P max_oversample))
    P = rollout.prompts_per_iteration, f = the informative (non-zero-spread) fraction of the previous
    iteration's groups (asynchronous runs: of iteration N - 1 - loop.max_staleness, the last one
    committed before iteration N's rollouts may be sampled); the first iteration, with none before it,
    samples the cap. The advantages step keeps the first P informative groups."""
    from rlpipe.algorithms import resolve_options
    from rlpipe.store.run_root import iteration_metrics_uri, read_json

    options, per_iteration = resolve_options(spec), spec.rollout.prompts_per_iteration
    order = prompt_indices(num_rows, per_iteration, iteration, spec.seed)
    if not options.dynamic_sampling:
        return order
    cap = math.floor(per_iteration * options.max_oversample)
    known = iteration - 1 - spec.loop.max_staleness  # committed before iteration's rollouts may be sampled
    previous = read_json(iteration_metrics_uri(run_root, known)) if known >= 1 else None
    informative = 1.0 - previous[ZERO_VARIANCE_GROUPS] if previous else 0.0
    wanted = cap if informative <= 0 else math.ceil(REFILL_MARGIN * per_iteration / informative)
    extra = min(max(wanted, per_iteration), cap) - per_iteration
    taken = set(order)
    rest = [row for row in range(num_rows) if row not in taken]
    return order + random.Random(f"{spec.seed}-refill-{iteration}").sample(rest, min(extra, len(rest)))
