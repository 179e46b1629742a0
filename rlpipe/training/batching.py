"""Batch rows into tensors: the update's order of rows, its mini-batches (one optimizer step each), their
micro-batches (one forward pass each, within trainer.micro_batch_tokens), each process's share of them,
and `pack`, which lays rows out as a typed `MicroBatch`."""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass

import torch

from rlpipe.algorithms.dpo import paired_rows
from rlpipe.algorithms.policy_gradient import Aggregation
from rlpipe.training.distributed import world

PER_TOKEN = {  # row column -> MicroBatch field
    "logprobs": "old_logprobs",
    "ref_logprobs": "ref_logprobs",  # offline DPO: the reference's, computed once
    "token_advantages": "advantages",  # a critic's (PPO), with:
    "returns": "returns",
    "values": "old_values",
    "proximal_logprobs": "proximal_logprobs",  # the update's starting weights' (off_policy_correction)
}


@dataclass(frozen=True)
class MicroBatch:
    """Rows packed for one forward pass: prompt + completion, right-padded to the longest (L tokens).
    Every other tensor is [B, T] over the completion window, positions start .. L - 2 with start =
    the shortest prompt's length - 1 (T = L - 1 - start): column j is position start + j, which
    predicts input_ids[:, start + j + 1]. No completion token lies before `start`, so the logits are
    computed only there (completion_logits): over the prompt they are most of a 49k-vocabulary
    model's largest tensor and ~20% of a small model's FLOPs, for nothing. Each row's values sit on
    its completion's columns:

        input_ids, attention   [B, L]
        completion_mask        [B, T]  1 where the target is a completion token the model sampled
                                       (a multi-turn row's loss_mask: 0 at environment tokens, so
                                       every loss, KL and entropy term skips them)
        advantages             [B, T]  A_it, the one shape every loss reads: a per-sequence A_i (the
                                       `advantage` column; 0 before the advantages step) along the
                                       whole row (an expanded view; the mask drops the padding), or a
                                       critic's per-token A_it (`token_advantages`), 0 off the completion
        old_logprobs, ref_logprobs, returns, old_values, proximal_logprobs
                               [B, T]  the PER_TOKEN columns the rows have, 0 off the completion; None
                                       where the rows lack the column
    """

    input_ids: torch.Tensor
    attention: torch.Tensor
    start: int
    completion_mask: torch.Tensor
    advantages: torch.Tensor
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    old_values: torch.Tensor | None = None
    proximal_logprobs: torch.Tensor | None = None

    @property
    def rows(self) -> int:
        return self.input_ids.shape[0]

    @property
    def targets(self) -> torch.Tensor:
        """[B, T]: the token each position of the window predicts."""
        return self.input_ids[:, self.start + 1 :]

    def to(self, device: torch.device) -> MicroBatch:
        moved = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return MicroBatch(**{n: t if t is None or isinstance(t, int) else t.to(device) for n, t in moved.items()})


def pack(rows: list[dict], pad_id: int) -> MicroBatch:
    """`rows` (prompt_token_ids, completion_token_ids, and any PER_TOKEN columns) as one MicroBatch."""
    width = max(len(r["prompt_token_ids"]) + len(r["completion_token_ids"]) for r in rows)
    window_start = min(len(r["prompt_token_ids"]) for r in rows) - 1
    n, t = len(rows), width - 1 - window_start
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    attention = torch.zeros((n, width), dtype=torch.long)
    completion_mask = torch.zeros((n, t))
    per_token = {name: torch.zeros((n, t)) for column, name in PER_TOKEN.items() if column in rows[0]}
    for i, row in enumerate(rows):
        prompt, completion = row["prompt_token_ids"], row["completion_token_ids"]
        sequence = prompt + completion
        input_ids[i, : len(sequence)] = torch.tensor(sequence)
        attention[i, : len(sequence)] = 1
        start = len(prompt) - 1 - window_start  # the window column of the first completion token
        loss_mask = row.get("loss_mask")
        completion_mask[i, start : start + len(completion)] = 1 if loss_mask is None else torch.tensor(loss_mask)
        for column, name in PER_TOKEN.items():
            if name in per_token:
                per_token[name][i, start : start + len(completion)] = torch.tensor(row[column])
    if "advantages" not in per_token:  # one per sequence, along its row
        sequence_advantages = torch.tensor([row.get("advantage", 0.0) for row in rows], dtype=torch.float32)
        per_token["advantages"] = sequence_advantages.unsqueeze(-1).expand(n, t)
    return MicroBatch(input_ids, attention, window_start, completion_mask, **per_token)


def window_column(row: dict, mb: MicroBatch) -> int:
    """The column of `row`'s first completion token in `mb`'s [B, T] tensors."""
    return len(row["prompt_token_ids"]) - 1 - mb.start


def trained_tokens(row: dict) -> int:
    """The row's completion tokens that carry a loss term: the model's (loss_mask), all without one."""
    loss_mask = row.get("loss_mask")
    return len(row["completion_token_ids"]) if loss_mask is None else int(sum(loss_mask))


def row_length(row: dict) -> int:
    return len(row["prompt_token_ids"]) + len(row["completion_token_ids"])


def update_order(rows: list[dict], pairs: bool, seed: int) -> list[dict]:
    """The rows in the order the update takes them: shuffled by `seed`; preference pairs (DPO) as
    rlpipe.algorithms.dpo.paired_rows lays them out, [chosen_1, rejected_1, chosen_2, ...]."""
    if pairs:
        return paired_rows(rows, seed)
    random.Random(seed).shuffle(rows)
    return rows


def mini_batches(rows: list[dict], count: int, unit: int = 1) -> list[list[dict]]:
    """`rows` in consecutive slices of ceil(len / count) rows (rounded up to whole units: a pair is 2 rows),
    one optimizer step each."""
    size = math.ceil(len(rows) / count)
    size += -size % unit
    return [rows[start : start + size] for start in range(0, len(rows), size)]


def micro_batches(rows: list[dict], budget: int | None, unit: int = 1) -> list[list[dict]]:
    """A mini-batch's rows in groups whose padded size (rows x longest sequence) fits `budget` tokens
    (trainer.micro_batch_tokens); a unit longer than the budget goes alone. `unit` consecutive rows stay
    together (2: a DPO pair). Units are sorted by length first, so little of each group is padding.
    budget None: one group."""
    if budget is None:
        return [rows]
    units = sorted((rows[i : i + unit] for i in range(0, len(rows), unit)), key=lambda u: max(map(row_length, u)))
    groups: list[list[dict]] = [[]]
    width = 0
    for rows_of_unit in units:
        longest = max(map(row_length, rows_of_unit))
        if groups[-1] and max(width, longest) * (len(groups[-1]) + unit) > budget:
            groups.append([])
            width = 0
        groups[-1] += rows_of_unit
        width = max(width, longest)
    return groups


# trainer.micro_batch_tokens "auto" on a CPU: a micro-batch's activations (1024 tokens x intermediate size
# x 4 bytes: 2-6 MB for the demo and SmolLM2) stay in cache, where one pass of the mini-batch streams them
# through memory (update 4.7 -> 3.9 s on the demo, 25 -> 20 s on SmolLM2-135M; 512-2048 within 5%).
CPU_MICRO_BATCH_TOKENS = 1024


def token_budget(micro_batch_tokens: int | str | None, device_type: str) -> int | None:
    """trainer.micro_batch_tokens with "auto" resolved for the device type ("cpu", "cuda"):
    CPU_MICRO_BATCH_TOKENS on a CPU; on a GPU, one pass per mini-batch (None), where larger matmuls run
    faster and memory is the bound."""
    if micro_batch_tokens != "auto":
        return micro_batch_tokens  # type: ignore[return-value]
    return CPU_MICRO_BATCH_TOKENS if device_type == "cpu" else None


def rank_parts(mini: list[dict], budget: int | None, unit: int = 1) -> list[tuple[list[dict], float]]:
    """This process's micro-batches of a mini-batch, as (rows, weight 1.0 or 0.0). Every process forms
    the same micro-batches (FSDP's collectives line up) and takes every world-th unit of each; one with
    no unit of a micro-batch computes that micro-batch's first unit with weight 0."""
    rank, processes = world()
    parts = []
    for group in micro_batches(mini, budget * processes if budget else None, unit):
        part = [r for k in range(rank * unit, len(group), processes * unit) for r in group[k : k + unit]]
        parts.append((part or group[:unit], float(bool(part))))
    return parts


def micro_batch_weight(mb: MicroBatch, rows: int, tokens: float, aggregation: Aggregation) -> float:
    """The share w_j of micro-batch j in its mini-batch's loss, so that sum_j w_j L_j = L:
        sequence_mean, sequence_sum  w_j = n_j / n          (n: sequences)
        token_mean                   w_j = T_j / T          (T: completion tokens)
    Gradients accumulate as sum_j w_j grad L_j = grad L: the one-pass update."""
    if aggregation in ("sequence_mean", "sequence_sum"):
        return mb.rows / rows
    return float(mb.completion_mask.sum()) / max(tokens, 1.0)
