"""The run spec: one YAML file, validated, with errors that say what to change."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class SpecError(ValueError):
    """A run spec that cannot be used; the message names the key and what is allowed."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TinyModelSpec(_Section):
    """A Qwen2-architecture model built from a config with random init (offline demos)."""

    hidden_size: int = Field(128, ge=32)
    intermediate_size: int = Field(512, ge=1)
    num_layers: int = Field(4, ge=1)
    num_heads: int = Field(4, ge=1)
    num_kv_heads: int = Field(2, ge=1)
    max_position_embeddings: int = Field(64, ge=16)

    @model_validator(mode="after")
    def _head_size(self) -> "TinyModelSpec":
        if self.hidden_size % self.num_heads:
            raise ValueError("model.tiny.hidden_size must be divisible by model.tiny.num_heads")
        if self.hidden_size // self.num_heads < 32:
            raise ValueError(
                "model.tiny head size (hidden_size / num_heads) must be >= 32 so vLLM can load it; "
                f"got {self.hidden_size // self.num_heads}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError("model.tiny.num_heads must be a multiple of model.tiny.num_kv_heads")
        return self


class WarmStartSpec(_Section):
    """Supervised warm start before RL: SFT on the task's reference answers until the greedy accuracy
    (reward.verifier) on a validation split held out of the SFT rows reaches `target_accuracy`,
    checked every `check_every` steps, for at most `max_steps` steps (0 disables the warm start).

    Stopping at an accuracy, not a step count, lands in the same place on any CPU and seed: around
    the step where this SFT takes off, a few hundred steps (or a CPU's rounding) move greedy accuracy
    anywhere between 0.1 and 0.7."""

    max_steps: int = Field(2000, ge=0)
    target_accuracy: float | None = Field(
        0.4, gt=0, le=1, description="Stop once validation greedy accuracy reaches this; null: run max_steps"
    )
    check_every: int = Field(25, ge=1, description="Optimizer steps between validation checks")
    validation_size: int = Field(256, ge=1, description="Train rows held out of the SFT for the stop check")
    batch_size: int = Field(64, ge=1)
    lr: float = Field(1e-3, gt=0)


class ModelSpec(_Section):
    path: str | None = Field(
        None, description="Local dir, gs:// or other fsspec URI, or a hub id. None builds model.tiny."
    )
    tiny: TinyModelSpec = TinyModelSpec()
    warm_start: WarmStartSpec = WarmStartSpec()


class TaskSpec(_Section):
    name: Literal["addition"] = "addition"
    digits: int = Field(2, ge=1, le=6)
    train_size: int = Field(9500, ge=1)
    eval_size: int = Field(500, ge=1, description="Fixed held-out set, disjoint from train")
    seed: int | None = Field(
        None, description="Seed of the generated problems and the train/eval split; default: the run's seed"
    )


class RewardSpec(_Section):
    functions: list[str] = Field(
        default_factory=lambda: ["rlpipe.tasks.addition:exact_match"],
        min_length=1,
        description="Reward functions as 'module:function'; rewards are summed with `weights`.",
    )
    weights: list[float] | None = None
    verifier: str = Field(
        "rlpipe.tasks.addition:exact_match",
        description="'module:function' (reward signature) scoring held-out evaluation and the warm start's "
        "stop check; 1.0 = correct, accuracy = its mean",
    )

    @model_validator(mode="after")
    def _check(self) -> "RewardSpec":
        if self.verifier.count(":") != 1 or not all(self.verifier.split(":")):
            raise ValueError(f"reward.verifier {self.verifier!r} must look like 'package.module:function'")
        for ref in self.functions:
            if ref.count(":") != 1 or not all(ref.split(":")):
                raise ValueError(f"reward.functions entry {ref!r} must look like 'package.module:function'")
        if self.weights is not None and len(self.weights) != len(self.functions):
            raise ValueError(
                f"reward.weights has {len(self.weights)} entries but reward.functions has {len(self.functions)}"
            )
        return self


class RolloutSpec(_Section):
    engine: Literal["torch", "vllm", "sampler"] = Field(
        "torch",
        description="torch: HF model in the generate step (in the resident trainer when trainer.resident); "
        "vllm: vllm.LLM in the generate step; "
        "sampler: long-lived vLLM servers (section samplers), the generate step is a thin HTTP client",
    )
    prompts_per_iteration: int = Field(512, ge=1)
    samples_per_prompt: int = Field(8, ge=2, description="G: completions per prompt (one GRPO group)")
    max_new_tokens: int = Field(5, ge=1)
    temperature: float = Field(1.0, gt=0)
    top_k: int = Field(0, ge=0, description="0 disables top-k")
    top_p: float = Field(1.0, gt=0, le=1)
    batch_size: int = Field(4096, ge=1, description="Sequences per forward pass while sampling")


class SamplersSpec(_Section):
    """Long-lived vLLM servers for `rollout.engine: sampler`; reloaded in place by sync_weights."""

    replicas: int = Field(
        1, ge=1, description="Servers `rlpipe run` starts on loopback when endpoints is empty (1 per free core or GPU)"
    )
    endpoints: list[str] = Field(
        default_factory=list,
        description="Base URLs of running samplers; a host that resolves to several addresses (a headless "
        "Service) counts as one replica per address. Empty: `rlpipe run` starts `replicas` local servers.",
    )
    requests_per_replica: int = Field(
        64, ge=1, description="Requests in flight per replica (x G sequences): vLLM batches what is in flight"
    )
    request_timeout_s: float = Field(300, gt=0)
    startup_timeout_s: float = Field(900, gt=0, description="How long generate waits for a replica to be ready")
    kv_cache_gib: int = Field(1, ge=1, description="KV cache GiB per local CPU replica (VLLM_CPU_KVCACHE_SPACE)")
    extra_args: list[str] = Field(default_factory=list, description="More vLLM server flags for local replicas")


class AlgorithmSpec(_Section):
    name: Literal["grpo"] = "grpo"
    scale_rewards: Literal["group", "batch", "none"] = "group"
    clip_eps: float = Field(0.2, gt=0)
    kl_coef: float = Field(0.0, ge=0, description="beta for the k3 KL to the frozen reference (v0)")
    loss_aggregation: Literal["sequence_mean", "token_mean"] = "sequence_mean"
    track_reference_kl: bool = Field(
        True, description="Log kl/mean to v0 even when kl_coef is 0 (estimated on each iteration's first mini-batch)"
    )


class TrainerSpec(_Section):
    lr: float = Field(5e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    max_grad_norm: float = Field(1.0, gt=0)
    warmup_steps: int = Field(10, ge=0, description="Linear LR warmup over the first optimizer steps")
    mini_batches: int = Field(4, ge=1, description="Optimizer steps per epoch over one iteration's batch")
    epochs: int = Field(1, ge=1)
    threads: int = Field(1, ge=1, description="torch CPU threads per step")
    resident: bool = Field(
        False,
        description="Train in a long-lived trainer process that keeps policy and optimizer in memory between "
        "iterations; the update step becomes a thin client (rlpipe run starts the trainer locally)",
    )
    endpoint: str | None = Field(
        None, description="URL of the resident trainer's Service on a cluster; empty locally: rlpipe run starts one"
    )


class LoopSpec(_Section):
    iterations: int = Field(25, ge=1)
    iterations_per_run: int = Field(5, ge=1, description="Iterations unrolled into one pipeline run")
    eval_every: int = Field(5, ge=1)


class StorageSpec(_Section):
    root: str = Field("./runs", description="Parent of run directories: a local path or fsspec URI")
    keep_versions: int = Field(3, ge=1, description="Weight versions kept besides v0")
    cache: str | None = Field(None, description="Warm-start cache; default <root>/.cache")


class TrackingSpec(_Section):
    uri: str | None = Field(None, description="MLflow tracking URI; default sqlite:///<run dir>/mlflow.db")
    experiment: str = "rlpipe"


class Toleration(_Section):
    key: str
    operator: Literal["Equal", "Exists"] = "Exists"
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = "NoSchedule"


class PodSpec(_Section):
    """Image, resources and placement for one class of steps on the cluster."""

    image: str
    cpu: str = "1"
    memory: str = "2Gi"
    cpu_limit: str | None = None
    memory_limit: str | None = None
    gpus: int = Field(0, ge=0)
    accelerator: str = Field("nvidia.com/gpu", description="KFP accelerator type when gpus > 0")
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[Toleration] = Field(default_factory=list)
    timeout_s: int = Field(7200, ge=60)


class SecretEnv(_Section):
    """Expose one key of a Kubernetes Secret as an env var (by reference: values never enter the spec)."""

    secret: str
    key: str
    env: str
    steps: list[str] | None = Field(None, description="Steps that get it (e.g. [track]); None = every step")


TRAINER_STEPS = ("warm_start", "generate", "update", "evaluate")
STEP_NAMES = TRAINER_STEPS + (
    "prepare",
    "publish_warm_start",
    "plan",
    "iterations_todo",
    "score",
    "advantages",
    "sync_weights",
    "track",
)


def thin_client_steps(spec: "RunSpec") -> frozenset[str]:
    """Steps that only talk to long-lived servers: generate with the sampler engine; update and
    evaluate (and generate with the torch engine) with a resident trainer. They import no torch
    and run on the light step image with no GPU."""
    thin = {"generate"} if spec.rollout.engine == "sampler" else set()
    if spec.trainer.resident:
        thin |= {"update", "evaluate"} | ({"generate"} if spec.rollout.engine == "torch" else set())
    return frozenset(thin)


def uses_trainer_image(step: str, thin: frozenset[str] = frozenset()) -> bool:
    """Torch steps run on the trainer image (and GPU), unless they are thin clients."""
    return step in TRAINER_STEPS and step not in thin


class ClusterSpec(_Section):
    """Applied to every task at compile time (`rlpipe compile`); ignored by `rlpipe run`."""

    trainer: PodSpec = PodSpec(image="ghcr.io/rlpipe/trainer:0.1.0", cpu="4", memory="16Gi", gpus=1)
    step: PodSpec = PodSpec(image="ghcr.io/rlpipe/step:0.1.0")
    sampler_image: str = "ghcr.io/rlpipe/sampler:0.1.0"
    pvc: str | None = Field(None, description="ReadWriteMany PVC holding the run root (Lustre/Filestore/NFS)")
    mount_path: str = "/mnt/rlpipe"
    secrets: list[SecretEnv] = Field(default_factory=list)
    retries: int = Field(2, ge=0, description="Every step is safe to retry: nothing is visible before sync commits")
    retry_backoff: str = "30s"
    run_as_user: int = 1000

    @model_validator(mode="after")
    def _known_steps(self) -> "ClusterSpec":
        for secret in self.secrets:
            unknown = sorted(set(secret.steps or []) - set(STEP_NAMES))
            if unknown:
                raise ValueError(f"cluster.secrets steps {unknown} are not steps; allowed: {', '.join(STEP_NAMES)}")
        return self


class RunSpec(_Section):
    name: str = Field(..., pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    seed: int = 0
    model: ModelSpec = ModelSpec()
    task: TaskSpec = TaskSpec()
    reward: RewardSpec = RewardSpec()
    rollout: RolloutSpec = RolloutSpec()
    samplers: SamplersSpec = SamplersSpec()
    algorithm: AlgorithmSpec = AlgorithmSpec()
    trainer: TrainerSpec = TrainerSpec()
    loop: LoopSpec = LoopSpec()
    storage: StorageSpec = StorageSpec()
    tracking: TrackingSpec = TrackingSpec()
    cluster: ClusterSpec = ClusterSpec()

    @model_validator(mode="after")
    def _mini_batches_fit(self) -> "RunSpec":
        sequences = self.rollout.prompts_per_iteration * self.rollout.samples_per_prompt
        if self.trainer.mini_batches > sequences:
            raise ValueError(
                f"trainer.mini_batches ({self.trainer.mini_batches}) exceeds the sequences per iteration "
                f"({sequences} = rollout.prompts_per_iteration x rollout.samples_per_prompt)"
            )
        return self

    @model_validator(mode="after")
    def _vllm_logprobs_match(self) -> "RunSpec":
        truncated = self.rollout.top_k > 0 or self.rollout.top_p < 1.0
        if self.rollout.engine != "torch" and truncated:
            raise ValueError(
                f"rollout.engine {self.rollout.engine} reports log-probs of the top-k/top-p truncated distribution, "
                "which the update's importance ratio (full softmax at the temperature) does not match; "
                "set rollout.top_k: 0 and rollout.top_p: 1.0, or use rollout.engine: torch"
            )
        return self


def _allowed_keys(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """Field names of the section that `loc` (minus its last element) points into."""
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        annotation = getattr(field, "annotation", None)
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return []
        model = annotation
    return sorted(model.model_fields)


def _format_errors(err: ValidationError, source: str) -> str:
    lines = [f"invalid run spec {source}:"]
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "<top level>"
        if e["type"] == "extra_forbidden":
            allowed = ", ".join(_allowed_keys(RunSpec, e["loc"]))
            lines.append(f"  {key}: unknown key; allowed keys here: {allowed}")
        else:
            msg = e["msg"].removeprefix("Value error, ")
            lines.append(f"  {key}: {msg} (got {e.get('input')!r})")
    return "\n".join(lines)


def parse_spec(data: dict[str, Any], source: str = "<dict>") -> RunSpec:
    """Validate a spec dict; raise SpecError naming each bad key."""
    if not isinstance(data, dict):
        raise SpecError(f"invalid run spec {source}: expected a mapping at the top level, got {type(data).__name__}")
    try:
        return RunSpec.model_validate(data)
    except ValidationError as err:
        raise SpecError(_format_errors(err, source)) from None


def load_spec(path: str | Path, overrides: dict[str, Any] | None = None) -> RunSpec:
    """Read and validate a YAML run spec; `overrides` maps dotted keys to values."""
    path = Path(path)
    if not path.exists():
        raise SpecError(f"run spec {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise SpecError(f"run spec {path} is not valid YAML: {err}") from None
    for dotted, value in (overrides or {}).items():
        node = data
        *parents, leaf = dotted.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return parse_spec(data, str(path))


def spec_to_dict(spec: RunSpec) -> dict[str, Any]:
    """Plain JSON-able dict (what KFP components receive); None values are dropped since KFP
    parameters cannot hold null, and parsing restores them as defaults."""
    return spec.model_dump(mode="json", exclude_none=True)


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
