"""TRL's side of benchmarks/vs_trl.py: GRPOTrainer on the reference model, run in the child process
that `vs_trl.py --run-trl` starts (not a benchmark on its own). Writes its curve and counts as JSON."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trl import GRPOConfig

VERIFIER = "rlpipe.rewards.verifiers:exact_match"


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
        per_device_train_batch_size=s["completions_per_step"],  # completions per optimizer step
        steps_per_generation=s["optimizer_steps_per_generation"],
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
    from rlpipe.rewards.verifiers import exact_match

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
