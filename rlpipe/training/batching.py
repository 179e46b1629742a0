"""Batch rows into tensors: the update's order of rows, its mini-batches (one optimizer step each), their
micro-batches (one forward pass each, within trainer.micro_batch_tokens), each process's share of them,
and `pack`, which lays rows out as a typed `MicroBatch`."""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass
from typing import Any

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
    """Rows laid out for one forward pass: prompt + completion, right-padded to the longest (L tokens), or
    packed end to end without padding (trainer.padding_free, rlpipe.training.packed_attention).
    Every other tensor is [B, T] over the completion window, positions start .. L - 2 with start =
    the shortest prompt's length - 1 (T = L - 1 - start): column j is position start + j, which
    predicts the row's token start + j + 1. No completion token lies before `start`, so the logits are
    computed only there (completion_logits): over the prompt they are most of a 49k-vocabulary
    model's largest tensor and ~20% of a small model's FLOPs, for nothing. Each row's values sit on
    its completion's columns, in either layout:

        input_ids, attention   [B, L] padded; packed: input_ids [1, N] (N = the rows' tokens), attention None
        positions              packed: [1, N] each row's positions 0 .. n_i - 1 (None padded)
        row_ends               packed: [B + 1] 0, n_1, n_1 + n_2, .., N (flash attention's cu_seq_lens; the
                               rows laid out shortest first, so row_ends' order is theirs, not the [B, T] rows')
        window_index           packed: [B, T] the packed position of each window column (0 past a row's end)
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
    attention: torch.Tensor | None
    start: int
    completion_mask: torch.Tensor
    advantages: torch.Tensor
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    old_values: torch.Tensor | None = None
    proximal_logprobs: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    row_ends: torch.Tensor | None = None
    window_index: torch.Tensor | None = None

    @property
    def rows(self) -> int:
        return self.completion_mask.shape[0]

    @property
    def packed(self) -> bool:
        return self.positions is not None

    @property
    def tokens(self) -> int:
        """The rows' tokens (prompts and completions)."""
        if self.packed:
            return self.input_ids.shape[1]
        assert self.attention is not None  # padded: pack sets the attention mask
        return int(self.attention.sum())

    @property
    def targets(self) -> torch.Tensor:
        """[B, T]: the token each position of the window predicts."""
        if self.packed:
            assert self.window_index is not None  # packed: packed_layout sets the window index
            return self.input_ids[0, (self.window_index + 1).clamp(max=self.input_ids.shape[1] - 1)]
        return self.input_ids[:, self.start + 1 :]

    def to(self, device: torch.device | str) -> MicroBatch:
        moved: dict[str, Any] = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        fields: dict[str, Any] = {n: t if t is None or isinstance(t, int) else t.to(device) for n, t in moved.items()}
        return MicroBatch(**fields)


def pack(rows: list[dict], pad_id: int, packed: bool = False) -> MicroBatch:
    """`rows` (prompt_token_ids, completion_token_ids, and any PER_TOKEN columns) as one MicroBatch:
    right-padded, or with `packed` end to end (see MicroBatch)."""
    width = max(map(row_length, rows))
    window_start = min(len(r["prompt_token_ids"]) for r in rows) - 1
    n, t = len(rows), width - 1 - window_start
    completion_mask = torch.zeros((n, t))
    per_token = {name: torch.zeros((n, t)) for column, name in PER_TOKEN.items() if column in rows[0]}
    sequences = [row["prompt_token_ids"] + row["completion_token_ids"] for row in rows]
    layout: dict[str, Any]  # MicroBatch's layout fields: input_ids, attention (and the packed ones)
    if packed:
        layout = packed_layout(sequences, window_start, t)
    else:
        layout = {"input_ids": torch.full((n, width), pad_id, dtype=torch.long)}
        layout["attention"] = torch.zeros((n, width), dtype=torch.long)
        for i, sequence in enumerate(sequences):
            layout["input_ids"][i, : len(sequence)] = torch.tensor(sequence)
            layout["attention"][i, : len(sequence)] = 1
    for i, row in enumerate(rows):
        prompt, completion = row["prompt_token_ids"], row["completion_token_ids"]
        start = len(prompt) - 1 - window_start  # the window column of the first completion token
        loss_mask = row.get("loss_mask")
        completion_mask[i, start : start + len(completion)] = 1 if loss_mask is None else torch.tensor(loss_mask)
        for column, name in PER_TOKEN.items():
            if name in per_token:
                per_token[name][i, start : start + len(completion)] = torch.tensor(row[column])
    if "advantages" not in per_token:  # one per sequence, along its row
        sequence_advantages = torch.tensor([row.get("advantage", 0.0) for row in rows], dtype=torch.float32)
        per_token["advantages"] = sequence_advantages.unsqueeze(-1).expand(n, t)
    return MicroBatch(start=window_start, completion_mask=completion_mask, **layout, **per_token)


def packed_layout(sequences: list[list[int]], window_start: int, t: int) -> dict[str, torch.Tensor | None]:
    """MicroBatch's packed tensors: the sequences end to end, shortest first (rows of one length adjacent:
    one attention call each, rlpipe.training.packed_attention), their positions, row ends and window index."""
    lengths = torch.tensor([len(s) for s in sequences])
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    row_ends = torch.cat([torch.zeros(1, dtype=torch.long), lengths[order].cumsum(0)])
    offsets = torch.empty_like(lengths)
    offsets[order] = row_ends[:-1]
    columns = torch.arange(t)
    # window column j of row i is the row's position window_start + j, packed at offsets[i] + window_start + j
    window_index = offsets[:, None] + window_start + columns
    window_index = window_index.masked_fill(window_start + columns + 1 >= lengths[:, None], 0)
    return {
        "input_ids": torch.tensor([token for i in order for token in sequences[i]]).unsqueeze(0),
        "attention": None,
        "positions": torch.cat([torch.arange(len(sequences[i])) for i in order]).unsqueeze(0),
        "row_ends": row_ends.to(torch.int32),
        "window_index": window_index,
    }


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


def micro_batches(rows: list[dict], budget: int | None, unit: int = 1, packed: bool = False) -> list[list[dict]]:
    """A mini-batch's rows in groups whose size fits `budget` tokens (trainer.micro_batch_tokens): rows x
    longest sequence when padded, the rows' tokens when `packed`; a unit longer than the budget goes alone.
    `unit` consecutive rows stay together (2: a DPO pair). Units are sorted by length first, so little of
    each padded group is padding. budget None: one group."""
    if budget is None:
        return [rows]
    units = sorted((rows[i : i + unit] for i in range(0, len(rows), unit)), key=lambda u: max(map(row_length, u)))
    groups: list[list[dict]] = [[]]
    width = tokens = 0
    for rows_of_unit in units:
        longest = max(map(row_length, rows_of_unit))
        size = tokens + sum(map(row_length, rows_of_unit)) if packed else max(width, longest) * (len(groups[-1]) + unit)
        if groups[-1] and size > budget:
            groups.append([])
            width = tokens = 0
        groups[-1] += rows_of_unit
        width, tokens = max(width, longest), tokens + sum(map(row_length, rows_of_unit))
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


def rank_parts(
    mini: list[dict], budget: int | None, unit: int = 1, packed: bool = False
) -> list[tuple[list[dict], float]]:
    """This process's micro-batches of a mini-batch, as (rows, weight 1.0 or 0.0). Every process forms
    the same micro-batches (FSDP's collectives line up) and takes every world-th unit of each; one with
    no unit of a micro-batch computes that micro-batch's first unit with weight 0."""
    rank, processes = world()
    parts = []
    for group in micro_batches(mini, budget * processes if budget else None, unit, packed):
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
