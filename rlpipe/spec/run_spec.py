"""RunSpec: the whole run spec, its sections together, with the rules that span sections."""

from __future__ import annotations

from rlpipe.spec.algorithm import AlgorithmSpec, default_algorithm
from rlpipe.spec.held_out import EvaluationSpec
from rlpipe.spec.placement import ClusterSpec, StorageSpec, TrackingSpec
from rlpipe.spec.schema import DataSpec, ModelSpec, PreferencesSpec, RewardSpec, RolloutSpec, SamplersSpec
from rlpipe.spec.section import section, setting
from rlpipe.spec.sharing import SharingSpec
from rlpipe.spec.training import LoopSpec, TrainerSpec


@section
class RunSpec:
    """A run: its name and seed, and one section per concern."""

    name: str = setting(
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", doc="The run's name: its root is <storage.root>/<name>"
    )
    seed: int = setting(default=0, doc="Seeds the rows, the held-out split, sampling and the update's order")
    model: ModelSpec = setting(
        default_factory=ModelSpec,
        doc="The policy: the model to start from (a path, or model.tiny), its supervised warm start, and LoRA",
    )
    data: DataSpec = setting(default_factory=DataSpec)
    reward: RewardSpec = setting(
        default_factory=RewardSpec,
        doc="What a completion earns (reward functions, summed) and what judges held-out accuracy (the verifier)",
    )
    rollout: RolloutSpec = setting(
        default_factory=RolloutSpec, doc="How each iteration's completions are sampled (the generate step)"
    )
    samplers: SamplersSpec = setting(default_factory=SamplersSpec)
    algorithm: AlgorithmSpec = setting(
        default_factory=default_algorithm,
        doc="The RL algorithm (advantages and loss): `name`, the options every algorithm takes, and the named "
        "algorithm's own (its table below); null: the algorithm's default (docs/algorithms.md)",
    )
    trainer: TrainerSpec = setting(
        default_factory=TrainerSpec,
        doc="How the update trains: AdamW, mini-batches, precision, memory, devices, the resident trainer",
    )
    loop: LoopSpec = setting(
        default_factory=LoopSpec,
        doc="How long the loop runs, in how many pipeline runs, when it evaluates, stops early or runs ahead",
    )
    evaluation: EvaluationSpec = setting(default_factory=EvaluationSpec)
    storage: StorageSpec = setting(default_factory=StorageSpec)
    tracking: TrackingSpec = setting(default_factory=TrackingSpec)
    cluster: ClusterSpec = setting(default_factory=ClusterSpec)
    sharing: SharingSpec = setting(
        default_factory=SharingSpec,
        doc="The resident trainer and the samplers take turns on one accelerator, and runs naming one lease on it",
    )
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
        if self.storage.optimizer_every > 1 and self.algorithm.name == "ppo":
            raise ValueError(
                "storage.optimizer_every > 1 replays updates after a restart, and PPO's critic is checkpointed "
                "every version; set storage.optimizer_every: 1"
            )
        if self.storage.optimizer_every > 1 and self.model.lora is not None:
            raise ValueError(
                "storage.optimizer_every > 1 is for whole-weight training: model.lora's optimizer state is the "
                "adapters' (a few MB), written every version; set storage.optimizer_every: 1"
            )
        if self.rollout.environment is not None and self.algorithm.name == "dpo":
            raise ValueError(
                "rollout.environment samples trajectories, and algorithm.name dpo trains on a fixed preference "
                "file; use online_dpo (pairs of sampled trajectories) or a policy-gradient algorithm"
            )
        truncated = self.rollout.top_k > 0 or self.rollout.top_p < 1.0
        if self.rollout.engine != "torch" and truncated:
            raise ValueError(
                f"rollout.engine {self.rollout.engine} reports log-probs of the top-k/top-p truncated distribution, "
                "which the update's importance ratio (full softmax at the temperature) does not match; "
                "set rollout.top_k: 0 and rollout.top_p: 1.0, or use rollout.engine: torch"
            )
        producer = self.loop.max_staleness and self.loop.overlap == "producer"
        if producer and self.rollout.engine == "vllm":
            raise ValueError(
                "loop.max_staleness >= 1 samples ahead in a long-lived producer, and rollout.engine vllm loads an "
                "engine per call; use rollout.engine: sampler (long-lived vLLM servers) or torch, or loop.overlap: "
                "dag (each generate task loads its version)"
            )
        if self.loop.partial_rollouts and not (
            producer and self.rollout.engine == "torch" and self.rollout.environment is None
        ):
            raise ValueError(
                "loop.partial_rollouts continues a completion under a version committed while it is sampled: it "
                "needs loop.max_staleness >= 1 with loop.overlap producer, rollout.engine torch and no "
                "rollout.environment; set loop.partial_rollouts: false"
            )
        if self.loop.overlap == "dag":
            s = self.loop.max_staleness
            if s == 0:
                raise ValueError("loop.overlap dag offsets iterations by loop.max_staleness: set it to 1 or more")
            if self.rollout.engine == "sampler":
                raise ValueError(
                    "loop.overlap dag: each generate task samples with its own version, and the samplers serve one "
                    "at a time; use loop.overlap: producer with rollout.engine sampler (the producer reloads them), "
                    "or rollout.engine torch or vllm"
                )
            if self.storage.keep_versions < s + 1:
                raise ValueError(
                    f"loop.overlap dag: iteration N generates with v(N-1-s) while v(N-1) is published, so "
                    f"storage.keep_versions must be at least max_staleness + 1 = {s + 1}, got "
                    f"{self.storage.keep_versions}"
                )
        if self.loop.fuse_steps and (self.loop.overlap == "dag" or self.algorithm.name == "dpo"):
            raise ValueError(
                "loop.fuse_steps runs an iteration's steps in one task, and loop.overlap dag (offline DPO's pipeline) "
                "runs them as tasks of their own; set loop.fuse_steps: false"
            )
        self._check_sharing()
        if self.loop.max_staleness and self.algorithm.name == "dpo":
            raise ValueError(
                "algorithm dpo trains on a fixed preference set, with no rollouts; set loop.max_staleness: 0"
            )

    def _check_sharing(self) -> None:
        sharing = self.sharing
        if sharing.lease and not sharing.enabled:
            raise ValueError(f"sharing.lease {sharing.lease!r} takes turns on a shared device: set sharing.enabled")
        if sharing.claim is not None and not sharing.enabled:
            raise ValueError("sharing.claim is the device the trainer and samplers share: set sharing.enabled: true")
        if not sharing.enabled:
            return
        if not self.trainer.resident:  # per-step mode: the update is a KFP task of its own
            raise ValueError(
                "sharing.enabled needs trainer.resident: true: a KFP task cannot reference a shared device claim "
                "(KFP 2.17, installed, has no DRA call; KFP 2.18's kfp.kubernetes.add_resource_claim takes claim "
                "templates only, one claim per pod), while the resident trainer and the samplers can"
            )
        if self.rollout.engine != "sampler":
            raise ValueError(
                "sharing.enabled: the resident trainer and the samplers take turns on the device; set "
                "rollout.engine: sampler (other engines hold no device between steps)"
            )
        if self.loop.max_staleness:
            raise ValueError(
                "sharing.enabled: the trainer and the samplers take turns, and loop.max_staleness >= 1 runs them at "
                "once; set loop.max_staleness: 0"
            )
        if sharing.claim is not None and self.trainer.nodes > 1:
            raise ValueError(
                "sharing.claim: one ResourceClaim is allocated on one node, and trainer.nodes > 1 spans several; "
                "set trainer.nodes: 1"
            )
        if sharing.claim is not None and sharing.claim.count != self.trainer.gpus:
            raise ValueError(
                f"sharing.claim.count ({sharing.claim.count}) must equal trainer.gpus ({self.trainer.gpus}): the "
                "trainer's processes use every device of the claim"
            )
