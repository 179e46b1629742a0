"""The one door to the trainer: a TrainerSession opens from the weight store at a version, trains on a
batch and saves the next version, samples, scores values and evaluates with what it holds. The update
step opens one per update (`update_policy`); the resident trainer (rlpipe.services.trainer.server)
keeps one between requests and adds only the wire.

    session = TrainerSession.open(spec, run_root, weights, cache_root)   # rlpipe.training.loading
    staged, metrics = session.update(batch_path, iteration)             # train_on_batch, then save
    session.generate(iteration, rollouts_uri)   # torch engine, on the session's policy
    session.values(scored_uri, valued_uri)      # PPO: the session's critic
    session.evaluate(iteration)                 # held-out greedy accuracy of the session's policy
    session.offload(weights) / session.onload() # sharing: its device memory given back between turns

Each method hands the phase's cached GPU memory back when it ends (models.loading.release_memory).
Several processes (torchrun) each hold a session and call the same method together; the first writes
what they produce.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from rlpipe.metric_keys import UPDATE_LOAD, UPDATE_TIME
from rlpipe.models.loading import release_memory
from rlpipe.spec import RunSpec
from rlpipe.store.run_root import filesystem
from rlpipe.store.weights import WeightRef
from rlpipe.training.checkpoints import keeps_state_in_memory
from rlpipe.training.distributed import gathered, update_in_processes, world
from rlpipe.training.loading import open_trainer, save_version
from rlpipe.training.offload import Offloaded, offload, onload
from rlpipe.training.state import Trainer
from rlpipe.training.trainer import train_on_batch


@dataclass
class TrainerSession:
    """A trainer at one weights version (`weights`), opened from the store, and the cache it reads through."""

    trainer: Trainer
    cache_root: str
    offloaded: Offloaded | None = None  # what offload moved to host memory, until onload

    @classmethod
    def open(cls, spec: RunSpec, run_root: str, weights: WeightRef, cache_root: str) -> TrainerSession:
        """The trainer at `weights` (rlpipe.training.loading.open_trainer)."""
        return cls(open_trainer(spec, run_root, weights, cache_root), cache_root)

    @property
    def spec(self) -> RunSpec:
        return self.trainer.spec

    @property
    def run_root(self) -> str:
        return self.trainer.run_root

    @property
    def weights(self) -> WeightRef:
        return self.trainer.weights

    def train(self, batch_path: str, iteration: int) -> dict[str, float]:
        """One iteration of optimizer steps on the batch (rlpipe.training.trainer.train_on_batch), and what
        opening it replayed, the first time."""
        metrics = train_on_batch(self.trainer, batch_path, iteration) | self.trainer.replayed
        self.trainer.replayed = {}
        return metrics

    def save(self, iteration: int, timings: dict | None = None, batch_path: str | None = None) -> WeightRef:
        """Stage and seal v(N+1) and the trainer's state (rlpipe.training.loading.save_version); the session
        is now at v(N+1)."""
        return save_version(self.trainer, iteration, self.cache_root, timings, batch_path)

    def update(self, batch_path: str, iteration: int) -> tuple[WeightRef, dict[str, float]]:
        """Train on the batch and save v(N+1): (its staged WeightRef, the update's metrics)."""
        started = time.time()
        metrics = self.train(batch_path, iteration)
        trained = time.time()
        timings: dict[str, float] = {}
        kept = batch_path if keeps_state_in_memory(self.spec) else None  # to replay to v(N+1)
        staged = self.save(iteration, timings, kept)
        done = time.time()
        metrics |= timings | {UPDATE_TIME: done - started, "weights/stage_s": done - trained}  # within update_s
        return staged, metrics | release_memory(self.trainer.policy.device, "update")

    def generate(self, iteration: int, rollouts_uri: str) -> dict[str, float]:
        """Sample the iteration's rollouts with the session's policy (torch engine) into `rollouts_uri`."""
        from rlpipe.engines import LoadedModel, generate_rollouts

        trainer = self.trainer
        with tempfile.TemporaryDirectory() as tmp, gathered(trainer.policy):
            local = f"{tmp}/rollouts.parquet"
            loaded = LoadedModel(trainer.policy, trainer.tokenizer)
            metrics = generate_rollouts(
                self.spec, self.run_root, self.weights, iteration, local, self.cache_root, loaded=loaded
            )
            if world()[0] == 0:
                fs, remote = filesystem(rollouts_uri)
                fs.makedirs(remote.rsplit("/", 1)[0], exist_ok=True)
                fs.put_file(local, remote)
        return metrics | release_memory(trainer.policy.device, "generate")

    def values(self, scored_uri: str, valued_uri: str) -> dict[str, float]:
        """The session's critic's value of every completion token of the scored rollouts (PPO's values step)."""
        from rlpipe.training.critic import compute_values

        trainer = self.trainer
        if trainer.critic is None:
            raise ValueError(f"algorithm {self.spec.algorithm.name} has no critic: its iterations have no values step")
        fs, scored_remote = filesystem(scored_uri)
        _, valued_remote = filesystem(valued_uri)
        with tempfile.TemporaryDirectory() as tmp:
            fs.get_file(scored_remote, f"{tmp}/scored.parquet")
            metrics = compute_values(
                self.spec, self.run_root, self.weights, f"{tmp}/scored.parquet", f"{tmp}/valued.parquet",
                self.cache_root, critic=trainer.critic,
            )  # fmt: skip
            if world()[0] == 0:
                fs.put_file(f"{tmp}/valued.parquet", valued_remote)
        return metrics | release_memory(trainer.policy.device, "values")

    def evaluate(self, iteration: int) -> dict[str, float]:
        """Greedy held-out accuracy of the session's policy; the first process records it
        (rlpipe.evaluation.accuracy.evaluate_policy)."""
        from rlpipe.engines import LoadedModel
        from rlpipe.evaluation.accuracy import evaluate_policy

        trainer = self.trainer
        with gathered(trainer.policy):
            loaded = LoadedModel(trainer.policy, trainer.tokenizer)
            record = world()[0] == 0
            metrics = evaluate_policy(
                self.spec, self.run_root, self.weights, iteration, self.cache_root, loaded, record=record
            )
        return metrics | release_memory(trainer.policy.device, "evaluate")

    def offload(self, weights: bool) -> dict[str, float]:
        """Give the device back between turns (sharing.enabled; rlpipe.training.offload): the optimizer state to
        host memory, the gradients dropped, the weights moved too with `weights`. {seconds, bytes the device
        gave back}; nothing when offloaded already."""
        started = time.time()
        if self.offloaded is not None:
            return {"seconds": 0.0, "bytes": 0.0}
        self.offloaded, freed = offload(self.trainer, weights)
        return {"seconds": time.time() - started, "bytes": float(freed)}

    def onload(self) -> dict[str, float]:
        """What offload moved, back on the device it left: {seconds, bytes moved}; nothing when on it."""
        started = time.time()
        if self.offloaded is None:
            return {"seconds": 0.0, "bytes": 0.0}
        moved = onload(self.offloaded)
        self.offloaded = None
        return {"seconds": time.time() - started, "bytes": float(moved)}

    def start_proximal(self) -> None:
        """Forget pi_prox computed ahead for an older version: from now on, the session's version's."""
        self.trainer.proximal = {"sha256": self.weights["sha256"], "logprobs": {}}

    def proximal_parts(self, rows: list[dict], rows_per_part: int) -> Iterator[list[dict]]:
        """`rows` in parts of at most `rows_per_part`, each within one micro-batch's token budget."""
        from rlpipe.training.batching import micro_batches, token_budget

        budget = token_budget(self.spec.trainer.micro_batch_tokens, self.trainer.policy.device.type)
        for group in micro_batches(rows, budget):
            yield from (group[i : i + rows_per_part] for i in range(0, len(group), rows_per_part))

    def add_proximal(self, part: list[dict]) -> None:
        """pi_prox of `part`'s rows under the session's policy, kept for the next update (off_policy)."""
        from rlpipe.training.logprobs import sequence_key
        from rlpipe.training.off_policy import policy_logprobs

        logprobs = policy_logprobs(self.trainer, part)
        self.trainer.proximal["logprobs"].update(zip(map(sequence_key, part), logprobs))


def update_policy(
    spec: RunSpec, run_root: str, weights: WeightRef, batch_path: str, iteration: int, cache_root: str
) -> tuple[WeightRef, dict[str, float]]:
    """The update step: train on the batch from weights v(N) in this process (or, with trainer.gpus > 1,
    in that many torchrun processes, each running `main`); stage v(N+1) and its optimizer state."""
    if spec.trainer.gpus > 1 and "RANK" not in os.environ:
        return update_in_processes(spec, run_root, weights, batch_path, iteration, cache_root)
    started = time.time()
    session = TrainerSession.open(spec, run_root, weights, cache_root)
    loaded = time.time()
    staged, metrics = session.update(batch_path, iteration)
    return staged, metrics | {UPDATE_LOAD: loaded - started}


def join_processes(device: str, collective_timeout_s: float) -> tuple[int, int]:
    """(this process's rank, the number of processes) of a trainer under torchrun ((0, 1) alone), with
    torch and transformers imported before the first request."""
    from rlpipe.models.devices import resolve_device
    from rlpipe.training.distributed import init_from_torchrun

    return init_from_torchrun(resolve_device(device), collective_timeout_s)


def main(argv: list[str] | None = None) -> None:
    """One torchrun process of update_in_processes: `python -m rlpipe.training.session REQUEST`."""
    import json
    import sys

    from rlpipe.spec import parse_spec

    with open((argv or sys.argv[1:])[0]) as f:
        request: dict[str, Any] = json.load(f)
    spec = parse_spec(request["spec"])
    args = (request["run_root"], request["weights"], request["batch_path"], request["iteration"], request["cache_root"])
    staged, metrics = update_policy(spec, *args)
    if world()[0] == 0:
        with open(request["result"], "w") as f:
            json.dump({"staged": staged, "metrics": metrics}, f)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
