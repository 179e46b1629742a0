"""How much of the update's forward passes is padding, at several trainer.micro_batch_tokens budgets,
on the rows of real batches (the advantages step's Parquet output, what the update trains on):

    python benchmarks/padding.py runs/smollm2-word-problems/kfp --mini-batches 1 --budgets none 1024 2048 4096

Each file is one iteration's batch, cut into mini-batches and micro-batches exactly as the update cuts
it (rlpipe.training.batching: rows shuffled by the iteration's seed, then each micro-batch filled with
rows sorted by length up to the token budget; `none`: one pass per mini-batch, padded to its longest
row). Reported as the update reports it (policy/padding_share):

    padding share = 1 - sum(real tokens) / sum(rows x longest row), over every forward pass

Writes benchmarks/results/padding.{md,json} (--results-dir to change).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

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

    tokens = positions = passes = 0
    for seed, rows in enumerate(rows_per_batch):
        for mini in cut_mini_batches(update_order(rows, pairs=False, seed=seed), mini_batches):
            for group in micro_batches(mini, budget):
                tokens += sum(map(row_length, group))
                positions += len(group) * max(map(row_length, group))
                passes += 1
    return {"budget": budget, "padding_share": 1.0 - tokens / max(positions, 1), "forward_passes": passes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="+", help="batch Parquet files, or directories holding them")
    parser.add_argument("--budgets", nargs="+", default=["none", "1024", "2048", "4096"])
    parser.add_argument("--mini-batches", type=int, default=1, help="trainer.mini_batches")
    parser.add_argument("--label", default=None, help="what the batches are, for the results (default: the paths)")
    parser.add_argument("--results-dir", type=Path, default=RESULTS)
    args = parser.parse_args()

    from rlpipe.rollouts import read_table

    files = batch_files(args.paths)
    batches = [read_table(str(f)).select(["prompt_token_ids", "completion_token_ids"]).to_pylist() for f in files]
    lengths = [len(r["prompt_token_ids"]) + len(r["completion_token_ids"]) for rows in batches for r in rows]
    budgets = [None if b == "none" else int(b) for b in args.budgets]
    results = [padding(batches, budget, args.mini_batches) for budget in budgets]
    label = args.label or " ".join(args.paths)
    lines = [
        f"`python benchmarks/padding.py {label} --mini-batches {args.mini_batches} --budgets {' '.join(args.budgets)}`: "
        f"{len(files)} batches, {len(lengths)} rows, {min(lengths)}-{max(lengths)} tokens per row",
        "",
        "| trainer.micro_batch_tokens | padding share | forward passes |",
        "|---|---|---|",
        *(
            f"| {r['budget'] or 'null (one pass per mini-batch)'} | {100 * r['padding_share']:.1f}% | {r['forward_passes']} |"
            for r in results
        ),
    ]
    print("\n".join(lines))
    args.results_dir.mkdir(parents=True, exist_ok=True)
    (args.results_dir / "padding.md").write_text("\n".join(lines) + "\n")
    record = {"label": label, "files": len(files), "rows": len(lengths), "results": results}
    (args.results_dir / "padding.json").write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
