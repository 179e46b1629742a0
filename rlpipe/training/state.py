"""What training holds between optimizer steps (Trainer) and the stored tensors of its version
(StoredVersion): the record every training module reads, in a module that imports none of them."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # transformers is imported through rlpipe.models.loading (rlpipe.models.optional_imports)
    from peft import PeftModel
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from rlpipe.spec import RunSpec
    from rlpipe.store.weights import WeightRef
    from rlpipe.training.critic import Critic


@dataclass
class StoredVersion:
    """The stored tensors of the version the trainer last sealed or loaded, and deltas since a whole one:
    in memory (the resident trainer's, as it sealed them) or read one at a time from the version's whole
    files (StoredTensors: a trainer that loaded the version holds no second copy)."""

    tensors: Mapping[str, torch.Tensor]
    version: int
    chain: int


@dataclass
class Trainer:
    """What training holds between optimizer steps: the policy at `weights`, its optimizer, the
    frozen reference (when the KL is used; with LoRA the policy itself, adapters disabled), the
    sealed base its adapters apply to (LoRA), the critic at the same version (PPO), and the spec
    it was built for."""

    spec: RunSpec
    run_root: str
    weights: WeightRef
    policy: PreTrainedModel | PeftModel  # a PeftModel with LoRA (model.lora)
    tokenizer: PreTrainedTokenizerBase
    optimizer: torch.optim.Optimizer
    reference: PreTrainedModel | PeftModel | None  # with LoRA the policy itself
    base: WeightRef | None = None
    critic: Critic | None = None
    # pi_prox computed ahead for the next batch: {"sha256": of the weights, "logprobs": {sequence_key: [...]}}
    proximal: dict = field(default_factory=dict)
    stored: StoredVersion | None = None  # the stored tensors of `weights`, when the next version may be a delta
    checkpoint_writer: threading.Thread | None = None  # the resident trainer's checkpoint, written in the background
    replayed: dict[str, float] = field(default_factory=dict)  # trainer/replayed_updates, trainer/replay_exact
    packed: bool = False  # micro-batches packed without padding (trainer.padding_free)
