"""`rlpipe check` and `rlpipe estimate-memory`: what a spec would meet, before it runs."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rlpipe.pipelines.commands.arguments import spec_from_args


def cmd_check(args: argparse.Namespace) -> int:
    from rlpipe.preflight import PreflightError, preflight
    from rlpipe.store.run_root import run_root_for

    spec = spec_from_args(args)
    run_root = str(Path(args.run_dir).resolve()) if args.run_dir else run_root_for(spec.storage.root, spec.name)
    print(f"rlpipe check {args.spec}: run root {run_root}")
    try:
        preflight(spec, run_root, say=print)
    except PreflightError as err:
        print(f"{str(err).count(chr(10) + '  - ')} check(s) failed: fix the keys named above", file=sys.stderr)
        return 1
    print("all checks passed: `rlpipe run` would start")
    return 0


def cmd_estimate_memory(args: argparse.Namespace) -> int:
    from rlpipe.training.memory_estimate import estimate_memory, model_shape

    spec = spec_from_args(args)
    shape = model_shape(spec, spec.cache_root)
    seq_len = args.seq_len or (spec.data.max_prompt_tokens or 512) + spec.rollout.max_new_tokens
    gpus = args.gpus or spec.trainer.gpus * spec.trainer.nodes
    estimate = estimate_memory(spec, shape, seq_len, gpus, args.gpu_memory_gib)
    print(
        f"rlpipe estimate-memory {args.spec}: {shape.parameters / 1e9:.3f}B parameters ({shape.layers} layers, hidden "
        f"{shape.hidden}, vocab {shape.vocab}), sequences of {seq_len} tokens, {gpus} GPU(s), "
        f"trainer.dtype {spec.trainer.dtype}"
    )
    print(estimate.table())
    if not estimate.advice:
        print("fits (estimate within 90% of the GPU)")
        return 0
    print("does not fit; change, in this order:")
    for line in estimate.advice:
        print(f"  - {line}")
    return 1


def add_commands(sub: argparse._SubParsersAction) -> None:
    """check and estimate-memory: a spec before it runs."""
    check = sub.add_parser("check", help="pre-flight: check the spec, model, data, rewards, tracking and storage")
    check.add_argument("spec")
    check.add_argument("--run-dir", help="run root (default <storage.root>/<name>)")
    check.add_argument("--set", action="append", metavar="KEY=VALUE")
    check.set_defaults(func=cmd_check)

    memory = sub.add_parser(
        "estimate-memory", help="estimate per-GPU training memory for the spec and say what to change"
    )
    memory.add_argument("spec")
    memory.add_argument(
        "--gpus", type=int, help="GPUs the trainer shards over (FSDP; default: trainer.gpus x trainer.nodes)"
    )
    memory.add_argument("--gpu-memory-gib", type=float, default=80.0, help="memory of one GPU (H100: 80)")
    memory.add_argument(
        "--seq-len",
        type=int,
        help="prompt + completion tokens (default: data.max_prompt_tokens or 512, plus rollout.max_new_tokens)",
    )
    memory.add_argument("--set", action="append", metavar="KEY=VALUE")
    memory.set_defaults(func=cmd_estimate_memory)
