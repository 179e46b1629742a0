"""How much of the update's forward passes is padding, at several trainer.micro_batch_tokens budgets,
on the rows of real batches (the advantages step's Parquet output, what the update trains on):

    python benchmarks/padding.py runs/smollm2-word-problems/kfp --mini-batches 1 --budgets none 1024 2048 4096

Each file is one iteration's batch, cut into mini-batches and micro-batches exactly as the update cuts
it (rlpipe.training.batching: rows shuffled by the iteration's seed, then each micro-batch filled with
rows sorted by length up to the token budget; `none`: one pass per mini-batch, padded to its longest
row). Reported as the update reports it (policy/padding_share):

    padding share = 1 - sum(real tokens) / sum(rows x longest row), over every forward pass

With --model (a Hugging Face directory: the run's weights/v000000), also times the update's forward and
backward passes over the same micro-batches, right-padded and packed without padding (trainer.padding_free),
side by side: each micro-batch's log-probs and entropies (rlpipe.training.logprobs, the head in
trainer.logit_chunk_tokens chunks) and a policy-gradient loss back-propagated, alternating padded and
packed batch by batch, --repeats times; medians of the per-layout totals. The packed budget counts the rows'
tokens, so a packed micro-batch holds the rows a padded one leaves to the next:

    python benchmarks/padding.py runs/x/kfp --mini-batches 4 --budgets 1024 --model runs/x/weights/v000000 --files 2

Writes benchmarks/results/padding.{md,json} (--results-dir, --tag to change).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from machine import describe_machine  # benchmarks/ is on sys.path when run as a script

RESULTS = Path(__file__).with_name("results")


BATCH_COLUMNS = {"prompt_token_ids", "completion_token_ids", "advantage"}  # what the update trains on


def batch_files(paths: list[str]) -> list[Path]:
    """The batches named, or found under the directories named (a run's kfp/ directory holds each
    iteration's as the advantages step's `batch` artifact): Parquet files with BATCH_COLUMNS."""
    import pyarrow.parquet as pq

    files = []
    for path in map(Path, paths):
        for file in sorted(path.rglob("*")) if path.is_dir() else [path]:
            if (
                file.is_file()
                and file.open("rb").read(4) == b"PAR1"
                and BATCH_COLUMNS <= set(pq.read_schema(file).names)
            ):
                files.append(file)
    if not files:
        raise SystemExit(f"no Parquet file with the columns {sorted(BATCH_COLUMNS)} under {' '.join(paths)}")
    return files


def padding(rows_per_batch: list[list[dict]], budget: int | None, mini_batches: int) -> dict:
    """The padding share and forward passes of the update over these batches at `budget` tokens."""
    from rlpipe.training.batching import micro_batches, row_length, update_order
    from rlpipe.training.batching import mini_batches as cut_mini_batches

    tokens = positions = passes = packed_passes = 0
    for seed, rows in enumerate(rows_per_batch):
        for mini in cut_mini_batches(update_order(rows, pairs=False, seed=seed), mini_batches):
            for group in micro_batches(mini, budget):
                tokens += sum(map(row_length, group))
                positions += len(group) * max(map(row_length, group))
                passes += 1
            packed_passes += len(micro_batches(mini, budget, packed=True))
    share = 1.0 - tokens / max(positions, 1)
    return {"budget": budget, "padding_share": share, "forward_passes": passes, "packed_passes": packed_passes}


def timed_update_passes(model_dir: str, rows_per_batch: list[list[dict]], budget: int | None, args) -> dict:
    """Seconds of the update's forward + backward passes over these batches, padded and packed (medians of
    --repeats), the two layouts alternating batch by batch in this one process."""
    import statistics
    import time

    import torch

    from rlpipe.models.loading import configure_torch, load_policy
    from rlpipe.training.batching import micro_batches, pack, update_order
    from rlpipe.training.batching import mini_batches as cut_mini_batches
    from rlpipe.training.logprobs import completion_logprobs_and_entropy
    from rlpipe.training.packed_attention import use_packed_attention

    configure_torch(args.threads)
    model, tokenizer = load_policy(model_dir)
    model = model.to(args.device)
    use_packed_attention(model)  # padded micro-batches still attend through sdpa
    model.train()
    precision = torch.autocast(model.device.type, dtype=torch.bfloat16, enabled=args.dtype == "bfloat16")

    def passes(mini: list[dict], packed: bool) -> float:
        started = time.perf_counter()
        for group in micro_batches(mini, budget, packed=packed):
            mb = pack([r | {"advantage": 1.0} for r in group], tokenizer.pad_token_id, packed).to(model.device)
            logprobs, _ = completion_logprobs_and_entropy(model, mb, 1.0, args.logit_chunk_tokens, precision=precision)
            (-(logprobs * mb.completion_mask).sum() / mb.completion_mask.sum()).backward()
        if model.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - started

    totals: dict[str, list[float]] = {"padded": [], "packed": []}
    for repeat in range(args.repeats):
        spent = {"padded": 0.0, "packed": 0.0}
        for seed, rows in enumerate(rows_per_batch):
            for mini in cut_mini_batches(update_order(list(rows), pairs=False, seed=seed), args.mini_batches):
                for layout in ("padded", "packed") if repeat % 2 == 0 else ("packed", "padded"):
                    spent[layout] += passes(mini, layout == "packed")
                    model.zero_grad(set_to_none=True)
        for layout, seconds in spent.items():
            totals[layout].append(seconds)
    padded, packed = (statistics.median(totals[k]) for k in ("padded", "packed"))
    return {"budget": budget, "padded_s": padded, "packed_s": packed, "speedup": padded / packed, "runs": totals}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="+", help="batch Parquet files, or directories holding them")
    parser.add_argument("--budgets", nargs="+", default=["none", "1024", "2048", "4096"])
    parser.add_argument("--mini-batches", type=int, default=1, help="trainer.mini_batches")
    parser.add_argument("--label", default=None, help="what the batches are, for the results (default: the paths)")
    parser.add_argument("--results-dir", type=Path, default=RESULTS)
    parser.add_argument("--tag", default=None, help="results file suffix: padding_<tag>.{md,json}")
    parser.add_argument("--model", default=None, help="a Hugging Face directory: also time padded vs packed passes")
    parser.add_argument("--files", type=int, default=2, help="batches timed with --model (the first ones)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each layout")
    parser.add_argument("--threads", type=int, default=1, help="trainer.threads")
    parser.add_argument("--logit-chunk-tokens", type=int, default=512, help="trainer.logit_chunk_tokens")
    parser.add_argument("--device", default="cpu", help="where --model computes (cuda: varlen flash attention)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="trainer.dtype")
    args = parser.parse_args()

    from rlpipe.rollouts import read_table

    files = batch_files(args.paths)
    batches = [read_table(str(f)).select(["prompt_token_ids", "completion_token_ids"]).to_pylist() for f in files]
    lengths = [len(r["prompt_token_ids"]) + len(r["completion_token_ids"]) for rows in batches for r in rows]
    budgets = [None if b == "none" else int(b) for b in args.budgets]
    results = [padding(batches, budget, args.mini_batches) for budget in budgets]
    label = args.label or " ".join(args.paths)
    typed = " ".join(a for a in sys.argv[1:] if a not in args.paths and a not in (args.label, "--label"))
    lines = [
        f"`python benchmarks/padding.py {label} {typed}`: "
        f"{len(files)} batches, {len(lengths)} rows, {min(lengths)}-{max(lengths)} tokens per row",
        "",
        "| trainer.micro_batch_tokens | padding share | forward passes | packed: forward passes |",
        "|---|---|---|---|",
        *(
            f"| {r['budget'] or 'null (one pass per mini-batch)'} | {100 * r['padding_share']:.1f}% "
            f"| {r['forward_passes']} | {r['packed_passes']} |"
            for r in results
        ),
    ]
    timed = []
    if args.model:
        timed = [timed_update_passes(args.model, batches[: args.files], budget, args) for budget in budgets]
        lines += [
            "",
            f"Forward + backward passes of the first {min(args.files, len(batches))} batches, `--model {args.model}`, "
            f"{args.device}, {args.dtype}, {args.threads} thread(s), medians of {args.repeats} runs each, side by side "
            f"({describe_machine()}):",
            "",
            "| trainer.micro_batch_tokens | padded | packed (trainer.padding_free) | padded / packed |",
            "|---|---|---|---|",
            *(
                f"| {t['budget'] or 'null'} | {t['padded_s']:.2f} s | {t['packed_s']:.2f} s | {t['speedup']:.2f}x |"
                for t in timed
            ),
        ]
    print("\n".join(lines))
    args.results_dir.mkdir(parents=True, exist_ok=True)
    name = f"padding_{args.tag}" if args.tag else "padding"
    (args.results_dir / f"{name}.md").write_text("\n".join(lines) + "\n")
    record = {"label": label, "files": len(files), "rows": len(lengths), "results": results, "timed": timed}
    (args.results_dir / f"{name}.json").write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
