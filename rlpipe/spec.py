"""The run spec: one YAML file, validated, with errors that say what to change.

Each section is a frozen dataclass (as CleanRL's and TRL's configs are); `setting` declares a
field's default, bounds and doc, and `parse_spec` checks a dict against the classes: unknown
keys, types, bounds, choices, then each section's `__post_init__` for rules across fields.
Steps parse the spec in every process, so this module imports nothing heavy.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal

section = dataclasses.dataclass(frozen=True, kw_only=True)


class SpecError(ValueError):
    """A run spec that cannot be used; the message names the key and what is allowed."""


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

    hidden_size: int = setting(128, ge=32)
    intermediate_size: int = setting(512, ge=1)
    num_layers: int = setting(4, ge=1)
    num_heads: int = setting(4, ge=1)
    num_kv_heads: int = setting(2, ge=1)
    max_position_embeddings: int = setting(64, ge=16)

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
    (reward.verifier) on a validation split held out of the SFT rows reaches `target_accuracy`,
    checked every `check_every` steps, for at most `max_steps` steps (0 disables the warm start).

    Stopping at an accuracy, not a step count, lands in the same place on any CPU and seed: around
    the step where this SFT takes off, a few hundred steps (or a CPU's rounding) move greedy accuracy
    anywhere between 0.1 and 0.7."""

    max_steps: int = setting(2000, ge=0)
    target_accuracy: float | None = setting(
        0.4, gt=0, le=1, doc="Stop once validation greedy accuracy reaches this; null: run max_steps"
    )
    check_every: int = setting(25, ge=1, doc="Optimizer steps between validation checks")
    validation_size: int = setting(256, ge=1, doc="Train rows held out of the SFT for the stop check")
    batch_size: int = setting(64, ge=1)
    lr: float = setting(1e-3, gt=0)
    completion: str = setting(
        "{reference}", doc="The SFT target after each prompt: str.format over the row's columns (eos appended)"
    )


@section
class LoraSpec:
    """LoRA (peft): W x + (alpha / rank) B A x with A, B trained and W frozen. The reference is the
    base with the adapters disabled (no second copy); each version after v0 stores only adapters."""

    rank: int = setting(16, ge=1)
    alpha: float = setting(32.0, gt=0)
    targets: list[str] = setting(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        min_length=1,
        doc="Names of the linear modules that get adapters",
    )
    dropout: float = setting(0.0, ge=0, lt=1)


@section
class ModelSpec:
    path: str | None = setting(None, doc="Local dir, gs:// or other fsspec URI, or a hub id. None builds model.tiny.")
    tiny: TinyModelSpec = setting(default_factory=TinyModelSpec)
    warm_start: WarmStartSpec = setting(default_factory=WarmStartSpec)
    lora: LoraSpec | None = setting(None, doc="Train LoRA adapters on the warm-started v0 instead of all weights")


@section
class DataSpec:
    """Where the prompts come from, how each becomes the model's input, and the held-out split.

    Rows come from a generator (`generator`: built-in `addition`, a registered name, or
    'module:function' making rows) or from `path`: JSONL/JSON/Parquet/CSV files, a directory or glob
    of them, local or any fsspec URI (gs://, s3://), a dataset saved with `datasets`' save_to_disk,
    or a hub id (with `config` and `split`). The prompt is the `prompt` column (text, or chat
    messages), or `prompt_template` over the columns; chat messages go through the tokenizer's chat
    template. Every other column reaches the reward functions as keyword lists."""

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
        default_factory=lambda: ["rlpipe.rewards.verifiers:exact_match"],
        min_length=1,
        doc="Rewards, summed with `weights`: 'module:function' (TRL's batch signature, sync or async), or "
        "{type: <a reward type>, ...its options}: exact_match, math_equivalence, regex, length_penalty, "
        "reward_model, remote, code_sandbox, "
        "function, or one registered with rlpipe.rewards.register_reward_type",
    )
    weights: list[float] | None = None
    verifier: str | dict[str, Any] = setting(
        "rlpipe.rewards.verifiers:exact_match",
        doc="Scores held-out evaluation and the warm start's stop check (an entry as in `functions`); "
        "1.0 = correct, accuracy = its mean",
    )
    timeout_s: float = setting(600.0, gt=0, doc="Longest one call of a reward function may take (per batch)")

    def __post_init__(self) -> None:
        for key, ref in [("reward.verifier", self.verifier)] + [("reward.functions entry", f) for f in self.functions]:
            if isinstance(ref, dict):
                if not isinstance(ref.get("type"), str):
                    raise ValueError(f"{key} {ref!r} needs a `type`: a reward type (rlpipe.rewards.REWARD_TYPES)")
            elif ref.count(":") != 1 or not all(ref.split(":")):
                raise ValueError(f"{key} {ref!r} must look like 'package.module:function'")
        if self.weights is not None and len(self.weights) != len(self.functions):
            raise ValueError(
                f"reward.weights has {len(self.weights)} entries but reward.functions has {len(self.functions)}"
            )


@section
class RolloutSpec:
    engine: Literal["torch", "vllm", "sampler"] = setting(
        "torch",
        doc="torch: HF model in the generate step (in the resident trainer when trainer.resident); "
        "vllm: vllm.LLM in the generate step; "
        "sampler: long-lived vLLM servers (section samplers), the generate step is a thin HTTP client",
    )
    prompts_per_iteration: int = setting(512, ge=1)
    samples_per_prompt: int = setting(8, ge=2, doc="G: completions per prompt (one GRPO group)")
    max_new_tokens: int = setting(5, ge=1)
    temperature: float = setting(1.0, gt=0)
    top_k: int = setting(0, ge=0, doc="0 disables top-k")
    top_p: float = setting(1.0, gt=0, le=1)
    batch_size: int = setting(4096, ge=1, doc="Sequences per forward pass while sampling")


@section
class SamplersSpec:
    """Long-lived vLLM servers for `rollout.engine: sampler`; reloaded in place by sync_weights."""

    replicas: int = setting(
        1, ge=1, doc="Servers `rlpipe run` starts on loopback when endpoints is empty (1 per free core or GPU)"
    )
    endpoints: list[str] = setting(
        default_factory=list,
        doc="Base URLs of running samplers; a host that resolves to several addresses (a headless "
        "Service) counts as one replica per address. Empty: `rlpipe run` starts `replicas` local servers.",
    )
    requests_per_replica: int = setting(
        64, ge=1, doc="Requests in flight per replica (x G sequences): vLLM batches what is in flight"
    )
    request_timeout_s: float = setting(300.0, gt=0)
    startup_timeout_s: float = setting(900.0, gt=0, doc="How long generate waits for a replica to be ready")
    kv_cache_gib: int = setting(1, ge=1, doc="KV cache GiB per local CPU replica (VLLM_CPU_KVCACHE_SPACE)")
    extra_args: list[str] = setting(default_factory=list, doc="More vLLM server flags for local replicas")


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
    kl_coef: float = setting(0.0, ge=0, doc="beta for the KL to the frozen reference (v0)")
    kl_estimator: Literal["k1", "k2", "k3"] | None = setting(
        None, doc="KL estimator: k1 = log pi - log ref, k2 = squared / 2, k3 = GRPO's. null: the algorithm's"
    )
    entropy_coef: float = setting(0.0, ge=0, doc="Entropy bonus: the loss minus this x the mean token entropy")
    loss_aggregation: Literal["sequence_mean", "token_mean", "sequence_sum"] | None = setting(
        None, doc="Token losses to one: per-sequence mean, token mean (DAPO), or sums over length_norm (Dr. GRPO)"
    )
    length_norm: int | None = setting(None, ge=1, doc="sequence_sum's constant divisor. null: rollout.max_new_tokens")
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
        True, doc="Log kl/mean to v0 even when kl_coef is 0 (estimated on each iteration's first mini-batch)"
    )
    beta: float | None = setting(
        None, gt=0, doc="DPO's beta (dpo, online_dpo): how far the policy may move from the reference. null: 0.1"
    )
    label_smoothing: float | None = setting(
        None, ge=0, lt=0.5, doc="DPO: the chance a preference label is flipped (cDPO). null: 0"
    )
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
    is_level: Literal["token", "sequence", "geometric"] = setting(
        "token",
        doc="The importance weight per token, per sequence (the product of its tokens'), or the sequence's "
        "geometric mean",
    )


@section
class PreferencesSpec:
    """Offline DPO's preference set (algorithm.name: dpo), made once per run by the preferences step.

    From the task (default): rollout.samples_per_prompt completions of each train and held-out prompt
    are sampled from v0 (the warm start) at rollout.temperature and scored with reward.verifier; chosen
    = one it accepts, rejected = one it rejects; a prompt without both gives no pair. From data files:
    set data.path to rows with a prompt and the `chosen` and `rejected` columns (the prompt goes through
    data's templates like any prompt; the held-out split is data's). Each iteration trains on the next
    rollout.prompts_per_iteration pairs of a per-epoch shuffle."""

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
    lr: float = setting(5e-4, gt=0)
    weight_decay: float = setting(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    max_grad_norm: float = setting(1.0, gt=0)
    warmup_steps: int = setting(10, ge=0, doc="Linear LR warmup over the first optimizer steps")
    mini_batches: int = setting(4, ge=1, doc="Optimizer steps per epoch over one iteration's batch")
    epochs: int = setting(1, ge=1)
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
    micro_batch_tokens: int | None = setting(
        None,
        ge=1,
        doc="Token budget (padded rows x width) of one forward/backward; a mini-batch is split into "
        "micro-batches within it and their gradients accumulated (the same update, less memory). null: one pass",
    )
    gradient_checkpointing: bool = setting(
        False, doc="Recompute activations in the backward pass instead of keeping them (less memory, ~30% slower)"
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
    iterations: int = setting(25, ge=1)
    iterations_per_run: int = setting(5, ge=1, doc="Iterations unrolled into one pipeline run")
    eval_every: int = setting(5, ge=1)
    stop_when: str | None = setting(
        None,
        pattern=r"^\s*[\w/.-]+\s*(>=|<=|>|<)\s*-?[0-9.]+(e-?[0-9]+)?\s*$",
        doc="An eval gate that ends the loop early: '<metric> >= <value>' (or >, <=, <) over a held-out eval's "
        "metrics, e.g. 'eval/accuracy_greedy >= 0.7'. Checked at every eval; the version that passed is the run's",
    )
    max_staleness: int = setting(
        0,
        ge=0,
        doc="Asynchronous RL: iteration N may train on rollouts from v(N-1-s) .. v(N-1) that a producer generated "
        "ahead, while the trainer updated (rlpipe.rollout_buffer). 0: the synchronous loop",
    )


@section
class StorageSpec:
    root: str = setting("./runs", doc="Parent of run directories: a local path or fsspec URI")
    keep_versions: int = setting(3, ge=1, doc="Weight versions kept besides v0")
    cache: str | None = setting(None, doc="Warm-start cache; default <root>/.cache")


@section
class TrackingSpec:
    uri: str | None = setting(None, doc="MLflow tracking URI; default sqlite:///<run dir>/mlflow.db")
    experiment: str = "rlpipe"
    register: Literal["none", "best", "every_eval"] = setting(
        "best",
        doc="Which evaluated weight versions the MLflow Model Registry gets (a model version pointing at the "
        "sealed version in the weight store, not a copy): each new best held-out eval, every eval, or none. "
        "The alias 'best' follows the best eval; 'gate_passed' marks the version that passed loop.stop_when",
    )
    registered_model: str | None = setting(None, doc="The registered model's name; default: the run's name")


@section
class Toleration:
    key: str
    operator: Literal["Equal", "Exists"] = "Exists"
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = "NoSchedule"


CPU = r"([0-9]*[.])?[0-9]+m?"  # what KFP's set_cpu_request accepts
MEMORY = r"[0-9]+(E|Ei|P|Pi|T|Ti|G|Gi|M|Mi|K|Ki)?"  # what KFP's set_memory_request accepts


@section
class PodSpec:
    """Image, resources and placement for one class of steps on the cluster."""

    image: str
    cpu: str = setting("1", pattern=CPU, doc="CPU request: cores, e.g. 4, 0.5 or 500m")
    memory: str = setting("2Gi", pattern=MEMORY, doc="Memory request: bytes or with a suffix, e.g. 16Gi")
    cpu_limit: str | None = setting(None, pattern=CPU)
    memory_limit: str | None = setting(None, pattern=MEMORY)
    accelerator: str = setting(
        "nvidia.com/gpu", doc="Resource name (KFP accelerator type) of the GPUs a step requests (trainer.gpus)"
    )
    node_selector: dict[str, str] = setting(default_factory=dict)
    tolerations: list[Toleration] = setting(default_factory=list)
    timeout_s: int = setting(7200, ge=60)


@section
class SecretEnv:
    """Expose one key of a Kubernetes Secret as an env var (by reference: values never enter the spec)."""

    secret: str
    key: str
    env: str
    steps: list[str] | None = setting(None, doc="Steps that get it (e.g. [track]); None = every step")


@section
class ClusterSpec:
    """Applied to every task at compile time (`rlpipe compile`); ignored by `rlpipe run`."""

    trainer: PodSpec = setting(
        default_factory=lambda: PodSpec(image="ghcr.io/rlpipe/trainer:0.1.0", cpu="4", memory="16Gi")
    )
    step: PodSpec = setting(default_factory=lambda: PodSpec(image="ghcr.io/rlpipe/step:0.1.0"))
    pvc: str | None = setting(None, doc="ReadWriteMany PVC holding the run root (Lustre/Filestore/NFS)")
    mount_path: str = "/mnt/rlpipe"
    secrets: list[SecretEnv] = setting(default_factory=list)
    retries: int = setting(2, ge=0, doc="Every step is safe to retry: nothing is visible before sync commits")
    retry_backoff: str = "30s"
    run_as_user: int = 1000
    sandbox_runtime_class: str | None = setting(
        "gvisor",
        doc="RuntimeClass of the score pod when a code_sandbox reward runs candidates' code (GKE Sandbox: "
        "gvisor); its pod is labelled rlpipe.dev/sandbox=true for the deny-egress NetworkPolicy. null: none",
    )

    def __post_init__(self) -> None:
        from rlpipe.steps import STEP_NAMES

        for secret in self.secrets:
            unknown = sorted(set(secret.steps or []) - set(STEP_NAMES))
            if unknown:
                raise ValueError(f"cluster.secrets steps {unknown} are not steps; allowed: {', '.join(STEP_NAMES)}")


@section
class RunSpec:
    name: str = setting(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    seed: int = 0
    model: ModelSpec = setting(default_factory=ModelSpec)
    data: DataSpec = setting(default_factory=DataSpec)
    reward: RewardSpec = setting(default_factory=RewardSpec)
    rollout: RolloutSpec = setting(default_factory=RolloutSpec)
    samplers: SamplersSpec = setting(default_factory=SamplersSpec)
    algorithm: AlgorithmSpec = setting(default_factory=AlgorithmSpec)
    trainer: TrainerSpec = setting(default_factory=TrainerSpec)
    loop: LoopSpec = setting(default_factory=LoopSpec)
    storage: StorageSpec = setting(default_factory=StorageSpec)
    tracking: TrackingSpec = setting(default_factory=TrackingSpec)
    cluster: ClusterSpec = setting(default_factory=ClusterSpec)
    preferences: PreferencesSpec = setting(default_factory=PreferencesSpec)

    @property
    def cache_root(self) -> str:
        """Local cache for warm starts and copies of remote weights (rlpipe.store.run_root.cache_root_for)."""
        from rlpipe.store.run_root import cache_root_for

        return cache_root_for(self.storage.root, self.storage.cache)

    def __post_init__(self) -> None:
        sequences = self.rollout.prompts_per_iteration * self.rollout.samples_per_prompt
        if self.trainer.mini_batches > sequences:
            raise ValueError(
                f"trainer.mini_batches ({self.trainer.mini_batches}) exceeds the sequences per iteration "
                f"({sequences} = rollout.prompts_per_iteration x rollout.samples_per_prompt)"
            )
        if self.model.lora is not None and self.rollout.engine != "torch" and self.model.lora.rank > 512:
            raise ValueError(
                f"model.lora.rank {self.model.lora.rank} with rollout.engine {self.rollout.engine}: vLLM serves "
                "LoRA ranks up to 512; lower the rank or use rollout.engine: torch"
            )
        if self.model.lora is not None and self.trainer.gpus * self.trainer.nodes > 1:
            raise ValueError("model.lora trains in one process for now; set trainer.gpus: 1 and trainer.nodes: 1")
        truncated = self.rollout.top_k > 0 or self.rollout.top_p < 1.0
        if self.rollout.engine != "torch" and truncated:
            raise ValueError(
                f"rollout.engine {self.rollout.engine} reports log-probs of the top-k/top-p truncated distribution, "
                "which the update's importance ratio (full softmax at the temperature) does not match; "
                "set rollout.top_k: 0 and rollout.top_p: 1.0, or use rollout.engine: torch"
            )
        if self.loop.max_staleness and self.rollout.engine == "vllm":
            raise ValueError(
                "loop.max_staleness >= 1 samples ahead in a long-lived producer, and rollout.engine vllm loads an "
                "engine per call; use rollout.engine: sampler (long-lived vLLM servers) or torch"
            )
        if self.loop.max_staleness and self.algorithm.name == "dpo":
            raise ValueError(
                "algorithm dpo trains on a fixed preference set, with no rollouts; set loop.max_staleness: 0"
            )


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _build(cls: type, data: Any, key: str, errors: list[str]) -> Any:
    """An instance of section `cls` from `data`, or None with the problems appended to `errors`."""
    if not isinstance(data, dict):
        errors.append(f"{key.rstrip('.') or '<top level>'}: expected a mapping of keys, got {data!r}")
        return None
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for unknown in sorted(set(data) - set(fields), key=str):
        errors.append(f"{key}{unknown}: unknown key; allowed keys here: {', '.join(sorted(fields))}")
    values, failed = {}, len(errors)
    for name, field in fields.items():
        if name in data:
            values[name] = _convert(_hints(cls)[name], data[name], f"{key}{name}", field.metadata, errors)
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            errors.append(f"{key}{name}: required")
    if len(errors) > failed:
        return None
    try:
        return cls(**values)
    except ValueError as err:  # a rule across fields (__post_init__)
        errors.append(f"{key.rstrip('.') or '<top level>'}: {err}")
        return None


def _convert(hint: Any, value: Any, key: str, bounds: typing.Mapping[str, Any], errors: list[str]) -> Any:
    """`value` as type `hint` within `bounds`; appends to `errors` and returns None when it is not.

    Lenient where YAML is: ints may come as 7.0 and numbers as strings ('3e-4', which YAML 1.1
    reads as a string); numbers must be finite."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        arms = [a for a in args if a is not type(None)]
        if len(arms) > 1:  # the first arm the value fits, e.g. str | dict[str, Any]
            for arm in arms:
                scratch: list[str] = []
                converted = _convert(arm, value, key, bounds, scratch)
                if not scratch:
                    return converted
            kinds = " or ".join(getattr(typing.get_origin(a) or a, "__name__", str(a)) for a in arms)
            errors.append(f"{key}: must be a {kinds} (got {value!r})")
            return None
        (hint,) = arms
        origin, args = typing.get_origin(hint), typing.get_args(hint)

    def fail(expected: str) -> None:
        errors.append(f"{key}: {expected} (got {value!r})")

    if dataclasses.is_dataclass(hint):
        return _build(hint, value, f"{key}.", errors)
    if origin is Literal:
        if value not in args:
            return fail(f"must be one of {', '.join(repr(a) for a in args)}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            return fail("must be a list")
        if origin is tuple and len(value) != len(args):
            return fail(f"must be a list of {len(args)} values")
        items = [
            _convert(args[i] if origin is tuple else args[0], item, f"{key}[{i}]", {}, errors)
            for i, item in enumerate(value)
        ]
        if "min_length" in bounds and len(items) < bounds["min_length"]:
            return fail("must not be empty" if bounds["min_length"] == 1 else f"needs {bounds['min_length']} entries")
        return tuple(items) if origin is tuple else items
    if origin is dict:
        values_any = args[1] is Any
        if not isinstance(value, dict) or not all(
            isinstance(k, str) and (values_any or isinstance(v, str)) for k, v in value.items()
        ):
            return fail("must be a mapping" + ("" if values_any else " of strings to strings"))
        return dict(value)
    if hint is bool:
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        return value if isinstance(value, bool) else fail("must be true or false")
    if hint is str:
        if not isinstance(value, str):
            return fail("must be a string")
        if "pattern" in bounds and not re.fullmatch(bounds["pattern"], value):
            return fail(f"must match {bounds['pattern']}")
        return value
    if hint in (int, float):
        number = _number(value, hint)
        if number is None:
            return fail("must be an integer" if hint is int else "must be a number")
        for bound, holds, says in (
            ("ge", number.__ge__, ">="),
            ("gt", number.__gt__, ">"),
            ("le", number.__le__, "<="),
            ("lt", number.__lt__, "<"),
        ):
            if bound in bounds and not holds(bounds[bound]):
                return fail(f"must be {says} {bounds[bound]}")
        return number
    raise TypeError(f"spec field {key} has a type parse_spec does not know: {hint!r}")


def _number(value: Any, kind: type) -> int | float | None:
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    if kind is int:
        return int(value) if float(value).is_integer() else None
    return float(value)


def parse_spec(data: dict[str, Any], source: str = "<dict>") -> RunSpec:
    """Validate a spec dict; raise SpecError naming each bad key."""
    if isinstance(data, dict) and "task" in data:
        raise SpecError(f"invalid run spec {source}:\n  {old_task_section(data['task'])}")
    if isinstance(data, dict) and (replaced := old_gpu_keys(data)):
        raise SpecError("\n  ".join([f"invalid run spec {source}:", *replaced]))
    errors: list[str] = []
    spec = _build(RunSpec, data, "", errors)
    if errors:
        raise SpecError("\n  ".join([f"invalid run spec {source}:", *errors]))
    return spec


def old_task_section(task: Any) -> str:
    """What to write instead of a `task:` section (replaced by `data:`), shown in the error."""
    task = dict(task) if isinstance(task, dict) else {}
    data: dict[str, Any] = {"generator": task.pop("name", "addition")}
    if "digits" in task:
        data["options"] = {"digits": task.pop("digits")}
    data |= task
    lines = "\n    ".join(f"{key}: {json.dumps(value)}" for key, value in data.items())
    return (
        "task: the `task` section is now `data` (which also reads data files, hub datasets and chat prompts); "
        f"write instead:\n  data:\n    {lines}"
    )


def old_gpu_keys(data: dict[str, Any]) -> list[str]:
    """What to write instead of trainer.processes and cluster.<pod>.gpus, both replaced by trainer.gpus
    (one count of the trainer's GPUs per node), shown in the error."""
    trainer = data.get("trainer") if isinstance(data.get("trainer"), dict) else {}
    cluster = data.get("cluster") if isinstance(data.get("cluster"), dict) else {}
    pods = {name: pod for name, pod in cluster.items() if isinstance(pod, dict) and "gpus" in pod}
    meaning = "the GPUs the trainer trains on per node; with trainer.device cpu, gloo processes"
    problems = []
    if "processes" in trainer:
        problems.append(
            f"trainer.processes: replaced by trainer.gpus ({meaning}); write instead:\n"
            f"    trainer:\n      gpus: {trainer['processes']}"
        )
    if "trainer" in pods:
        count = pods["trainer"]["gpus"]
        instead = "device: cpu" if count in (0, "0") else f"gpus: {count}"
        problems.append(
            f"cluster.trainer.gpus: replaced by trainer.gpus ({meaning}: the update pod requests that many GPUs, "
            f"the other trainer-image steps one); write instead:\n    trainer:\n      {instead}"
        )
    for name in sorted(set(pods) - {"trainer"}):
        problems.append(f"cluster.{name}.gpus: removed (steps on the {name} image compute without torch); delete it")
    return problems


def load_spec(path: str | Path, overrides: dict[str, Any] | None = None) -> RunSpec:
    """Read and validate a YAML run spec; `overrides` maps dotted keys to values."""
    import yaml  # not at the top: the steps parse dicts and need not pay for it

    path = Path(path)
    if not path.exists():
        raise SpecError(f"run spec {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise SpecError(f"run spec {path} is not valid YAML: {err}") from None
    return parse_spec(with_overrides(data, overrides or {}), str(path))


def with_overrides(data: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """`data` (a spec as a dict, changed in place) with `overrides`' dotted keys set."""
    for dotted, value in overrides.items():
        node = data
        *parents, leaf = dotted.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return data


def section_dict(section_value: Any) -> dict[str, Any]:
    """A section as a plain dict (tuples as lists), None values kept."""
    return _plain(dataclasses.asdict(section_value))


# What the spec's keys affect, decided here once (dotted keys; a section name covers the section).
# what an update computes with (loop.max_staleness: the default off_policy_correction)
TRAINING_KEYS = ("seed", "model", "rollout", "algorithm", "trainer", "loop.max_staleness")
# free to change when a run resumes: how far it goes, where it stores, how steps are placed and where
# rollouts and updates are computed (every engine samples the same policy; the resident trainer
# computes the per-step update)
RESUMABLE_KEYS = (
    "loop",
    "storage",
    "cluster",
    "samplers",
    "rollout.engine",
    "trainer.resident",
    "trainer.endpoint",
    "trainer.device",  # where it computes; the update is the same up to float rounding
    "trainer.threads",
    "trainer.micro_batch_tokens",  # the same update, accumulated in parts
    "trainer.gradient_checkpointing",
    "trainer.gpus",  # the same update, sharded (to float rounding)
    "trainer.nodes",
    "tracking.register",  # which evaluated versions the registry gets from now on
    "tracking.registered_model",
    "reward.timeout_s",  # how long a reward may take, not what it returns
)
WARM_START_KEYS = ("seed", "model", "data", "reward.verifier", "rollout.max_new_tokens")  # what makes v0


def resume_changes(stored: dict[str, Any], new: RunSpec) -> list[tuple[str, Any, Any]]:
    """(dotted key, stored value, new value) of each setting outside RESUMABLE_KEYS that `new` changes
    against the spec a run was started with (its spec.json): a resumed run must keep them.

    The stored spec is parsed first, so what is compared is what each spec means: defaults filled
    in, `7` equal to `7.0`, lists equal to tuples."""
    try:
        stored = spec_to_dict(parse_spec(stored, "the stored spec.json"))
    except SpecError:
        pass  # written by an older rlpipe that accepted other keys: compare it as written
    before = flatten(without(stored, RESUMABLE_KEYS))
    after = flatten(without(spec_to_dict(new), RESUMABLE_KEYS))
    missing = object()
    return [
        (key, before.get(key), after.get(key))
        for key in sorted(set(before) | set(after))
        if before.get(key, missing) != after.get(key, missing)
    ]


def pick(data: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    """{dotted key: its value in `data`} for `keys` (absent keys: None)."""
    picked = {}
    for key in keys:
        node: Any = data
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        picked[key] = node
    return picked


def without(data: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    """`data` (nested) without the dotted `keys`."""
    kept = {k: v for k, v in data.items() if k not in keys}
    for key in keys:
        section, _, rest = key.partition(".")
        if rest and isinstance(kept.get(section), dict):
            kept[section] = without(kept[section], (rest,))
    return kept


def spec_to_dict(spec: RunSpec) -> dict[str, Any]:
    """Every field as plain JSON-able values (tuples as lists), explicit nulls kept: what spec.json,
    MLflow and the resident trainer's requests hold. `parse_spec(spec_to_dict(spec)) == spec`."""
    return _plain(dataclasses.asdict(spec))


def spec_to_json(spec: RunSpec) -> str:
    """The spec as one JSON string: the `spec` parameter of every KFP component and pipeline.

    A string crosses KFP unchanged, where a dict parameter (a protobuf Struct) cannot hold null and
    turns every int into a double; JSON keeps nulls, ints, floats and lists exactly."""
    return json.dumps(spec_to_dict(spec), sort_keys=True, allow_nan=False)


def spec_from_json(text: str, source: str = "the spec parameter") -> RunSpec:
    """The RunSpec a step receives as its `spec` parameter (`spec_to_json`)."""
    try:
        data = json.loads(text)
    except ValueError as err:
        raise SpecError(f"{source} is not a run spec's JSON ({err}); pass rlpipe.spec.spec_to_json(spec)") from None
    return parse_spec(data, source)


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{'a': {'b': 1}} -> {'a.b': 1} (MLflow params)."""
    flat: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat
