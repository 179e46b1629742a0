"""The machine a benchmark figure came from: `lscpu`'s model name (family/model when the name is
generic, as in VMs), SIMD level and cores, or the GPU; and what it sustains (`measure_peaks`), against
which a step's time has a floor: the FLOPs its work needs at the matmul rate, the bytes at the bandwidth.
`run_measured` runs a system under test and returns the peak memory it took; `how_steps_ran` says how an
`rlpipe run`'s KFP tasks started (forks of its warm step server, or fresh, and why): the path measured."""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rlpipe.spec import RunSpec

THREADS_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
# Runs a command and prints the peak RSS (KB) of the largest process in its tree: a fresh parent,
# so one system's peak never leaks into the other's.
PEAK_RSS = (
    "import resource, subprocess, sys\n"
    "code = subprocess.run(sys.argv[1:]).returncode\n"
    "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr)\n"
    "sys.exit(code)\n"
)


def run_measured(command: list[str], **kwargs) -> float:
    """Run `command` to completion; returns the peak RSS (GB) of its largest process."""
    wrapped = [sys.executable, "-c", PEAK_RSS, *command]
    result = subprocess.run(wrapped, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, **kwargs)
    if result.returncode:
        raise SystemExit(f"{' '.join(command[:4])} ... failed:\n{result.stderr[-3000:]}")
    return int(result.stderr.strip().splitlines()[-1]) / 1e6


def how_steps_ran(run_dir: Path) -> str:
    """How the KFP tasks of the `rlpipe run` in `run_dir` started (summary.json's steps, written by its last
    invocation): "forks (N of N tasks)", or how many were not forked and why; "fresh (--fresh-steps)"."""
    import json

    steps = json.loads((Path(run_dir) / "summary.json").read_text()).get("steps")
    if steps is None:
        return "unknown (a summary.json from before rlpipe recorded it)"
    total = steps["forked"] + steps["fresh"]
    if steps.get("fresh_steps"):
        return "fresh (--fresh-steps)"
    if steps["fresh"] == 0:
        return f"forks ({total} of {total} tasks)"
    return f"{steps['fresh']} of {total} tasks not forked: " + "; ".join(steps["why"])


def describe_machine() -> str:
    """e.g. 'AMD EPYC (family 25 model 17, AVX-512), 2 cores, x86_64, Python 3.11.7'."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""

    def field(name: str) -> str:
        found = re.search(rf"^{name}\s*:\s*(.*)$", info, flags=re.MULTILINE)
        return found.group(1).strip() if found else ""

    flags = field("flags").split()
    simd = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    cpu = (
        f"{field('model name') or platform.processor() or 'unknown CPU'} (family {field('cpu family')} model "
        f"{field('model')}, {simd})"
    )
    gpu = ""
    try:
        import torch

        if torch.cuda.is_available():
            gpu = f", GPU {torch.cuda.get_device_name(0)}"
    except ImportError:
        pass
    return f"{cpu}, {os.cpu_count()} cores{gpu}, {platform.machine()}, Python {platform.python_version()}"


@dataclass(frozen=True)
class Peaks:
    """What this machine sustains, measured: fp32 matmul FLOP/s and memory bandwidth (bytes/s), at
    `threads` torch threads (the threads the benchmark computes with)."""

    matmul_flops: float
    bandwidth: float
    threads: int

    def line(self) -> str:
        return (
            f"measured peaks at {self.threads} torch thread(s): fp32 matmul {self.matmul_flops / 1e9:.0f} GFLOP/s, "
            f"memory bandwidth {self.bandwidth / 1e9:.1f} GB/s"
        )


def measure_peaks(threads: int, seconds: float = 1.0) -> Peaks:
    """The best of repeated runs, each ~`seconds` / 8: a 1024^3 fp32 matmul (2 n^3 FLOPs), and a copy
    of 256 MiB (read once, written once: 2 x 256 MiB moved, far past any cache)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        n = 1024
        a, b = torch.randn(n, n), torch.randn(n, n)
        matmul = _best_rate(lambda: torch.mm(a, b), 2 * n**3, seconds / 2)
        source = torch.empty(64 * 2**20, dtype=torch.float32).fill_(1.0)
        target = torch.empty_like(source)
        bandwidth = _best_rate(lambda: target.copy_(source), 2 * source.numel() * 4, seconds / 2)
    finally:
        torch.set_num_threads(before)
    return Peaks(matmul, bandwidth, threads)


def _best_rate(work, units: float, seconds: float) -> float:
    work()  # warm: allocation, first-touch pages, the kernel's dispatch
    best = float("inf")
    deadline = time.perf_counter() + seconds
    while True:
        started = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - started)
        if time.perf_counter() > deadline:
            return units / best


@dataclass(frozen=True)
class ModelShape:
    """What a transformer's FLOPs and bytes depend on (from its config)."""

    parameters: int  # every weight the forward reads (the LM head once, tied or not)
    layers: int
    hidden: int

    @classmethod
    def of(cls, config) -> ModelShape:
        """From a transformers config (Qwen2, Llama, ...)."""
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        d, ff, layers, vocab = config.hidden_size, config.intermediate_size, config.num_hidden_layers, config.vocab_size
        attention = d * heads * head_dim * 2 + d * kv_heads * head_dim * 2  # q, o; k, v
        per_layer = attention + 3 * d * ff  # gated MLP: gate, up, down
        return cls(layers * per_layer + vocab * d, layers, d)


def forward_flops(shape: ModelShape, tokens: float, context: float) -> float:
    """2 N per token (each weight multiplies and adds once) plus attention's scores and mixing,
    4 x layers x hidden x context per token (Kaplan et al. 2020, C_forward)."""
    return tokens * (2 * shape.parameters + 4 * shape.layers * shape.hidden * context)


def update_floor_s(shape: ModelShape, tokens: float, context: float, peaks: Peaks, lora: bool = False) -> float:
    """A forward and a backward over `tokens` trained tokens, at the matmul peak: the backward is 2x the
    forward (activations' and weights' gradients), 1x with LoRA (a frozen weight needs no gradient)."""
    return (2 if lora else 3) * forward_flops(shape, tokens, context) / peaks.matmul_flops


def generate_floor_s(
    shape: ModelShape, prompt_tokens: float, completion_tokens: float, context: float, decode_steps: float, peaks: Peaks
) -> float:
    """Prefill of every prompt token and one forward per completion token (attending `context` tokens on
    average) at the matmul peak; but a decode step cannot beat reading the weights once (fp32) at the
    measured bandwidth."""
    compute = forward_flops(shape, prompt_tokens + completion_tokens, context) / peaks.matmul_flops
    weights = decode_steps * shape.parameters * 4 / peaks.bandwidth
    return max(compute, weights)


def step_floors(spec: RunSpec, model_dir: str, per_iteration: dict[str, float], threads: int) -> dict:
    """An iteration's generate and update, measured (`per_iteration`: prompt_tokens and completion_tokens of
    its rows, generate_s, update_s), beside their floors at the peaks measured here with `threads` threads."""
    from transformers import AutoConfig

    peaks = measure_peaks(threads)
    shape = ModelShape.of(AutoConfig.from_pretrained(model_dir))
    rows = spec.rollout.prompts_per_iteration * spec.rollout.samples_per_prompt
    prompt, completion = per_iteration["prompt_tokens"], per_iteration["completion_tokens"]
    decode_steps = -(-rows // spec.rollout.batch_size) * spec.rollout.max_new_tokens  # batches x the longest
    lora, samples, row = spec.model.lora is not None, spec.rollout.samples_per_prompt, (prompt + completion) / rows
    return {
        "peaks": {
            "matmul_gflops": peaks.matmul_flops / 1e9,
            "bandwidth_gbs": peaks.bandwidth / 1e9,
            "threads": threads,
        },
        "peaks_line": peaks.line(),
        "parameters": shape.parameters,
        "tokens": {"prompt": prompt, "completion": completion},
        "measured_s": {"generate": per_iteration["generate_s"], "update": per_iteration["update_s"]},
        "floor_s": {  # each prompt is prefilled once for its samples_per_prompt completions
            "generate": generate_floor_s(shape, prompt / samples, completion, row, decode_steps, peaks),
            "update": update_floor_s(shape, prompt + completion, row, peaks, lora),
        },
    }


def floor_lines(floor: dict) -> list[str]:
    """`step_floors` as a table: each step's seconds an iteration, its floor and the ratio."""
    tokens = floor["tokens"]
    lines = [
        "",
        f"rlpipe per iteration against the machine's floor ({floor['peaks_line']}; model "
        f"{floor['parameters'] / 1e6:.2f}M parameters; {tokens['prompt']:.0f} prompt + {tokens['completion']:.0f} "
        "completion tokens an iteration):",
        "",
        "| step | measured (s) | floor (s) | measured / floor |",
        "|---|---|---|---|",
    ]
    for step, measured in floor["measured_s"].items():
        lines.append(
            f"| {step} | {measured:.2f} | {floor['floor_s'][step]:.3f} | {measured / floor['floor_s'][step]:.1f}x |"
        )
    return lines
