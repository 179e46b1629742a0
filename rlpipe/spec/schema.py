"""The sections that say what a run learns from and how it samples: the model (its warm start, LoRA), its
data and rewards, rollout and samplers, and offline DPO's preference set.

How a section is declared is in rlpipe.spec.section; what it optimizes (the algorithm's options) in
rlpipe.spec.algorithm, the trainer and loop in rlpipe.spec.training; where a run runs and stores in
rlpipe.spec.placement, the whole spec (RunSpec) in rlpipe.spec.run_spec.
"""

from __future__ import annotations

from typing import Any, Literal

from rlpipe.spec.section import section, setting


@section
class TinyModelSpec:
    """A Qwen2-architecture model built from a config with random init (offline demos)."""

    hidden_size: int = setting(default=128, ge=32, doc="Width of the hidden states")
    intermediate_size: int = setting(default=512, ge=1, doc="Width of the MLP")
    num_layers: int = setting(default=4, ge=1, doc="Decoder layers")
    num_heads: int = setting(default=4, ge=1, doc="Attention heads (hidden_size / num_heads >= 32)")
    num_kv_heads: int = setting(default=2, ge=1, doc="Key/value heads (grouped-query attention; divide num_heads)")
    max_position_embeddings: int = setting(default=64, ge=16, doc="Longest sequence in tokens (prompt + completion)")

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError("model.tiny.hidden_size must be divisible by model.tiny.num_heads")
        if self.hidden_size // self.num_heads < 32:
            raise ValueError(
                "model.tiny head size (hidden_size / num_heads) must be >= 32 so vLLM can load it; "
                f"got {self.hidden_size // self.num_heads}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError("model.tiny.num_heads must be a multiple of model.tiny.num_kv_heads")


@section
class WarmStartSpec:
    """Supervised warm start before RL: SFT on each row's `completion` (the reference answer) until the greedy accuracy
    (reward.verifier) on a validation split held out of the SFT rows reaches `target_accuracy`, checked every
    `check_every` steps, for at most `max_steps` steps (0 disables the warm start).

    Stopping at an accuracy, not a step count, lands in the same place on any CPU and seed: around the step where this
    SFT takes off, a few hundred steps (or a CPU's rounding) move greedy accuracy anywhere between 0.1 and 0.7."""

    max_steps: int = setting(default=2000, ge=0, doc="Optimizer steps at most; 0 disables the warm start")
    target_accuracy: float | None = setting(
        default=0.4, gt=0, le=1, doc="Stop once validation greedy accuracy reaches this; null: run max_steps"
    )
    check_every: int = setting(default=25, ge=1, doc="Optimizer steps between validation checks")
    validation_size: int = setting(default=256, ge=1, doc="Train rows held out of the SFT for the stop check")
    batch_size: int = setting(default=64, ge=1, doc="SFT rows per optimizer step")
    lr: float = setting(default=1e-3, gt=0, doc="AdamW learning rate of the SFT")
    completion: str = setting(
        default="{reference}", doc="The SFT target after each prompt: str.format over the row's columns (eos appended)"
    )
    transcript: str | None = setting(
        default=None,
        doc="Multi-turn SFT: the column holding each row's transcript, a JSON list of {role: model | "
        "environment, text}; the loss is on model turns only (eos after the last). Overrides `completion`",
    )


@section
class LoraSpec:
    """LoRA (peft): W x + (alpha / rank) B A x with A, B trained and W frozen. The reference is the
    base with the adapters disabled (no second copy); each version after v0 stores only adapters."""

    rank: int = setting(default=16, ge=1, doc="r: the inner dimension of A and B")
    alpha: float = setting(default=32.0, gt=0, doc="The adapters' scale is alpha / rank")
    targets: list[str] = setting(
        default_factory=lambda: "q_proj k_proj v_proj qkv_proj o_proj gate_proj up_proj gate_up_proj down_proj".split(),
        min_length=1,
        doc="Names of the linear modules that get adapters (the default: separate and fused projections, Phi-3's)",
    )
    dropout: float = setting(default=0.0, ge=0, lt=1, doc="lora_dropout (off in the update: trainer.disable_dropout)")


@section
class ModelSpec:
    path: str | None = setting(
        default=None, doc="Local dir, gs:// or other fsspec URI, or a hub id. None builds model.tiny."
    )
    tiny: TinyModelSpec = setting(default_factory=TinyModelSpec)
    warm_start: WarmStartSpec = setting(default_factory=WarmStartSpec)
    lora: LoraSpec | None = setting(
        default=None, doc="Train LoRA adapters on the warm-started v0 instead of all weights"
    )


@section
class DataSpec:
    """Where the prompts come from, how each becomes the model's input, and the held-out split.

    Rows come from a generator (`generator`: built-in `addition`, a registered name, or 'module:function' making rows)
    or from `path`: JSONL/JSON/Parquet/CSV files, a directory or glob of them, local or any fsspec URI (gs://, s3://), a
    dataset saved with `datasets`' save_to_disk, or a hub id (with `config` and `split`). The prompt is the `prompt`
    column (text, or chat messages), or `prompt_template` over the columns; chat messages go through the tokenizer's
    chat template. Every other column reaches the reward functions as keyword lists."""

    generator: str | None = setting(
        default=None,
        doc="'addition' (the default when path is null), a registered data source, or 'module:function' "
        "called as fn(rng: random.Random, n: int, **options) -> list[dict]",
    )
    options: dict[str, Any] = setting(default_factory=dict, doc="Keyword options of the generator (addition: digits)")
    path: str | None = setting(
        default=None,
        doc="Data files (file, directory, glob; local or fsspec URI), a save_to_disk directory, or a hub id",
    )
    format: Literal["auto", "jsonl", "json", "parquet", "csv", "saved", "hub"] = setting(
        default="auto",
        doc="auto: by file extension; a directory saved by datasets is 'saved'; a name that is no path is 'hub'",
    )
    config: str | None = setting(default=None, doc="Hub dataset config (name)")
    split: str = setting(default="train", doc="Split of a hub or saved dataset to train on")
    eval_path: str | None = setting(default=None, doc="Held-out rows from their own file(s)")
    eval_split: str | None = setting(default=None, doc="Held-out rows from this split of the hub or saved dataset")
    eval_fraction: float | None = setting(
        default=None, gt=0, lt=1, doc="Held-out rows as a seeded fraction of the train rows (default 0.05 for files)"
    )
    train_size: int | None = setting(
        default=None, ge=1, doc="Train rows: generators make this many (default 9500); files keep the first this many"
    )
    eval_size: int | None = setting(
        default=None, ge=1, doc="Held-out rows: generators make this many (default 500); files keep at most this many"
    )
    prompt: str = setting(
        default="prompt", doc="Column holding the prompt: text, or chat messages [{role, content}, ...]"
    )
    prompt_template: str | None = setting(
        default=None,
        doc="Build the prompt from columns with str.format, e.g. '{question}\\nAnswer:' (instead of `prompt`)",
    )
    chat_template: bool | None = setting(
        default=None,
        doc="Render prompts with the tokenizer's chat template: null = when the prompt is chat messages or a "
        "system_prompt is set; true = also text prompts (as one user message); false = never",
    )
    system_prompt: str | None = setting(default=None, doc="A system message put before each chat prompt")
    max_prompt_tokens: int | None = setting(
        default=None, ge=1, doc="Drop (and count) prompts longer than this many tokens"
    )
    seed: int | None = setting(
        default=None, doc="Seed of generated rows and the held-out split; default: the run's seed"
    )

    def __post_init__(self) -> None:
        if self.generator and self.path:
            raise ValueError("set data.generator or data.path, not both")
        if self.generator is None and self.path is None:
            object.__setattr__(self, "generator", "addition")
        if self.generator:
            for key in ("eval_path", "eval_split", "eval_fraction"):
                if getattr(self, key) is not None:
                    raise ValueError(f"data.{key} is for data files; a generator makes its held-out rows (eval_size)")
            object.__setattr__(self, "train_size", self.train_size or 9500)
            object.__setattr__(self, "eval_size", self.eval_size or 500)
        else:
            held_out = [k for k in ("eval_path", "eval_split", "eval_fraction") if getattr(self, k) is not None]
            if len(held_out) > 1:
                raise ValueError(f"data: choose one held-out source, not {' and '.join(held_out)}")
            if not held_out:
                object.__setattr__(self, "eval_fraction", 0.05)
        if self.chat_template is False and self.system_prompt:
            raise ValueError("data.system_prompt needs the chat template; remove it or set data.chat_template: true")


@section
class RewardSpec:
    functions: list[str | dict[str, Any]] = setting(
        default_factory=lambda: ["rlpipe.rewards.answer_checks:exact_match"],
        min_length=1,
        doc="Rewards, summed with `weights`: 'module:function' (TRL's batch signature, sync or async), or {type: <a "
        "reward type>, ...its options}: exact_match, math_equivalence, regex, length_penalty, reward_model, remote, "
        "code_sandbox, function, or one registered with rlpipe.rewards.register_reward_type",
    )
    weights: list[float] | None = setting(default=None, doc="One weight per entry of `functions`; null: 1.0 each")
    verifier: str | dict[str, Any] = setting(
        default="rlpipe.rewards.answer_checks:exact_match",
        doc="Scores held-out evaluation and the warm start's stop check (an entry as in `functions`); "
        "1.0 = correct, accuracy = its mean",
    )
    timeout_s: float = setting(default=600.0, gt=0, doc="Longest one call of a reward function may take (per batch)")

    def __post_init__(self) -> None:
        entries = [("reward.verifier", self.verifier)] + [("reward.functions entry", f) for f in self.functions]
        for key, target in entries:
            if isinstance(target, dict):
                if not isinstance(target.get("type"), str):
                    raise ValueError(f"{key} {target!r} needs a `type`: a reward type (rlpipe.rewards.REWARD_TYPES)")
            elif target.count(":") != 1 or not all(target.split(":")):
                raise ValueError(f"{key} {target!r} must look like 'package.module:function'")
        if self.weights is not None and len(self.weights) != len(self.functions):
            raise ValueError(
                f"reward.weights has {len(self.weights)} entries but reward.functions has {len(self.functions)}"
            )


@section
class EnvironmentSpec:
    """Multi-turn rollouts (rlpipe.environments): the model's turns alternate with an environment's observations until
    it says done, `max_turns` model turns, or `max_tokens` after the prompt (model and environment tokens); each model
    turn is at most rollout.max_new_tokens."""

    type: str = setting(
        doc="calculator, tools, remote, a name registered with rlpipe.environments.register_environment, "
        "or 'package.module:name' for one that module registers"
    )
    options: dict[str, Any] = setting(default_factory=dict, doc="The environment type's own settings")
    max_turns: int = setting(default=4, ge=1, doc="Model turns per trajectory at most")
    max_tokens: int = setting(
        default=64, ge=1, doc="Tokens after the prompt per trajectory at most (model + environment)"
    )


@section
class RolloutSpec:
    engine: Literal["torch", "vllm", "sampler"] = setting(
        default="torch",
        doc="torch: HF model in the generate step (in the resident trainer when trainer.resident); "
        "vllm: vllm.LLM in the generate step; "
        "sampler: long-lived vLLM servers (section samplers), the generate step is a thin HTTP client",
    )
    prompts_per_iteration: int = setting(
        default=512, ge=1, doc="Prompts per iteration, each sampled samples_per_prompt times"
    )
    samples_per_prompt: int = setting(default=8, ge=2, doc="G: completions per prompt (one GRPO group)")
    max_new_tokens: int = setting(
        default=5, ge=1, doc="Tokens a completion (with an environment: a model turn) has at most"
    )
    temperature: float = setting(default=1.0, gt=0, doc="Sampling temperature; the update's log-probs are at the same")
    top_k: int = setting(default=0, ge=0, doc="0 disables top-k")
    top_p: float = setting(
        default=1.0, gt=0, le=1, doc="Nucleus sampling; 1.0 disables it (engines but torch need 1.0)"
    )
    batch_size: int = setting(default=4096, ge=1, doc="Sequences per forward pass while sampling")
    environment: EnvironmentSpec | None = setting(
        default=None, doc="Multi-turn rollouts against an environment (tools, a remote service); null: one turn"
    )


@section
class SamplersSpec:
    """Long-lived vLLM servers for `rollout.engine: sampler`; reloaded in place by sync_weights."""

    replicas: int = setting(
        default=1, ge=1, doc="Servers `rlpipe run` starts on loopback with no endpoints (1 a core/GPU)"
    )
    endpoints: list[str] = setting(
        default_factory=list,
        doc="Base URLs of running samplers; a host that resolves to several addresses (a headless "
        "Service) counts as one replica per address. Empty: `rlpipe run` starts `replicas` local servers.",
    )
    requests_per_replica: int = setting(
        default=64, ge=1, doc="Requests in flight per replica (x G sequences): vLLM batches what is in flight"
    )
    request_timeout_s: float = setting(
        default=300.0, gt=0, doc="Seconds a sampler request may take, and a replica's whole weight reload (then: named)"
    )
    startup_timeout_s: float = setting(default=900.0, gt=0, doc="How long generate waits for a replica to be ready")
    kv_cache_gib: int = setting(default=1, ge=1, doc="KV cache GiB per local CPU replica (VLLM_CPU_KVCACHE_SPACE)")
    extra_args: list[str] = setting(default_factory=list, doc="More vLLM server flags for local replicas")
    lora_adapters: bool | None = setting(
        default=None,
        doc="With model.lora: true = each version reaches the samplers as its adapter (only its bytes move; vLLM's "
        "LoRA kernels run at every token), false = merged into the base weights in place at each sync (W + alpha/r B "
        "A; no per-token cost). null: adapters for samplers.endpoints (GPUs), and for the servers `rlpipe run` "
        "starts, adapters on a GPU and merged on CPU, where vllm-cpu's LoRA ops made SmolLM2's sampling 4.5x slower",
    )


@section
class PreferencesSpec:
    """Offline DPO's preference set (algorithm.name: dpo), made once per run by the preferences step.

    From the task (default): rollout.samples_per_prompt completions of each train and held-out prompt are sampled from
    v0 (the warm start) at rollout.temperature and scored with reward.verifier; chosen = one it accepts, rejected = one
    it rejects; a prompt without both gives no pair. From data files: set data.path to rows with a prompt and the
    `chosen` and `rejected` columns (the prompt goes through data's templates like any prompt; the held-out split is
    data's). Each iteration trains on the next rollout.prompts_per_iteration pairs of a per-epoch shuffle."""

    chosen: str = setting(default="chosen", doc="Column of the preferred completion, when data.path has one")
    rejected: str = setting(default="rejected", doc="Column of the dispreferred completion, when data.path has one")
    pairs_per_prompt: int = setting(
        default=1, ge=1, doc="Pairs made from one prompt's samples at most (disjoint: a completion is in one pair)"
    )
    eval_pairs: int = setting(
        default=256,
        ge=1,
        doc="Held-out pairs whose preference accuracy each iteration reports (and as many train pairs)",
    )
