"""Training and sampling speed and memory of rlpipe's torch code on one device, at real model sizes.

    python benchmarks/gpu.py                               # a GPU: Qwen2.5-0.5B and 1.5B shapes, bf16
    python benchmarks/gpu.py --device cpu --shapes small   # anywhere: a small shape on the CPU
    python benchmarks/gpu.py --smoke                       # the CPU path at tiny batches: seconds

    python benchmarks/gpu.py --shapes smollm2-135m --rows-per-step 32 --prompt-tokens 58 \
        --completion-tokens 32 --gen-rows 64 --new-tokens 32 --tag cuda_smollm2  # the real-model example's batch

Models are random-init configs of the real sizes (Qwen2.5: vocab 151,936; SmolLM2-135M, the real-model
example's LlamaForCausalLM: vocab 49,152); the batch is synthetic
(prompt and completion tokens, advantages, sampling log-probs). Per shape, through rlpipe's own
functions (rlpipe.training.trainer.train_on_batch, rlpipe.engines.torch_engine.hf_decode):
  - update: tokens/s over `--steps` optimizer steps (micro-batches of `--micro-batch-tokens`,
    gradient checkpointing, trainer.dtype), model FLOPs utilisation
        MFU = (6 P + 12 L h T) tokens/s / peak FLOP/s      (P parameters, L layers, h hidden, T tokens
    per sequence; the recomputation of checkpointing is not counted, as is the convention)
    and, with LoRA (rank `--lora-rank` on every linear of the layers; frozen weights need no weight
    gradients, so 2 P of the 6 P are not done)
        MFU = (4 P + 12 L h T) tokens/s / peak FLOP/s,
    and peak memory (weights, gradients, AdamW state, activations);
  - generation: the torch engine's decode (rlpipe.engines.decode: each step a CUDA graph on a GPU)
    tokens/s, `--gen-rows` rows of `--new-tokens`, and beside it on a GPU the same decode with eager
    steps (LoRA samples merged, so its generation is the full model's: measured once per shape);
  - the iteration's compute: generate + update wall;
  - sharing the device (full only, after the generation; benchmarks/gpu_offload.py): the trainer's offload between
    its turns (rlpipe.training.offload, as the trainer server runs it for sharing.enabled) on the state the update
    left (weights, gradients, AdamW state), with and without the weights: offload and onload seconds and bytes;
    beside a sampler's copy of the weights on the same device, the trainer resident, offloaded, and offloaded with
    the weights: on a GPU the device memory held before the decode of `--gen-rows` rows and its peak during it,
    and the largest batch of `--new-tokens` rows that fits (doubling, then bisection, catching OOM; at most
    `--fit-max-rows`). On a CPU nothing moves (the device is the host): the bytes are those that would move.
Writes benchmarks/results/gpu_<device>.{json,md} (--smoke: under runs/smoke/ unless --results-dir
says). A whole iteration through the step functions, with weight sync, is benchmarks/iteration_at_scale.py.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from gpu_offload import measure_offload, offload_table  # benchmarks/ is on sys.path when run as a script
from machine import describe_machine

if TYPE_CHECKING:
    from transformers import PretrainedConfig

RESULTS = Path(__file__).with_name("results")
SMOKE_ROOT = Path(__file__).resolve().parents[1] / "runs" / "smoke"
SHAPES = {  # hidden, intermediate, layers, heads, kv heads, vocab, family
    "qwen2.5-0.5b": (896, 4864, 24, 14, 2, 151936, "qwen2"),
    "qwen2.5-1.5b": (1536, 8960, 28, 12, 2, 151936, "qwen2"),
    "smollm2-135m": (576, 1536, 30, 9, 3, 49152, "llama"),  # examples/smollm2 (rope theta 1e5, as its config)
    "small": (256, 1024, 4, 4, 2, 32000, "qwen2"),
}
PEAK_BF16_TFLOPS = {"H100 PCIe": 756.0, "H100": 989.4, "H200": 989.4, "A100": 312.0}  # dense, no sparsity


def peak_tflops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((tflops for key, tflops in PEAK_BF16_TFLOPS.items() if all(w in name for w in key.split())), None)


def model_config(shape: str, **token_ids: int | None) -> PretrainedConfig:
    """The config of `shape` (SHAPES: a Qwen2 or a Llama): tied embeddings, 4096 positions; `token_ids`
    (pad_token_id, ...) as given. benchmarks/iteration_at_scale.py builds its models with it too."""
    from transformers import LlamaConfig, Qwen2Config

    hidden, intermediate, layers, heads, kv_heads, vocab, family = SHAPES[shape]
    if family == "llama":
        token_ids = {"rope_parameters": {"rope_type": "default", "rope_theta": 100000.0}, **token_ids}
    return (LlamaConfig if family == "llama" else Qwen2Config)(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        **token_ids,
    )


def build(shape: str, device: torch.device):
    from transformers import AutoModelForCausalLM

    from rlpipe.models.loading import build_char_tokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(model_config(shape)).to(device)
    return model, build_char_tokenizer()  # token ids above the tokenizer's decode to nothing


def batch_file(folder: Path, rows: int, prompt: int, completion: int, vocab: int) -> str:
    rng = random.Random(0)
    table = [
        {
            "prompt_token_ids": [rng.randrange(vocab) for _ in range(prompt)],
            "completion_token_ids": [rng.randrange(vocab) for _ in range(completion)],
            "logprobs": [-rng.uniform(5, 12) for _ in range(completion)],
            "advantage": rng.uniform(-1, 1),
        }
        for _ in range(rows)
    ]
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = folder / "batch.parquet"
    pq.write_table(pa.Table.from_pylist(table), path)
    return str(path)


def peak_memory_gib(device: torch.device, rss_before: int) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1024**3
    high_water = int(Path("/proc/self/status").read_text().split("VmHWM:")[1].split()[0]) * 1024
    return (high_water - rss_before) / 1024**3


def timed_decode(model: torch.nn.Module, prompts: list[list[int]], args: argparse.Namespace, static: bool | None):
    """(seconds, tokens) of the torch engine's decode (rlpipe.engines.decode) of `prompts`, no end id: every
    row generates args.new_tokens; `static` None as the engine runs (a CUDA graph on a GPU)."""
    from rlpipe.engines import Sampling
    from rlpipe.engines.decode import decode, decoder_of, next_tokens

    device = next(model.parameters()).device
    decoder = decoder_of(model, args.prompt_tokens + args.new_tokens, set(), pad_id=0)
    sampling = Sampling(1, args.new_tokens, batch_size=len(prompts), bf16=args.dtype == "bfloat16")
    generator = torch.Generator(device=device).manual_seed(0)
    decode(decoder, prompts[:2], replace(sampling, max_new_tokens=2), lambda z: next_tokens(z, generator=generator))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.time()
    out = decode(decoder, prompts, sampling, lambda z: next_tokens(z, generator=generator), static=static)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.time() - started, sum(map(len, out.token_ids))


def measure_generation(
    model: torch.nn.Module, args: argparse.Namespace, device: torch.device, vocab: int, update_s: float
) -> dict:
    """Torch-engine generation speed of `model` (on a GPU also with eager steps, no CUDA graph: side by
    side), and the iteration's compute with the update's `update_s`."""
    model.eval()
    prompts = [[random.Random(i).randrange(vocab) for _ in range(args.prompt_tokens)] for i in range(args.gen_rows)]
    generate_s, generated = timed_decode(model, prompts, args, static=None)
    result = {
        "generate_tokens_per_s": round(generated / generate_s, 1),
        "generate_s": round(generate_s, 3),
        "iteration_compute_s": round(update_s + generate_s, 3),
    }
    if device.type == "cuda":
        eager_s, eager_generated = timed_decode(model, prompts, args, static=False)
        result["eager_generate_tokens_per_s"] = round(eager_generated / eager_s, 1)
    return result


def measure(shape: str, lora: bool, args: argparse.Namespace, device: torch.device, work: Path) -> dict:
    """One shape and mode: the update's speed, MFU and peak memory, then (full only) generation."""
    from rlpipe.models.loading import add_lora
    from rlpipe.spec import LoraSpec, parse_spec
    from rlpipe.training.trainer import Trainer, train_on_batch

    if device.type == "cpu":
        Path("/proc/self/clear_refs").write_text("5")  # peak RSS (VmHWM) back to the current RSS
    rss_before = int(Path("/proc/self/status").read_text().split("VmRSS:")[1].split()[0]) * 1024
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    model, tokenizer = build(shape, device)
    parameters = sum(p.numel() for p in model.parameters())
    hidden, _, layers, _, _, vocab, _ = SHAPES[shape]
    rows = args.steps * args.rows_per_step
    spec = parse_spec(
        {
            "name": "gpu-bench",
            "trainer": {
                "mini_batches": args.steps,
                "warmup_steps": 0,
                "dtype": args.dtype,
                "micro_batch_tokens": args.micro_batch_tokens,
                "gradient_checkpointing": True,
                "device": device.type,
            },
            "algorithm": {"track_reference_kl": False},
        }
    )
    if lora:
        model = add_lora(model, LoraSpec(rank=args.lora_rank, alpha=2.0 * args.lora_rank))
    model.train().gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    trained = [p for p in model.parameters() if p.requires_grad]
    trainer = Trainer(spec, str(work), {"version": 0}, model, tokenizer, torch.optim.AdamW(trained), None)
    batch = batch_file(work, rows, args.prompt_tokens, args.completion_tokens, vocab)
    train_on_batch(trainer, batch, 1)  # warm-up: kernels, allocator, optimizer state
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.time()
    metrics = train_on_batch(trainer, batch, 2)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    update_s = time.time() - started
    tokens = rows * (args.prompt_tokens + args.completion_tokens)
    tokens_per_s = tokens / update_s
    seq = args.prompt_tokens + args.completion_tokens
    flops_per_token = (4 if lora else 6) * parameters + 12 * layers * hidden * seq
    achieved = flops_per_token * tokens_per_s / 1e12
    peak = peak_tflops(device)
    update_memory = peak_memory_gib(device, rss_before)
    result = {
        "shape": shape,
        "mode": "lora" if lora else "full",
        "parameters": parameters,
        "trained_parameters": sum(p.numel() for p in trained),
        "update_tokens": tokens,
        "update_s": round(update_s, 3),
        "update_tokens_per_s": round(tokens_per_s, 1),
        "update_tflops": round(achieved, 3),
        "mfu": None if peak is None else round(achieved / peak, 4),
        "micro_batches": metrics["policy/micro_batches"],
        "peak_memory_gib": round(update_memory, 2),
    }
    if lora:  # LoRA samples merged: its generation is the full model's
        return result
    result |= measure_generation(model, args, device, vocab, update_s)
    return result | {"offload": measure_offload(trainer, args, device)}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    parser.add_argument("--shapes", nargs="+", default=None, choices=list(SHAPES))
    parser.add_argument("--modes", nargs="+", default=["full", "lora"], choices=["full", "lora"])
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--dtype", default=None, choices=["bfloat16", "float32"])
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps timed")
    parser.add_argument("--rows-per-step", type=int, default=None)
    parser.add_argument("--prompt-tokens", type=int, default=None)
    parser.add_argument("--completion-tokens", type=int, default=None)
    parser.add_argument("--micro-batch-tokens", type=int, default=None)
    parser.add_argument("--gen-rows", type=int, default=None)
    parser.add_argument("--new-tokens", type=int, default=None)
    parser.add_argument("--fit-max-rows", type=int, default=8192, help="a GPU: the largest batch searched (0: none)")
    parser.add_argument("--smoke", action="store_true", help="the CPU path at tiny batches (any --device): seconds")
    parser.add_argument("--results-dir", type=Path, help="default benchmarks/results (--smoke: runs/smoke)")
    parser.add_argument("--tag", default=None, help="results file suffix (default: the device)")
    return parser.parse_args()


def command_arguments() -> str:
    """This command's arguments as a user would type them: --results-dir (where the files went) left out."""
    argv = sys.argv[1:]
    if "--results-dir" in argv:
        at = argv.index("--results-dir")
        argv = argv[:at] + argv[at + 2 :]
    return " ".join(argv)


def markdown_lines(args: argparse.Namespace, results: list[dict], machine: str, settings: dict) -> list[str]:
    """The results as the command line, the machine and a markdown table."""
    lines = [
        f"`python benchmarks/gpu.py {command_arguments()}` on {machine}; torch {torch.__version__}; {settings}",
        "",
        "| shape | mode | parameters trained | update tokens/s | TFLOP/s | MFU | peak memory "
        "| generation tokens/s | eager steps (no graph) | generate + update |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        mfu = "n/a (CPU)" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        cells = [
            r["shape"],
            r["mode"],
            f"{r['trained_parameters'] / 1e6:.1f}M of {r['parameters'] / 1e6:.0f}M",
            f"{r['update_tokens_per_s']:.0f}",
            f"{r['update_tflops']:.2f}",
            mfu,
            f"{r['peak_memory_gib']:.2f} GiB",
            f"{r['generate_tokens_per_s']:.0f}" if "generate_s" in r else "(as full)",
            f"{r['eager_generate_tokens_per_s']:.0f}" if "eager_generate_tokens_per_s" in r else "",
            f"{r['iteration_compute_s']:.1f} s" if "generate_s" in r else "",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines + offload_table(results, args.fit_max_rows)


# a GPU: RL-sized batches; a CPU: small enough for minutes
GPU_DEFAULTS = dict(
    shapes=["qwen2.5-0.5b", "qwen2.5-1.5b"], dtype="bfloat16", rows_per_step=64, prompt_tokens=256,
    completion_tokens=256, micro_batch_tokens=16384, gen_rows=256, new_tokens=128,
)  # fmt: skip
CPU_DEFAULTS = dict(
    shapes=["small"], dtype="float32", rows_per_step=8, prompt_tokens=32,
    completion_tokens=32, micro_batch_tokens=256, gen_rows=16, new_tokens=16,
)  # fmt: skip


def main() -> None:
    args = parse_args()
    results_dir = args.results_dir or (SMOKE_ROOT if args.smoke else RESULTS)

    from rlpipe.models.devices import resolve_device
    from rlpipe.models.loading import configure_torch

    device = resolve_device("cpu" if args.smoke else args.device)
    gpu = device.type == "cuda"
    defaults = dict(GPU_DEFAULTS if gpu else CPU_DEFAULTS)
    if args.smoke:
        defaults |= {"rows_per_step": 4, "prompt_tokens": 16, "completion_tokens": 16, "gen_rows": 4, "new_tokens": 4}
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if not gpu:
        configure_torch(1)
    results = []
    for shape in args.shapes:
        for mode in args.modes:
            with tempfile.TemporaryDirectory(prefix="rlpipe-bench-gpu-") as tmp:
                result = measure(shape, mode == "lora", args, device, Path(tmp))
            print(json.dumps(result), flush=True)
            results.append(result)
            if gpu:
                torch.cuda.empty_cache()
    machine = describe_machine()
    settings = {k: getattr(args, k) for k in [*defaults, "lora_rank", "fit_max_rows"]}
    lines = markdown_lines(args, results, machine, settings)
    print("\n".join(lines))
    results_dir.mkdir(parents=True, exist_ok=True)
    tag = args.tag or device.type
    (results_dir / f"gpu_{tag}.md").write_text("\n".join(lines) + "\n")
    record = {
        "machine": machine,
        "torch": torch.__version__,
        "smoke": args.smoke,
        "settings": settings,
        "results": results,
    }
    (results_dir / f"gpu_{tag}.json").write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
