"""The sections that say how the update trains (trainer: AdamW, mini-batches, precision, memory, devices,
the resident trainer) and how long the loop runs (loop)."""

from __future__ import annotations

from typing import Literal

from rlpipe.spec.section import section, setting


@section
class TrainerSpec:
    lr: float = setting(default=5e-4, gt=0, doc="AdamW learning rate (constant after warmup_steps)")
    weight_decay: float = setting(default=0.0, ge=0, doc="AdamW weight decay")
    betas: tuple[float, float] = setting(default=(0.9, 0.999), doc="AdamW betas: beta1, beta2")
    max_grad_norm: float = setting(default=1.0, gt=0, doc="Gradients clipped to this global norm per optimizer step")
    warmup_steps: int = setting(default=10, ge=0, doc="Linear LR warmup over the first optimizer steps")
    mini_batches: int = setting(default=4, ge=1, doc="Optimizer steps per epoch over one iteration's batch")
    epochs: int = setting(default=1, ge=1, doc="Passes over one iteration's batch")
    threads: int = setting(default=1, ge=1, doc="torch CPU threads per step")
    device: Literal["auto", "cpu", "cuda"] = setting(
        default="auto",
        doc="Where the torch steps train, sample and evaluate: auto = cuda when a GPU is visible; "
        "cuda with none visible is an error, never a silent CPU run",
    )
    dtype: Literal["float32", "bfloat16"] = setting(
        default="float32",
        doc="Compute precision: bfloat16 autocasts the forward passes while weights, gradients and "
        "AdamW state stay float32 (mixed precision with fp32 master weights)",
    )
    micro_batch_tokens: int | Literal["auto"] | None = setting(
        default="auto",
        ge=1,
        doc="Token budget (padded rows x width) of one forward/backward; a mini-batch is split into micro-batches of "
        "rows sorted by length within it and their gradients accumulated (the same update, less memory and padding). "
        "auto: 1024 on a CPU (activations stay in cache: ~1.2x faster), one pass on a GPU. null: one pass",
    )
    padding_free: bool = setting(
        default=False,
        doc="Rows packed end to end with position ids, no padding (varlen attention on a GPU): the same update",
    )
    gradient_checkpointing: bool = setting(
        default=False,
        doc="Recompute activations in the backward pass instead of keeping them (less memory, ~30% slower)",
    )
    disable_dropout: bool = setting(
        default=True,
        doc="Turn off every dropout (the model's, LoRA's) in the update's log-prob passes, so the importance "
        "ratio compares the policy with itself (TRL's disable_dropout). false: keep the model's dropout",
    )
    logit_chunk_tokens: int | None = setting(
        default=512,
        ge=1,
        doc="Completion tokens whose vocabulary-wide logits exist at once: log-probs and entropy are computed "
        "from the final hidden states in chunks this long, each recomputed in the backward pass, so the "
        "update never holds tokens x vocabulary logits (the same values). null: the whole logits at once",
    )
    gpus: int = setting(
        default=1,
        ge=1,
        doc="GPUs the trainer trains on per node, the one count of them: the update (in its own pod, or in the "
        "resident trainer) runs as that many torchrun processes, FSDP2 sharding weights, gradients and AdamW "
        "state. On a cluster the update pod (or each resident trainer node) requests this many; the other "
        "trainer-image steps (warm_start, generate with the torch engine, evaluate, score with a reward model) "
        "compute on one device and request 1. With trainer.device cpu: that many gloo processes, no GPU requested",
    )
    nodes: int = setting(
        default=1,
        ge=1,
        doc="Nodes of the resident trainer: one torchrun job over nodes x gpus processes, which `rlpipe compile` "
        "writes as a JobSet beside the pipeline; > 1 needs trainer.resident",
    )
    resident: bool = setting(
        default=False,
        doc="Train in a long-lived trainer process that keeps policy and optimizer in memory between "
        "iterations; the update step becomes a thin client (rlpipe run starts the trainer locally)",
    )
    endpoint: str | None = setting(
        default=None,
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
    iterations: int = setting(
        default=25, ge=1, doc="Iterations in all, one weight version each (`rlpipe run --iterations`)"
    )
    iterations_per_run: int = setting(default=5, ge=1, doc="Iterations unrolled into one pipeline run")
    eval_every: int = setting(
        default=5, ge=1, doc="Held-out eval at iteration 0, every this many iterations and the last"
    )
    stop_when: str | None = setting(
        default=None,
        pattern=r"^\s*[\w/.-]+\s*(>=|<=|>|<)\s*-?[0-9.]+(e-?[0-9]+)?\s*$",
        doc="An eval gate that ends the loop early: '<metric> >= <value>' (or >, <=, <) over a held-out eval's "
        "metrics, e.g. 'eval/accuracy_greedy >= 0.7', 'eval/pass_at_8 >= 0.9' or 'eval/<set>/accuracy_greedy > 0.5'. "
        "Checked at every eval; the version that passed is the run's",
    )
    stop_on_signs: bool = setting(
        default=True,
        doc="End the loop at a degenerate start or an iteration in which no sample "
        "earned reward (rlpipe.evaluation.diagnosis); false trains on through them (a very sparse reward)",
    )
    max_staleness: int = setting(
        default=0,
        ge=0,
        doc="Asynchronous RL: iteration N may train on rollouts from v(N-1-s) .. v(N-1) that a producer generated "
        "ahead, while the trainer updated (rlpipe.services.producer.buffer). 0: the synchronous loop",
    )
    partial_rollouts: bool = setting(
        default=False,
        doc="Asynchronous RL, producer and torch engine: a completion being sampled when a new version is committed "
        "goes on under it (prefilled again with the new weights), each token's version in token_versions, corrected",
    )
    overlap: Literal["producer", "dag"] = setting(
        default="producer",
        doc="How generation runs ahead when max_staleness >= 1. producer: a long-lived producer samples into the "
        "rollout buffer with the latest version (any engine but vllm). dag: iteration N's generate and score take "
        "v(N-1-s) and run beside update N-1 as sibling tasks, each in its own pod (a KFP cluster; the local runner "
        "runs one task at a time); engines torch and vllm, storage.keep_versions >= s + 1",
    )
    fuse_steps: bool = setting(
        default=False,
        doc="One KFP task (a process, a pod) runs each iteration's steps and due eval, not one task a step: the same "
        "functions, artifacts and metrics without each step's start (~0.1 s a process, seconds a pod). Not with dag",
    )
