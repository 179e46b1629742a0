"""TRL's side of benchmarks/vs_trl.py: GRPOTrainer on the reference model, run in the child process
that `vs_trl.py --run-trl` starts (not a benchmark on its own). Writes its curve and counts as JSON."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from machine import THREADS_ENV, run_measured  # benchmarks/ is on sys.path as a script

if TYPE_CHECKING:
    from trl import GRPOConfig

    from rlpipe.spec import RunSpec

VERIFIER = "rlpipe.rewards.answer_checks:exact_match"
VS_TRL = Path(__file__).with_name("vs_trl.py")  # its --run-trl mode runs `run_trl` in a child process

TRL_LABELS = {"trl": "TRL", "trl_same_batch": "TRL same batch", "trl_micro": "TRL same batch, micro-batches"}
MICRO_ROWS = 64  # trl_micro's per_device_train_batch_size: ~800 tokens of the demo, as rlpipe's 1024-token budget


def trl_batches(spec: RunSpec) -> dict[str, tuple[int, int, int]]:
    """TRL's batch structures, (completions per optimizer step, optimizer steps per generation, completions
    per forward pass): `trl` an eighth of rlpipe's iteration per step (the demo: 64 prompts x 8), generating
    every step; `trl_same_batch` rlpipe's (the demo: 4 steps of 1024 per generation of 512 prompts x 8) in one
    pass a step; `trl_micro` the same steps in passes of MICRO_ROWS (gradient accumulation), as rlpipe's
    trainer.micro_batch_tokens cuts them on a CPU."""
    per_iteration = spec.rollout.prompts_per_iteration * spec.rollout.samples_per_prompt
    mini_batches = spec.trainer.mini_batches
    per_step = per_iteration // mini_batches
    return {
        "trl": (per_iteration // 8, 1, per_iteration // 8),
        "trl_same_batch": (per_step, mini_batches, per_step),
        "trl_micro": (per_step, mini_batches, min(MICRO_ROWS, per_step)),
    }


def trl_once(
    system: str,
    seed: int,
    spec: RunSpec,
    run_root: str,
    model_dir: str,
    samples: int,
    work: Path,
    eval_every: int = 1,
    clock_includes_eval: bool = False,
) -> dict:
    """TRL on `samples` completions, evaluated every `eval_every` rlpipe iterations' worth (the demo: 4096).
    A result of the same command in `work` is read back, not re-run."""
    per_step, per_generation, micro = trl_batches(spec)[system]
    per_iteration = spec.rollout.prompts_per_iteration * spec.rollout.samples_per_prompt
    steps, eval_every = samples // per_step, eval_every * per_iteration // per_step
    out = work / f"{system}-seed{seed}.json"
    kept = work / f"{system}-seed{seed}.result.json"
    command = [sys.executable, str(VS_TRL), "--run-trl", "--seed", str(seed), "--run-root", run_root]
    command += ["--model-dir", model_dir, "--trl-steps", str(steps), "--trl-eval-every", str(eval_every)]
    command += ["--trl-per-step", str(per_step), "--trl-steps-per-generation", str(per_generation)]
    command += ["--trl-micro-batch", str(micro)]
    command += ["--trl-generations", str(spec.rollout.samples_per_prompt)]
    command += ["--trl-new-tokens", str(spec.rollout.max_new_tokens), "--trl-lr", str(spec.trainer.lr)]
    command += ["--out", str(out), *(["--clock-includes-eval"] if clock_includes_eval else [])]
    if kept.exists() and (previous := json.loads(kept.read_text())).get("command") == command:
        return previous
    launched = time.time()  # both clocks start when the system's first process starts
    peak = run_measured(command, env={**os.environ, **THREADS_ENV})
    result = json.loads(out.read_text())
    for point in result["curve"][1:]:
        point["wall_s"] = point.pop("at") - launched - point.pop("eval_s")
    result["curve"][0]["wall_s"] = 0.0
    result["train_wall_s"] = result.pop("finished_at") - launched - result.pop("eval_s")
    result["peak_rss_gb"] = peak
    kept.write_text(json.dumps(result | {"command": command}))
    return result


def grpo_config_at(s: dict, out: str, seed: int, max_steps: int) -> GRPOConfig:
    """TRL's GRPOConfig at the hyperparameters `s` (named as benchmarks/vs_trl_smollm2.py's `settings`:
    completions_per_step, lr, kl, clip, ...) for `max_steps` optimizer steps: on the CPU in fp32, GRPO's
    loss with rewards scaled per group, a log line every step, no checkpoints, its output beside `out`."""
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=str(Path(out).parent / "trl-out"),
        use_cpu=True,
        bf16=False,
        report_to="none",
        seed=seed,
        # completions per optimizer step, in passes of s["micro_batch"] (gradient accumulation) when it is smaller
        per_device_train_batch_size=s.get("micro_batch", s["completions_per_step"]),
        gradient_accumulation_steps=s["completions_per_step"] // s.get("micro_batch", s["completions_per_step"]),
        steps_per_generation=s["optimizer_steps_per_generation"]
        * (s["completions_per_step"] // s.get("micro_batch", s["completions_per_step"])),
        num_generations=s["samples_per_prompt"],
        learning_rate=s["lr"],
        lr_scheduler_type="constant_with_warmup",
        warmup_steps=s["warmup_steps"],
        max_grad_norm=s["max_grad_norm"],
        gradient_checkpointing=s["gradient_checkpointing"],
        beta=s["kl"],
        epsilon=s["clip"],
        loss_type="grpo",
        scale_rewards="group",
        max_completion_length=s["max_new_tokens"],
        temperature=s["temperature"],
        top_k=s["top_k"],
        max_steps=max_steps,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
    )


def grpo_config(args: argparse.Namespace) -> GRPOConfig:
    """TRL's settings: rlpipe's demo hyperparameters at the batch structure vs_trl.py asked for."""
    hyperparameters = {
        "completions_per_step": args.trl_per_step,
        "micro_batch": args.trl_micro_batch or args.trl_per_step,
        "optimizer_steps_per_generation": args.trl_steps_per_generation,
        "samples_per_prompt": args.trl_generations,
        "lr": args.trl_lr,
        "warmup_steps": 10,
        "max_grad_norm": 1.0,
        "gradient_checkpointing": False,  # as rlpipe's demo (TRL's default is on: ~20% slower, less memory)
        "kl": 0.0,
        "clip": 0.2,
        "max_new_tokens": args.trl_new_tokens,
        "temperature": 1.0,
        "top_k": 0,
    }
    return grpo_config_at(hyperparameters, args.out, args.seed, args.trl_steps)


def run_trl(args: argparse.Namespace) -> None:
    """Child process: TRL GRPOTrainer on the reference model; writes its results as JSON to args.out."""
    import pyarrow.parquet as pq
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOTrainer

    from rlpipe.evaluation.accuracy import greedy_samples
    from rlpipe.models.loading import load_tokenizer
    from rlpipe.rewards.answer_checks import exact_match

    torch.set_num_threads(1)
    run_root, model_dir = args.run_root, args.model_dir
    per_step = args.trl_per_step
    train = pq.read_table(f"{run_root}/data/train.parquet").to_pylist()
    held_out = pq.read_table(f"{run_root}/data/eval.parquet").to_pylist()
    tokenizer = load_tokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)

    def reward(prompts, completions, reference, **_):
        return exact_match(prompts, completions, reference)

    def greedy_accuracy(model, tokenizer) -> float:
        _, scores = greedy_samples(model, tokenizer, held_out, VERIFIER, args.trl_new_tokens, 4096)
        return sum(scores) / len(scores)

    curve: list[dict] = []

    class HeldOut(TrainerCallback):
        eval_s = 0.0

        def on_step_end(self, _args, state, control, **kwargs):
            if state.global_step % args.trl_eval_every and state.global_step < args.trl_steps:
                return
            t = time.time()
            accuracy = greedy_accuracy(kwargs["model"], tokenizer)
            HeldOut.eval_s += 0.0 if args.clock_includes_eval else time.time() - t
            curve.append(
                {"samples": state.global_step * per_step, "at": time.time(), "eval_s": HeldOut.eval_s, "acc": accuracy}
            )

    trainer = GRPOTrainer(
        model=model,
        processing_class=tokenizer,
        reward_funcs=reward,
        args=grpo_config(args),
        train_dataset=Dataset.from_list([{"prompt": r["prompt"], "reference": r["reference"]} for r in train]),
        callbacks=[HeldOut()],
    )
    t = time.time()
    accuracy = greedy_accuracy(model, tokenizer)
    curve.append({"samples": 0, "acc": accuracy})
    HeldOut.eval_s = 0.0 if args.clock_includes_eval else time.time() - t
    trainer.train()
    finished = time.time()
    lengths = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
    completion_tokens = statistics.fmean(lengths) * per_step * args.trl_steps if lengths else 0.0
    prompt_tokens = [len(row["prompt_token_ids"]) for row in train]  # as vs_trl.prompt_tokens_mean
    result = {
        "curve": curve,
        "finished_at": finished,
        "eval_s": HeldOut.eval_s,
        "samples": per_step * args.trl_steps,
        "completion_tokens": completion_tokens,
        "prompt_tokens": sum(prompt_tokens) / len(prompt_tokens) * per_step * args.trl_steps,
    }
    Path(args.out).write_text(json.dumps(result))
