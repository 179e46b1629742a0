"""Algorithms: what each needs, its advantage estimator and its policy loss; `algorithm.name`
selects one. The advantages step is `compute_advantages` below.

An algorithm is a record, not a class hierarchy (as verl's registries and torchtune's loss
modules):
    advantages(rewards, group_ids, options) -> (advantage per completion, zero-variance mask)
        numpy only: the advantages step never imports torch
    loss(logprobs, old_logprobs, advantages, mask, ref_logprobs, options) -> (loss, stats)
        torch, called by the update only
where `options` is the spec's `algorithm` section. Register one with `register_algorithm`;
`algorithm.name` is a registered name, or 'package.module:name' for one that module registers
(imported first, in every step's process, so a KFP task finds it too).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from rlpipe.plugins import look_up
from rlpipe.rollouts import read_table, write_table

if TYPE_CHECKING:
    from rlpipe.spec import RunSpec


@dataclass(frozen=True)
class Algorithm:
    name: str
    needs: frozenset[str]  # what the run provides it: "groups" (G samples per prompt), "reference" (frozen v0)
    advantages: Callable[..., tuple[np.ndarray, np.ndarray]]
    loss: Callable[..., tuple[Any, dict[str, Any]]]


ALGORITHMS: dict[str, Algorithm] = {}


def register_algorithm(algorithm: Algorithm) -> Algorithm:
    ALGORITHMS[algorithm.name] = algorithm
    return algorithm


def get_algorithm(name: str) -> Algorithm:
    """The algorithm `name` ('grpo', or 'package.module:name') names; a clear error otherwise."""
    return look_up(name, ALGORITHMS, "algorithm.name", "algorithm", "rlpipe.algorithms.register_algorithm")[1]


def compute_advantages(spec: RunSpec, scored_path: str, out_path: str) -> dict[str, float]:
    """Add the `advantage` column; count groups whose rewards were all equal."""
    started = time.time()
    table = read_table(scored_path)
    if "reward" not in table.column_names:
        raise ValueError(f"{scored_path} has no reward column: run score before advantages")
    group_ids = table.column("group_id").to_numpy()
    algorithm = get_algorithm(spec.algorithm.name)
    advantages, zero_variance = algorithm.advantages(table.column("reward").to_numpy(), group_ids, spec.algorithm)
    write_table(table.append_column("advantage", [np.asarray(advantages, dtype=np.float32)]), out_path)
    groups = np.unique(group_ids)
    zero_groups = np.unique(group_ids[zero_variance])
    return {
        "groups/zero_variance_fraction": len(zero_groups) / len(groups),
        "advantage/abs_mean": float(np.abs(advantages).mean()),
        "time/advantages_s": time.time() - started,
    }


from rlpipe.algorithms import grpo  # noqa: E402, F401 (registers the built-in algorithms; needs the names above)
