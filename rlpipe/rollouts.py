"""The rollout record: one Parquet schema that every engine and step reads and writes.

rollouts  one row per completion (what generate emits): ROLLOUT_SCHEMA, with rollout.environment
          TRAJECTORY_SCHEMA too, then the data's other columns (reference, ...) as the prepare step
          wrote them, for the reward functions
scored    + reward, reward/<name> components              (score)
batch     + advantage                                       (advantages)
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

ROLLOUT_SCHEMA = pa.schema(
    [
        ("prompt_id", pa.int64()),  # row index in the train set
        ("group_id", pa.int64()),  # one group = the G samples of one prompt
        ("sample_index", pa.int32()),  # 0..G-1 within the group
        ("prompt", pa.string()),  # the text the model saw (templates and chat template applied)
        ("prompt_token_ids", pa.list_(pa.int32())),
        ("completion_token_ids", pa.list_(pa.int32())),  # through the first eos, if any
        ("logprobs", pa.list_(pa.float32())),  # sampling log-prob of each completion token
        ("finish_reason", pa.string()),  # "stop" (eos) or "length"
        ("completion", pa.string()),  # decoded completion text, eos excluded
        ("weights_version", pa.int64()),  # policy version that sampled this row
        ("iteration", pa.int64()),
    ]
)


# A multi-turn trajectory (rlpipe.environments) is one row: completion_token_ids hold the model's and the
# environment's tokens after the prompt, logprobs 0.0 at the environment's, `completion` is the last
# model turn (what verifiers judge) and finish_reason "stop" (the environment ended it), "length"
# (token budget), "turns" (turn limit) or "error". Its own columns:
TRAJECTORY_SCHEMA = pa.schema(
    [
        ("loss_mask", pa.list_(pa.int8())),  # per completion token: 1 = the model's, 0 = the environment's
        ("turn_offsets", pa.list_(pa.int32())),  # where each model turn starts in completion_token_ids
        ("turn_rewards", pa.list_(pa.float32())),  # the environment's reward for each model turn
        ("environment_reward", pa.float32()),  # their sum (reward type `environment` reads it)
        ("turns", pa.int32()),  # model turns
        ("tool_calls", pa.int32()),
        ("environment_error", pa.string()),  # why the environment ended it ("" when it did not fail)
        ("transcript", pa.string()),  # the whole completion decoded, observations included
    ]
)


@dataclass
class Completions:
    """What every generation engine returns, one entry per completion (prompt-major)."""

    token_ids: list[list[int]]  # through the first eos (inclusive) when one was sampled
    logprobs: list[list[float]]  # log pi_sampler(token | prefix) at the temperature, one per token
    finish_reasons: list[str]  # "stop" or "length"
    token_versions: list[list[int]] | None = None  # a partial rollout's: the version that sampled each token

    def extend(self, other: "Completions") -> None:
        self.token_ids += other.token_ids
        self.logprobs += other.logprobs
        self.finish_reasons += other.finish_reasons
        if other.token_versions is not None:
            self.token_versions = (self.token_versions or []) + other.token_versions

    def select(self, rows: list[int]) -> "Completions":
        """The completions at `rows`, in that order."""
        versions = self.token_versions
        return Completions(
            [self.token_ids[r] for r in rows],
            [self.logprobs[r] for r in rows],
            [self.finish_reasons[r] for r in rows],
            [versions[r] for r in rows] if versions is not None else None,
        )


def length_metrics(lengths: list[int]) -> dict[str, float]:
    """The completions' token counts: mean, p50, p99 (nearest rank) and max; the tail a batch decodes
    through is the max, what the update trains on is the mean."""
    ordered = sorted(lengths)
    rank = lambda q: ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]  # noqa: E731
    return {
        "rollout/completion_tokens_mean": sum(ordered) / len(ordered),
        "rollout/completion_tokens_p50": float(rank(0.50)),
        "rollout/completion_tokens_p99": float(rank(0.99)),
        "rollout/completion_tokens_max": float(ordered[-1]),
    }


def typed_table(rows: dict[str, list[Any]] | pa.Table, schema: pa.Schema) -> pa.Table:
    """Columns (or a table) with `schema`'s columns first, cast to it, then the rest."""
    table = rows if isinstance(rows, pa.Table) else pa.table(rows)
    rest = [name for name in table.column_names if name not in schema.names]
    typed = table.select(schema.names).cast(schema)
    for name in rest:
        typed = typed.append_column(table.schema.field(name), table.column(name))
    return typed


def write_table(rows: dict[str, list[Any]] | pa.Table, path: str | Path, schema: pa.Schema | None = None) -> None:
    """Write columns (or a table) to Parquet, typed by `schema` when one is given (`typed_table`)."""
    table = rows if isinstance(rows, pa.Table) else pa.table(rows)
    pq.write_table(typed_table(table, schema) if schema is not None else table, str(path))


@contextmanager
def parquet_file(path: str | Path) -> Iterator[pq.ParquetFile]:
    """A Parquet file, open, from a local path or an fsspec URI (gs://, s3://, ...). pq.ParquetFile rather
    than pq.read_table, which imports pyarrow.dataset: ~0.3 s in each step process that reads one."""
    if "://" not in str(path):
        yield pq.ParquetFile(str(path))
        return
    from rlpipe.store.run_root import filesystem  # fsspec: score and advantages read local artifacts only

    fs, remote = filesystem(str(path))
    with fs.open(remote, "rb") as f:
        yield pq.ParquetFile(f)


def read_table(path: str | Path) -> pa.Table:
    """A Parquet table from a local path or an fsspec URI (`parquet_file`)."""
    with parquet_file(path) as f:
        return f.read()


def table_rows(path: str | Path) -> int:
    """A Parquet table's row count, from its footer: none of its rows are read."""
    with parquet_file(path) as f:
        return f.metadata.num_rows


# what the score and advantages steps add to the rollout columns
SCORED_COLUMNS = ("reward", "advantage")


def validate_rollouts(table: pa.Table) -> None:
    """Fail with a clear message if a table does not carry the rollout columns."""
    missing = [name for name in ROLLOUT_SCHEMA.names if name not in table.column_names]
    if missing:
        raise ValueError(f"rollouts are missing columns {missing}; they must follow rlpipe.rollouts.ROLLOUT_SCHEMA")
