"""benchmarks/gpu.py's second table: the resident trainer's offload between its turns on a shared device
(rlpipe.training.offload, the code the trainer server runs for sharing.enabled), on the trainer's real state (the
model and AdamW state after gpu.py's update) beside a sampler's copy of the weights on the same device
(the dtype it serves: bf16 when the trainer's is).

Per trainer state: resident (weights, gradients, AdamW state), offloaded (AdamW state to host memory, gradients
dropped), offloaded with the weights (sharing.offload_weights):
  - offload and onload: seconds and bytes, through rlpipe.training.offload's offload and onload;
  - on a GPU: the device memory held before the sampler's decode of `--gen-rows` rows and its peak during it
    (torch.cuda.max_memory_allocated), and the largest batch of `--new-tokens` rows that fits: doubling from
    --gen-rows, then bisection to 1/32, at most FIT_TRIES decodes (their first two tokens, eager steps: `fits`),
    each catching torch.cuda.OutOfMemoryError; a state that holds less is searched first, and bounds the next (it
    cannot fit more; its search doubles from half that bound).
On a CPU the device is the host: nothing moves, the bytes are those that would move on a GPU, and there is no
device memory to measure or limit.
"""

from __future__ import annotations

import argparse
import copy
import gc
import time
from typing import Any, Callable

import torch

FIT_TRIES = 12
STATES = {  # key: the trainer's state on the device, as the table names it
    "resident": "resident: weights, gradients, AdamW state",
    "offloaded": "offloaded: AdamW state to host, gradients dropped",
    "offloaded_weights": "offloaded with the weights (offload_weights)",
}
CPU_NOTE = (
    "On a CPU nothing moves: the device is the host (Tensor.to('cpu') returns the tensor itself), so the bytes are "
    "those that would move on a GPU, and generation memory is n/a: no device memory limit on a CPU."
)


def largest_fit(fits: Callable[[int], bool], start: int, cap: int, tries: int = FIT_TRIES) -> tuple[int, int]:
    """(the largest rows <= cap for which `fits`, the calls made), for a `fits` monotone in rows: doubling from
    `start` while it fits, then bisection, until within 1/32 of the answer or `tries` calls (0: nothing fits)."""
    fit, fail, calls = 0, cap + 1, 0
    rows = max(1, min(start, cap))
    while calls < tries and fail - fit > max(1, fit // 32):
        calls += 1
        if fits(rows):
            fit = rows
        else:
            fail = rows
        rows = min(2 * fit, cap) if fail > cap else (fit + fail) // 2
    return fit, calls


def out_of_memory(error: BaseException | None) -> bool:
    """An OOM, or an error raised while handling one."""
    while error is not None:
        if isinstance(error, torch.cuda.OutOfMemoryError) or "out of memory" in str(error).lower():
            return True
        error = error.__context__
    return False


def free_cached(device: torch.device) -> None:
    gc.collect()  # a failed try's frames (its cache, its graph) go with its exception
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def decode_rows(
    sampler: torch.nn.Module, rows: int, args: argparse.Namespace, tokens: int | None = None, static: bool | None = None
) -> int:
    """The torch engine's decode of `rows` random prompts, as gpu.py's timed_decode runs it (rlpipe.engines.decode;
    static None: a CUDA graph on a GPU; a cache for args.new_tokens); the tokens generated. `tokens` given: every
    row ends there."""
    from rlpipe.engines import Sampling
    from rlpipe.engines.decode import decode, decoder_of, next_tokens

    device = next(sampler.parameters()).device
    end = sampler.config.vocab_size - 1
    decoder = decoder_of(sampler, args.prompt_tokens + args.new_tokens, set() if tokens is None else {end}, pad_id=0)
    generator = torch.Generator(device=device).manual_seed(0)
    picks = 0

    def pick(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        nonlocal picks
        picks += 1
        token, logprob = next_tokens(logits, generator=generator)
        return (token if tokens is None or picks < tokens else torch.full_like(token, end)), logprob

    prompts = torch.randint(end, (rows, args.prompt_tokens), generator=torch.Generator().manual_seed(rows)).tolist()
    sampling = Sampling(1, args.new_tokens, batch_size=rows, bf16=args.dtype == "bfloat16")
    return sum(map(len, decode(decoder, prompts, sampling, pick, static=static).token_ids))


def fits(sampler: torch.nn.Module, rows: int, args: argparse.Namespace) -> bool:
    """Whether a decode of `rows` rows fits in the device memory left (a GPU). Its first two tokens: the high-water
    mark is the prefill's, over the whole cache (args.new_tokens), and every later step is far smaller. Eager steps:
    an OOM inside a CUDA graph's capture can leave torch's allocator unusable (torch < 2.12), and a graph would
    add only one step's buffers."""
    device = next(sampler.parameters()).device
    try:
        decode_rows(sampler, rows, args, tokens=2, static=False)
        fit = True
    except RuntimeError as error:  # torch.cuda.OutOfMemoryError is one
        if not out_of_memory(error):
            raise
        fit = False
    free_cached(device)
    return fit


def generation_memory(
    sampler: torch.nn.Module, args: argparse.Namespace, device: torch.device, start: int, cap: int
) -> dict:
    """In the trainer's current state: the device memory held before the sampler's decode of args.gen_rows rows,
    its peak during it, and the largest batch that fits (searched from `start`, <= cap; args.fit_max_rows 0: not
    searched). A CPU: the same decode, nothing to measure."""
    if device.type != "cuda":
        decode_rows(sampler, args.gen_rows, args)
        return {"held_gib": None, "peak_gib": None, "largest_rows": None, "fit_tries": 0}
    free_cached(device)
    torch.cuda.reset_peak_memory_stats(device)
    held = torch.cuda.memory_allocated(device)
    decode_rows(sampler, args.gen_rows, args)
    peak = torch.cuda.max_memory_allocated(device)
    free_cached(device)
    largest, tries = None, 0
    if args.fit_max_rows > 0:
        largest, tries = largest_fit(lambda rows: fits(sampler, rows, args), start, cap)
    return {
        "held_gib": round(held / 1024**3, 2),
        "peak_gib": round(peak / 1024**3, 2),
        "largest_rows": largest,
        "fit_tries": tries,
    }


def timed(device: torch.device, call: Callable[[], Any]) -> tuple[Any, float]:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # the work before is not the call's
    started = time.time()
    return call(), time.time() - started


def measure_offload(trainer: Any, args: argparse.Namespace, device: torch.device) -> dict:
    """The offload's cost and what it frees, per trainer state (STATES), on `trainer` (an
    rlpipe.training.state.Trainer) as its last optimizer step left it; the state is back on the device after."""
    from rlpipe.training.offload import offload, onload, trainer_models

    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    sampler = copy.deepcopy(trainer.policy).to(dtype).eval().requires_grad_(False)  # no gradients: not copied
    stepped = [p for model in trainer_models(trainer) for p in model.parameters() if p.grad is not None]
    results, start, cap = {}, args.gen_rows, args.fit_max_rows
    for state in ("offloaded_weights", "offloaded", "resident"):  # the most memory left first: each bounds the next
        for parameter in stepped:  # offload dropped the step's gradients: their bytes as a step leaves them
            if parameter.grad is None:
                parameter.grad = torch.zeros_like(parameter)
        if state == "resident":
            results[state] = generation_memory(sampler, args, device, start, cap)
            continue
        (offloaded, freed), offload_s = timed(device, lambda: offload(trainer, weights=state == "offloaded_weights"))
        memory = generation_memory(sampler, args, device, start, cap)
        moved, onload_s = timed(device, lambda: onload(offloaded))
        results[state] = {
            "offload_s": round(offload_s, 4),
            "offload_bytes": freed,
            "onload_s": round(onload_s, 4),
            "onload_bytes": moved,
        } | memory
        if memory["largest_rows"] is not None:  # the next state holds more: it fits no more, likely over half
            start, cap = max(1, memory["largest_rows"] // 2), memory["largest_rows"]
    del sampler
    free_cached(device)
    note = CPU_NOTE
    if device.type == "cuda":
        note = (
            f"Held: torch.cuda.memory_allocated before a sampler's decode of {args.gen_rows} rows (its {args.dtype} "
            "weights beside the trainer's state); peak: max_memory_allocated during it; the largest batch: doubling "
            f"from {args.gen_rows} (from half the fit of the state holding less, which bounds it), then bisection to "
            f"1/32, at most {FIT_TRIES} decodes (the first two tokens over the whole cache, eager steps)."
        )
    return {state: results[state] for state in STATES} | {"note": note}


def size(count: float) -> str:
    return f"{count / 1e9:.2f} GB" if count >= 1e9 else f"{count / 1e6:.1f} MB"


def offload_table(results: list[dict], fit_max_rows: int) -> list[str]:
    """The markdown table of measure_offload's results (the rows of `results` that have them)."""
    rows = [r for r in results if "offload" in r]
    if not rows:
        return []
    lines = [
        "",
        "Sharing the device: the trainer's offload",
        "",
        "| shape | the trainer's state on the device | offload: given back, time | onload: moved, time "
        "| held before generation | generation peak | largest generation batch |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        for state, label in STATES.items():
            s = r["offload"][state]
            moves = ["", ""]
            if "offload_s" in s:
                moves = [f"{size(s[f'{way}_bytes'])}, {s[f'{way}_s']:.3f} s" for way in ("offload", "onload")]
            if s["peak_gib"] is None:
                memory = ["n/a (CPU)", "n/a (CPU)", "n/a: no device memory limit on a CPU"]
            else:
                largest = "not searched" if s["largest_rows"] is None else f"{s['largest_rows']} rows"
                if s["largest_rows"] == fit_max_rows:
                    largest += " (the cap)"
                memory = [f"{s['held_gib']:.2f} GiB", f"{s['peak_gib']:.2f} GiB", largest]
            lines.append("| " + " | ".join([r["shape"], label, *moves, *memory]) + " |")
    return lines + [f"\n{note}" for note in sorted({r["offload"]["note"] for r in rows})]
