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


def grpo_config(args: argparse.Namespace) -> GRPOConfig:
    """TRL's settings: rlpipe's demo hyperparameters at the batch structure vs_trl.py asked for."""
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=str(Path(args.out).parent / "trl-out"),
        use_cpu=True,
        bf16=False,
        report_to="none",
        seed=args.seed,
        per_device_train_batch_size=args.trl_per_step,  # completions per optimizer step
        steps_per_generation=args.trl_steps_per_generation,
        num_generations=args.trl_generations,
        learning_rate=args.trl_lr,
        lr_scheduler_type="constant_with_warmup",
        warmup_steps=10,
        max_grad_norm=1.0,
        gradient_checkpointing=False,  # as rlpipe's demo (TRL's default is on: ~20% slower, less memory)
        beta=0.0,
        epsilon=0.2,
        loss_type="grpo",
        scale_rewards="group",
        max_completion_length=args.trl_new_tokens,
        temperature=1.0,
        top_k=0,
        max_steps=args.trl_steps,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
    )


def run_trl(args: argparse.Namespace) -> None:
    """Child process: TRL GRPOTrainer on the reference model; writes its results as JSON to args.out."""
    import pyarrow.parquet as pq
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOTrainer

    from rlpipe.evaluation import greedy_accuracy
    from rlpipe.modeling import load_tokenizer
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

    curve: list[dict] = []

    class HeldOut(TrainerCallback):
        eval_s = 0.0

        def on_step_end(self, _args, state, control, **kwargs):
            if state.global_step % args.trl_eval_every and state.global_step < args.trl_steps:
                return
            t = time.time()
            accuracy = greedy_accuracy(kwargs["model"], tokenizer, held_out, VERIFIER, args.trl_new_tokens, 4096)
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
    accuracy = greedy_accuracy(model, tokenizer, held_out, VERIFIER, args.trl_new_tokens, 4096)
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
