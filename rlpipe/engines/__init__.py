"""Generation engines, and the generate step's work where it runs (`generate_rollouts`).

Every engine (rollout.engine) is a module with one function (the Engine protocol), one typed record
in and one out:
    sample_prompts(SampleRequest) -> Sampled
`prompt_ids` are the prompts' token ids as the prepare step computed them (rlpipe.data.prompts).
  torch    rlpipe.engines.torch_engine    the HF model in this process, batched KV-cache sampling, or
                                          the resident trainer's in memory (`loaded`, colocated as TRL)
  vllm     rlpipe.engines.vllm_engine     vllm.LLM in this process
  sampler  rlpipe.engines.sampler_engine  long-lived vLLM servers; an HTTP client, no torch
"""

from __future__ import annotations

import importlib
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import pyarrow as pa

from rlpipe.metric_keys import GENERATE_LOAD, GENERATE_TIME, GENERATE_TOKENS_PER_S
from rlpipe.rollouts import (
    ROLLOUT_SCHEMA,
    TRAJECTORY_SCHEMA,
    Completions,
    length_metrics,
    read_table,
    typed_table,
    write_table,
)
from rlpipe.store.run_root import data_uri
from rlpipe.store.weights import WeightRef

if TYPE_CHECKING:
    from rlpipe.environments import Codec, Trajectory
    from rlpipe.spec import RunSpec

ENGINES = {
    "torch": "rlpipe.engines.torch_engine",
    "vllm": "rlpipe.engines.vllm_engine",
    "sampler": "rlpipe.engines.sampler_engine",
}


@dataclass(frozen=True)
class LoadedModel:
    """A model in memory at some weights version to sample with: the resident trainer's or the producer's."""

    model: Any
    tokenizer: Any
    refresh: Any = None  # a partial rollout's rlpipe.engines.torch_engine.Refresh (the rollout producer's)
    publish: Any = None  # the rollout producer's: called with each group the decode step it finishes (torch)


@dataclass(frozen=True)
class Sampling:
    """How every engine samples a group: `samples` completions per prompt, each up to `max_new_tokens`
    (the torch engine `batch_size` sequences per forward; vLLM batches itself and ignores top_k/top_p,
    as its rollouts always have)."""

    samples: int
    max_new_tokens: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    batch_size: int = 64
    ignore_eos: bool = False  # benchmarks: every completion max_new_tokens long
    bf16: bool = False  # the torch engine's forward passes autocast to bfloat16 (trainer.dtype)

    @classmethod
    def of(cls, spec: RunSpec) -> Sampling:
        """spec.rollout's settings (and the trainer's dtype, which the torch engine samples in)."""
        r = spec.rollout
        bf16 = spec.trainer.dtype == "bfloat16"
        return cls(r.samples_per_prompt, r.max_new_tokens, r.temperature, r.top_k, r.top_p, r.batch_size, bf16=bf16)


@dataclass(frozen=True)
class SampleRequest:
    """One engine call: rollout.samples_per_prompt completions of each prompt with the policy at `weights`."""

    spec: RunSpec
    run_root: str
    weights: WeightRef
    cache_root: str
    prompt_ids: list[list[int]]  # the prompts' token ids, as the prepare step computed them
    stream: int  # seeds the sampling: the iteration, or a producer's batch
    loaded: LoadedModel | None = None  # one already in memory at `weights` (torch engine: the resident trainer's)
    rows: list[dict] | None = None  # the prompts' data rows, for rollout.environment's multi-turn trajectories


class Engine(Protocol):
    """What rlpipe.engines.torch_engine, vllm_engine and sampler_engine each are."""

    def sample_prompts(self, request: SampleRequest) -> Sampled: ...


@dataclass
class Sampled:
    """What an engine returns for the iteration's prompts."""

    completions: Completions  # samples_per_prompt per prompt, prompt-major
    texts: list[str]  # decoded completions
    loaded_at: float  # wall clock when the model was ready (load time = loaded_at - step start)
    metrics: dict[str, float]  # the engine's own (samplers/*)
    columns: dict[str, list] = field(default_factory=dict)  # per completion: a trajectory's (TRAJECTORY_SCHEMA)

    def select(self, rows: list[int]) -> Sampled:
        """The completions at `rows` (the engine's metrics left out)."""
        columns = {
            name: values.take(rows) if isinstance(values, pa.Array) else [values[r] for r in rows]
            for name, values in self.columns.items()
        }
        return Sampled(self.completions.select(rows), [self.texts[r] for r in rows], self.loaded_at, {}, columns)


def sampled_trajectories(trajectories: list[Trajectory], codec: Codec, loaded_at: float) -> Sampled:
    """Trajectories as an engine's Sampled: the completions, the last turns' texts, the
    TRAJECTORY_SCHEMA columns, and the rollout/ metrics of turns and tool calls."""
    from rlpipe.environments import trajectory_metrics

    completions = Completions(
        [t.completion_token_ids for t in trajectories],
        [t.logprobs for t in trajectories],
        [t.finish_reason for t in trajectories],
    )
    values = {
        "loss_mask": [t.loss_mask for t in trajectories],
        "turn_offsets": [t.turn_offsets for t in trajectories],
        "turn_rewards": [t.turn_rewards for t in trajectories],
        "environment_reward": [sum(t.turn_rewards) for t in trajectories],
        "turns": [len(t.turn_offsets) for t in trajectories],
        "tool_calls": [t.tool_calls for t in trajectories],
        "environment_error": [t.error for t in trajectories],
        "transcript": [codec.decode(ids) for ids in completions.token_ids],
    }
    columns = {field.name: pa.array(values[field.name], field.type) for field in TRAJECTORY_SCHEMA}
    return Sampled(
        completions, [t.final_text for t in trajectories], loaded_at, trajectory_metrics(trajectories), columns
    )


def sample_seed(seed: int, iteration: int) -> int:
    """Seed of this iteration's sampling; vLLM engines seed sample j of prompt i with
    sample_seed + i * G + j."""
    return (seed * 1_000_003 + iteration * 65_537) % (2**31 - 4096)


def generate_rollouts(
    spec: RunSpec,
    run_root: str,
    weights: WeightRef,
    iteration: int,
    out_path: str,
    cache_root: str,
    loaded: LoadedModel | None = None,
) -> dict[str, float]:
    """Write one rollout row per completion to `out_path` (Parquet); return step metrics.
    `loaded`: sample with a model already in memory at `weights` (torch engine; the resident
    trainer's)."""
    t0 = time.time()
    table = read_train_rows(run_root)
    from rlpipe.data.order import iteration_prompts

    order = iteration_prompts(spec, run_root, table.num_rows, iteration)
    sampled = sample_rows(spec, run_root, weights, cache_root, table, order, iteration, loaded)
    sampled_at = time.time()
    completions = sampled.completions
    write_table(rollout_table(spec, table, order, list(range(len(order))), iteration, sampled, weights), out_path)
    lengths = [len(t) for t in completions.token_ids]
    return (
        sampled.metrics
        | length_metrics(lengths)
        | {
            GENERATE_LOAD: sampled.loaded_at - t0,
            GENERATE_TIME: time.time() - sampled.loaded_at,
            GENERATE_TOKENS_PER_S: sum(lengths) / max(sampled_at - sampled.loaded_at, 1e-9),
            "rollout/stop_fraction": sum(r == "stop" for r in completions.finish_reasons) / len(lengths),
        }
    )


def read_train_rows(run_root: str) -> pa.Table:
    """data/train.parquet, as the prepare step wrote it."""
    return read_table(data_uri(run_root, "train"))


def sample_rows(
    spec: RunSpec,
    run_root: str,
    weights: WeightRef,
    cache_root: str,
    table: pa.Table,
    order: list[int],
    stream: int,
    loaded: LoadedModel | None = None,
) -> Sampled:
    """rollout.samples_per_prompt completions of each train row in `order` with `weights` (the engine's
    Sampled, prompt-major); `stream` seeds the sampling (the iteration, or a producer's batch)."""
    prompt_ids = [list(ids) for ids in table.take(order).column("prompt_token_ids").to_pylist()]
    engine: Engine = importlib.import_module(ENGINES[spec.rollout.engine])
    rows = table.take(order).to_pylist() if spec.rollout.environment is not None else None
    return engine.sample_prompts(SampleRequest(spec, run_root, weights, cache_root, prompt_ids, stream, loaded, rows))


def rollout_table(
    spec: RunSpec,
    table: pa.Table,
    order: list[int],
    group_ids: list[int],
    iteration: int,
    sampled: Sampled,
    weights: WeightRef,
) -> pa.Table:
    """The rollout rows (ROLLOUT_SCHEMA, then the data's and the engine's other columns) of `sampled`:
    rollout.samples_per_prompt completions of each train row in `order`, group `group_ids[i]` for order[i]."""
    completions, group = sampled.completions, spec.rollout.samples_per_prompt
    n = len(completions.token_ids)
    rows = table.take(order).to_pylist()
    data_columns = [name for name in table.column_names if name not in ROLLOUT_SCHEMA.names]
    per_completion = table.take([order[i // group] for i in range(n)]).select(data_columns)  # arrow types kept
    return typed_table(
        {
            "prompt_id": [order[i // group] for i in range(n)],
            "group_id": [group_ids[i // group] for i in range(n)],
            "sample_index": [i % group for i in range(n)],
            "prompt": [rows[i // group]["prompt"] for i in range(n)],
            "prompt_token_ids": [list(rows[i // group]["prompt_token_ids"]) for i in range(n)],
            "completion_token_ids": completions.token_ids,
            "logprobs": completions.logprobs,
            "finish_reason": completions.finish_reasons,
            "completion": sampled.texts,
            # a partial rollout's row: the version of its first token, the oldest (token_versions has each's)
            "weights_version": [v[0] for v in completions.token_versions]
            if completions.token_versions
            else [weights["version"]] * n,
            "iteration": [iteration] * n,
        }
        | sampled.columns
        | {name: per_completion.column(name) for name in data_columns if name not in sampled.columns},
        ROLLOUT_SCHEMA,
    )
