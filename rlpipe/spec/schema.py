"""The bottom of rlpipe.spec (it imports nothing of rlpipe): how a section is declared, and the
sections that say what a run computes: the model, its data and rewards, how it samples (rollout,
samplers), what it optimizes (algorithm, preferences, trainer) and for how long (loop).

Each section is a frozen dataclass (`section`, as CleanRL's and TRL's configs are) whose fields carry their default,
the bounds `parse_spec` checks and their doc (`setting`); a section's `__post_init__` holds its rules across fields.
Where a run runs and stores is in rlpipe.spec.placement, the whole spec (RunSpec) in rlpipe.spec.run_spec.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

section = dataclasses.dataclass(frozen=True, kw_only=True)


def setting(
    default: Any = dataclasses.MISSING,
    *,
    default_factory: Any = dataclasses.MISSING,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    min_length: int | None = None,
    pattern: str | None = None,
    doc: str = "",
) -> Any:
    """A spec field: its default, the bounds `parse_spec` checks, and what it means."""
    bounds = {"ge": ge, "gt": gt, "le": le, "lt": lt, "min_length": min_length, "pattern": pattern}
    metadata = {k: v for k, v in bounds.items() if v is not None} | ({"doc": doc} if doc else {})
    return dataclasses.field(default=default, default_factory=default_factory, metadata=metadata)


@section
class TinyModelSpec:
    """A Qwen2-architecture model built from a config with random init (offline demos)."""

    hidden_size: int = setting(128, ge=32, doc="Width of the hidden states")
    intermediate_size: int = setting(512, ge=1, doc="Width of the MLP")
    num_layers: int = setting(4, ge=1, doc="Decoder layers")
    num_heads: int = setting(4, ge=1, doc="Attention heads (hidden_size / num_heads >= 32)")
    num_kv_heads: int = setting(2, ge=1, doc="Key/value heads (grouped-query attention; divide num_heads)")
    max_position_embeddings: int = setting(64, ge=16, doc="Longest sequence in tokens (prompt + completion)")

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

    max_steps: int = setting(2000, ge=0, doc="Optimizer steps at most; 0 disables the warm start")
    target_accuracy: float | None = setting(
        0.4, gt=0, le=1, doc="Stop once validation greedy accuracy reaches this; null: run max_steps"
    )
    check_every: int = setting(25, ge=1, doc="Optimizer steps between validation checks")
    validation_size: int = setting(256, ge=1, doc="Train rows held out of the SFT for the stop check")
    batch_size: int = setting(64, ge=1, doc="SFT rows per optimizer step")
    lr: float = setting(1e-3, gt=0, doc="AdamW learning rate of the SFT")
    completion: str = setting(
        "{reference}", doc="The SFT target after each prompt: str.format over the row's columns (eos appended)"
    )
    transcript: str | None = setting(
        None,
        doc="Multi-turn SFT: the column holding each row's transcript, a JSON list of {role: model | "
        "environment, text}; the loss is on model turns only (eos after the last). Overrides `completion`",
    )


@section
class LoraSpec:
    """LoRA (peft): W x + (alpha / rank) B A x with A, B trained and W frozen. The reference is the
    base with the adapters disabled (no second copy); each version after v0 stores only adapters."""

    rank: int = setting(16, ge=1, doc="r: the inner dimension of A and B")
    alpha: float = setting(32.0, gt=0, doc="The adapters' scale is alpha / rank")
    targets: list[str] = setting(
        default_factory=lambda: "q_proj k_proj v_proj qkv_proj o_proj gate_proj up_proj gate_up_proj down_proj".split(),
        min_length=1,
        doc="Names of the linear modules that get adapters (the default: separate and fused projections, Phi-3's)",
    )
    dropout: float = setting(0.0, ge=0, lt=1, doc="lora_dropout (off in the update: trainer.disable_dropout)")


@section
class ModelSpec:
    path: str | None = setting(None, doc="Local dir, gs:// or other fsspec URI, or a hub id. None builds model.tiny.")
    tiny: TinyModelSpec = setting(default_factory=TinyModelSpec)
    warm_start: WarmStartSpec = setting(default_factory=WarmStartSpec)
    lora: LoraSpec | None = setting(None, doc="Train LoRA adapters on the warm-started v0 instead of all weights")


@section
class DataSpec:
    """Where the prompts come from, how each becomes the model's input, and the held-out split.

    Rows come from a generator (`generator`: built-in `addition`, a registered name, or 'module:function' making rows)
    or from `path`: JSONL/JSON/Parquet/CSV files, a directory or glob of them, local or any fsspec URI (gs://, s3://), a
    dataset saved with `datasets`' save_to_disk, or a hub id (with `config` and `split`). The prompt is the `prompt`
    column (text, or chat messages), or `prompt_template` over the columns; chat messages go through the tokenizer's
    chat template. Every other column reaches the reward functions as keyword lists."""

    generator: str | None = setting(
        None,
        doc="'addition' (the default when path is null), a registered data source, or 'module:function' "
        "called as fn(rng: random.Random, n: int, **options) -> list[dict]",
    )
    options: dict[str, Any] = setting(default_factory=dict, doc="Keyword options of the generator (addition: digits)")
    path: str | None = setting(
        None, doc="Data files (file, directory, glob; local or fsspec URI), a save_to_disk directory, or a hub id"
    )
    format: Literal["auto", "jsonl", "json", "parquet", "csv", "saved", "hub"] = setting(
        "auto", doc="auto: by file extension; a directory saved by datasets is 'saved'; a name that is no path is 'hub'"
    )
    config: str | None = setting(None, doc="Hub dataset config (name)")
    split: str = setting("train", doc="Split of a hub or saved dataset to train on")
    eval_path: str | None = setting(None, doc="Held-out rows from their own file(s)")
    eval_split: str | None = setting(None, doc="Held-out rows from this split of the hub or saved dataset")
    eval_fraction: float | None = setting(
        None, gt=0, lt=1, doc="Held-out rows as a seeded fraction of the train rows (default 0.05 for files)"
    )
    train_size: int | None = setting(
        None, ge=1, doc="Train rows: generators make this many (default 9500); files keep the first this many"
    )
    eval_size: int | None = setting(
        None, ge=1, doc="Held-out rows: generators make this many (default 500); files keep at most this many"
    )
    prompt: str = setting("prompt", doc="Column holding the prompt: text, or chat messages [{role, content}, ...]")
    prompt_template: str | None = setting(
        None, doc="Build the prompt from columns with str.format, e.g. '{question}\\nAnswer:' (instead of `prompt`)"
    )
    chat_template: bool | None = setting(
        None,
        doc="Render prompts with the tokenizer's chat template: null = when the prompt is chat messages or a "
        "system_prompt is set; true = also text prompts (as one user message); false = never",
    )
    system_prompt: str | None = setting(None, doc="A system message put before each chat prompt")
    max_prompt_tokens: int | None = setting(None, ge=1, doc="Drop (and count) prompts longer than this many tokens")
    seed: int | None = setting(None, doc="Seed of generated rows and the held-out split; default: the run's seed")

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
    weights: list[float] | None = setting(None, doc="One weight per entry of `functions`; null: 1.0 each")
    verifier: str | dict[str, Any] = setting(
        "rlpipe.rewards.answer_checks:exact_match",
        doc="Scores held-out evaluation and the warm start's stop check (an entry as in `functions`); "
        "1.0 = correct, accuracy = its mean",
    )
    timeout_s: float = setting(600.0, gt=0, doc="Longest one call of a reward function may take (per batch)")

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
    max_turns: int = setting(4, ge=1, doc="Model turns per trajectory at most")
    max_tokens: int = setting(64, ge=1, doc="Tokens after the prompt per trajectory at most (model + environment)")


@section
class RolloutSpec:
    engine: Literal["torch", "vllm", "sampler"] = setting(
        "torch",
        doc="torch: HF model in the generate step (in the resident trainer when trainer.resident); "
        "vllm: vllm.LLM in the generate step; "
        "sampler: long-lived vLLM servers (section samplers), the generate step is a thin HTTP client",
    )
    prompts_per_iteration: int = setting(512, ge=1, doc="Prompts per iteration, each sampled samples_per_prompt times")
    samples_per_prompt: int = setting(8, ge=2, doc="G: completions per prompt (one GRPO group)")
    max_new_tokens: int = setting(5, ge=1, doc="Tokens a completion (with an environment: a model turn) has at most")
    temperature: float = setting(1.0, gt=0, doc="Sampling temperature; the update's log-probs are at the same")
    top_k: int = setting(0, ge=0, doc="0 disables top-k")
    top_p: float = setting(1.0, gt=0, le=1, doc="Nucleus sampling; 1.0 disables it (engines but torch need 1.0)")
    batch_size: int = setting(4096, ge=1, doc="Sequences per forward pass while sampling")
    environment: EnvironmentSpec | None = setting(
        None, doc="Multi-turn rollouts against an environment (tools, a remote service); null: one turn"
    )


@section
class SamplersSpec:
    """Long-lived vLLM servers for `rollout.engine: sampler`; reloaded in place by sync_weights."""

    replicas: int = setting(1, ge=1, doc="Servers `rlpipe run` starts on loopback with no endpoints (1 a core/GPU)")
    endpoints: list[str] = setting(
        default_factory=list,
        doc="Base URLs of running samplers; a host that resolves to several addresses (a headless "
        "Service) counts as one replica per address. Empty: `rlpipe run` starts `replicas` local servers.",
    )
    requests_per_replica: int = setting(
        64, ge=1, doc="Requests in flight per replica (x G sequences): vLLM batches what is in flight"
    )
    request_timeout_s: float = setting(
        300.0, gt=0, doc="Seconds a sampler request may take, and a replica's whole weight reload (then: named)"
    )
    startup_timeout_s: float = setting(900.0, gt=0, doc="How long generate waits for a replica to be ready")
    kv_cache_gib: int = setting(1, ge=1, doc="KV cache GiB per local CPU replica (VLLM_CPU_KVCACHE_SPACE)")
    extra_args: list[str] = setting(default_factory=list, doc="More vLLM server flags for local replicas")
    lora_adapters: bool | None = setting(
        None,
        doc="With model.lora: true = each version reaches the samplers as its adapter (only its bytes move; vLLM's "
        "LoRA kernels run at every token), false = merged into the base weights in place at each sync (W + alpha/r B "
        "A; no per-token cost). null: adapters for samplers.endpoints (GPUs), and for the servers `rlpipe run` "
        "starts, adapters on a GPU and merged on CPU, where vllm-cpu's LoRA ops made SmolLM2's sampling 4.5x slower",
    )


@section
class AlgorithmSpec:
    name: str = setting(
        "grpo", doc="A registered algorithm (rlpipe.algorithms), or 'package.module:name' for one that module registers"
    )
    scale_rewards: Literal["group", "batch", "none"] | None = setting(
        None, doc="Advantage scale: group std (GRPO), batch std, or none (Dr. GRPO). null: the algorithm's"
    )
    clip_eps: float | None = setting(None, gt=0, doc="Lower clip range of the ratio. null: the algorithm's (0.2)")
    clip_eps_high: float | None = setting(
        None, gt=0, doc="Upper clip range (DAPO's clip-higher: 0.28). null: the algorithm's, else clip_eps"
    )
    kl_coef: float = setting(
        0.0,
        ge=0,
        doc="The KL penalty coefficient: the weight of the estimated KL to the frozen reference (v0) in the loss "
        "(reinforce_pp: in the per-token reward, subtracted after the outcome is whitened, where the paper whitens "
        "both: docs/algorithms.md; dpo, online_dpo: refused, DPO's temperature is their pull to it). 0: no penalty",
    )
    kl_estimator: Literal["k1", "k2", "k3"] | None = setting(
        None,
        doc="KL estimator: k1 = log pi - log ref (in a reward only: as a loss term its expected gradient is 0), "
        "k2 = squared / 2, k3 = GRPO's. null: the algorithm's",
    )
    entropy_coef: float = setting(0.0, ge=0, doc="Entropy bonus: the loss minus this x the mean token entropy")
    loss_aggregation: Literal["sequence_mean", "token_mean", "sequence_sum"] | None = setting(
        None, doc="Token losses to one: per-sequence mean, token mean (DAPO), or sums over length_norm (Dr. GRPO)"
    )
    length_norm: int | None = setting(
        None, ge=1, doc="sequence_sum's divisor, for every algorithm aggregating by it. null: rollout.max_new_tokens"
    )
    dual_clip: float | None = setting(
        None,
        ge=0,
        doc="Dual clip c (verl's clip_ratio_c): a negative advantage's token loss is capped at -c A, so a ratio "
        "far above 1 cannot grow it without bound. > 1, or 0 to turn it off. null: the algorithm's (3.0)",
    )
    dynamic_sampling: bool | None = setting(
        None,
        doc="DAPO's dynamic sampling: drop groups whose rewards are all equal and fill the batch with more "
        "sampled prompts, up to max_oversample. null: the algorithm's (on for dapo)",
    )
    max_oversample: float = setting(
        3.0, ge=1, doc="Dynamic sampling's cap: prompts sampled per iteration at most this x prompts_per_iteration"
    )
    gamma: float | None = setting(None, ge=0, le=1, doc="PPO: discount of GAE. null: the algorithm's (1.0)")
    lam: float | None = setting(None, ge=0, le=1, doc="PPO: GAE's lambda. null: the algorithm's (0.95)")
    value_clip: float | None = setting(
        None,
        gt=0,
        doc="PPO: how far a value may move from the values step's per update (clipped value loss). "
        "null: the algorithm's (0.2)",
    )
    whiten_advantages: bool | None = setting(
        None, doc="PPO: normalise the per-token advantages over the batch. null: the algorithm's (true)"
    )
    critic_lr: float | None = setting(None, gt=0, doc="PPO: the critic's learning rate. null: trainer.lr")
    track_reference_kl: bool = setting(
        True, doc="Log kl/mean to v0 even when kl_coef is 0 (estimated on each iteration's first micro-batch)"
    )
    beta: float | None = setting(
        None,
        gt=0,
        doc="DPO's temperature (dpo, online_dpo): it scales the policy-to-reference log-ratios in the preference "
        "loss, and a larger one keeps the policy closer to the reference. Not a KL coefficient (that is kl_coef). "
        "null: 0.1",
    )
    label_smoothing: float | None = setting(None, ge=0, lt=0.5, doc="DPO: chance a label is flipped (cDPO). null: 0")
    dpo_loss: Literal["sigmoid", "ipo"] | None = setting(
        None, doc="DPO's loss: sigmoid (DPO) or ipo (IPO's squared loss). null: sigmoid"
    )
    rpo_alpha: float | None = setting(
        None, ge=0, doc="DPO: weight of the chosen completion's NLL per token added to the loss (RPO). null: 0"
    )
    off_policy_correction: Literal["none", "truncate", "mask"] | None = setting(
        None,
        doc="Importance weight pi_prox / pi_behaviour for rollouts a different policy sampled (stale ones, "
        "loop.max_staleness >= 1; or a sampler's numerics): truncate it at is_threshold (TIS), or mask tokens "
        "outside [1/is_threshold, is_threshold] (MIS); both recompute pi_prox, the update's starting weights' "
        "log-probs. none: the clipped ratio to the behaviour log-probs, as a synchronous run. null: truncate "
        "when loop.max_staleness >= 1 (the ratio to a stale policy clips most of the signal away), else none",
    )
    is_threshold: float = setting(2.0, gt=1, doc="TIS's cap C on the importance weight; MIS keeps [1/C, C]")
    is_level: Literal["token", "sequence", "geometric"] | None = setting(
        None,
        doc="The importance weight per token, per sequence (the product of its tokens'), or the sequence's "
        "geometric mean. null: the algorithm's (geometric for gspo, whose objective is per sequence; else token)",
    )


@section
class PreferencesSpec:
    """Offline DPO's preference set (algorithm.name: dpo), made once per run by the preferences step.

    From the task (default): rollout.samples_per_prompt completions of each train and held-out prompt are sampled from
    v0 (the warm start) at rollout.temperature and scored with reward.verifier; chosen = one it accepts, rejected = one
    it rejects; a prompt without both gives no pair. From data files: set data.path to rows with a prompt and the
    `chosen` and `rejected` columns (the prompt goes through data's templates like any prompt; the held-out split is
    data's). Each iteration trains on the next rollout.prompts_per_iteration pairs of a per-epoch shuffle."""

    chosen: str = setting("chosen", doc="Column of the preferred completion, when data.path has one")
    rejected: str = setting("rejected", doc="Column of the dispreferred completion, when data.path has one")
    pairs_per_prompt: int = setting(
        1, ge=1, doc="Pairs made from one prompt's samples at most (disjoint: a completion is in one pair)"
    )
    eval_pairs: int = setting(
        256, ge=1, doc="Held-out pairs whose preference accuracy each iteration reports (and as many train pairs)"
    )


@section
class TrainerSpec:
    lr: float = setting(5e-4, gt=0, doc="AdamW learning rate (constant after warmup_steps)")
    weight_decay: float = setting(0.0, ge=0, doc="AdamW weight decay")
    betas: tuple[float, float] = setting((0.9, 0.999), doc="AdamW betas: beta1, beta2")
    max_grad_norm: float = setting(1.0, gt=0, doc="Gradients clipped to this global norm per optimizer step")
    warmup_steps: int = setting(10, ge=0, doc="Linear LR warmup over the first optimizer steps")
    mini_batches: int = setting(4, ge=1, doc="Optimizer steps per epoch over one iteration's batch")
    epochs: int = setting(1, ge=1, doc="Passes over one iteration's batch")
    threads: int = setting(1, ge=1, doc="torch CPU threads per step")
    device: Literal["auto", "cpu", "cuda"] = setting(
        "auto",
        doc="Where the torch steps train, sample and evaluate: auto = cuda when a GPU is visible; "
        "cuda with none visible is an error, never a silent CPU run",
    )
    dtype: Literal["float32", "bfloat16"] = setting(
        "float32",
        doc="Compute precision: bfloat16 autocasts the forward passes while weights, gradients and "
        "AdamW state stay float32 (mixed precision with fp32 master weights)",
    )
    micro_batch_tokens: int | Literal["auto"] | None = setting(
        "auto",
        ge=1,
        doc="Token budget (padded rows x width) of one forward/backward; a mini-batch is split into micro-batches of "
        "rows sorted by length within it and their gradients accumulated (the same update, less memory and padding). "
        "auto: 1024 on a CPU (activations stay in cache: ~1.2x faster), one pass on a GPU. null: one pass",
    )
    padding_free: bool = setting(
        False, doc="Rows packed end to end with position ids, no padding (varlen attention on a GPU): the same update"
    )
    gradient_checkpointing: bool = setting(
        False, doc="Recompute activations in the backward pass instead of keeping them (less memory, ~30% slower)"
    )
    disable_dropout: bool = setting(
        True,
        doc="Turn off every dropout (the model's, LoRA's) in the update's log-prob passes, so the importance "
        "ratio compares the policy with itself (TRL's disable_dropout). false: keep the model's dropout",
    )
    logit_chunk_tokens: int | None = setting(
        512,
        ge=1,
        doc="Completion tokens whose vocabulary-wide logits exist at once: log-probs and entropy are computed "
        "from the final hidden states in chunks this long, each recomputed in the backward pass, so the "
        "update never holds tokens x vocabulary logits (the same values). null: the whole logits at once",
    )
    gpus: int = setting(
        1,
        ge=1,
        doc="GPUs the trainer trains on per node, the one count of them: the update (in its own pod, or in the "
        "resident trainer) runs as that many torchrun processes, FSDP2 sharding weights, gradients and AdamW "
        "state. On a cluster the update pod (or each resident trainer node) requests this many; the other "
        "trainer-image steps (warm_start, generate with the torch engine, evaluate, score with a reward model) "
        "compute on one device and request 1. With trainer.device cpu: that many gloo processes, no GPU requested",
    )
    nodes: int = setting(
        1,
        ge=1,
        doc="Nodes of the resident trainer: one torchrun job over nodes x gpus processes, which `rlpipe compile` "
        "writes as a JobSet beside the pipeline; > 1 needs trainer.resident",
    )
    resident: bool = setting(
        False,
        doc="Train in a long-lived trainer process that keeps policy and optimizer in memory between "
        "iterations; the update step becomes a thin client (rlpipe run starts the trainer locally)",
    )
    endpoint: str | None = setting(
        None,
        doc="URL of the resident trainer's Service on a cluster (rlpipe compile fills in its JobSet's Service "
        "when empty); empty locally: rlpipe run starts one",
    )

    def __post_init__(self) -> None:
        if self.nodes > 1 and not self.resident:
            raise ValueError(
                "trainer.nodes > 1 runs the resident trainer as one multi-node job (rlpipe compile writes its "
                "JobSet): set trainer.resident: true, or trainer.nodes: 1"
            )


@section
class LoopSpec:
    iterations: int = setting(25, ge=1, doc="Iterations in all, one weight version each (`rlpipe run --iterations`)")
    iterations_per_run: int = setting(5, ge=1, doc="Iterations unrolled into one pipeline run")
    eval_every: int = setting(5, ge=1, doc="Held-out eval at iteration 0, every this many iterations and the last")
    stop_when: str | None = setting(
        None,
        pattern=r"^\s*[\w/.-]+\s*(>=|<=|>|<)\s*-?[0-9.]+(e-?[0-9]+)?\s*$",
        doc="An eval gate that ends the loop early: '<metric> >= <value>' (or >, <=, <) over a held-out eval's "
        "metrics, e.g. 'eval/accuracy_greedy >= 0.7', 'eval/pass_at_8 >= 0.9' or 'eval/<set>/accuracy_greedy > 0.5'. "
        "Checked at every eval; the version that passed is the run's",
    )
    stop_on_signs: bool = setting(
        True,
        doc="End the loop at a degenerate start or an iteration in which no sample "
        "earned reward (rlpipe.evaluation.diagnosis); false trains on through them (a very sparse reward)",
    )
    max_staleness: int = setting(
        0,
        ge=0,
        doc="Asynchronous RL: iteration N may train on rollouts from v(N-1-s) .. v(N-1) that a producer generated "
        "ahead, while the trainer updated (rlpipe.services.producer.buffer). 0: the synchronous loop",
    )
    partial_rollouts: bool = setting(
        False,
        doc="Asynchronous RL, producer and torch engine: a completion being sampled when a new version is committed "
        "goes on under it (prefilled again with the new weights), each token's version in token_versions, corrected",
    )
    overlap: Literal["producer", "dag"] = setting(
        "producer",
        doc="How generation runs ahead when max_staleness >= 1. producer: a long-lived producer samples into the "
        "rollout buffer with the latest version (any engine but vllm). dag: iteration N's generate and score take "
        "v(N-1-s) and run beside update N-1 as sibling tasks, each in its own pod (a KFP cluster; the local runner "
        "runs one task at a time); engines torch and vllm, storage.keep_versions >= s + 1",
    )
    fuse_steps: bool = setting(
        False,
        doc="One KFP task (a process, a pod) runs each iteration's steps and due eval, not one task a step: the same "
        "functions, artifacts and metrics without each step's start (~0.1 s a process, seconds a pod). Not with dag",
    )
