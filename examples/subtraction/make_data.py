"""Write the subtraction task as data files, the way your own task arrives: JSONL rows with any
columns. Every pair a, b in 0..99 once (10,000 problems), shuffled with a fixed seed; the first
500 are the held-out set.

    python examples/subtraction/make_data.py          # writes examples/subtraction/data/{train,eval}.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(row) + "\n" for row in rows))
    tmp.rename(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("data"))
    parser.add_argument("--eval-size", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rows = [{"id": 100 * a + b, "a": a, "b": b, "answer": str(a - b)} for a in range(100) for b in range(100)]
    random.Random(args.seed).shuffle(rows)
    write_jsonl(args.out / "eval.jsonl", rows[: args.eval_size])
    write_jsonl(args.out / "train.jsonl", rows[args.eval_size :])
    print(f"wrote {len(rows) - args.eval_size} train and {args.eval_size} held-out rows to {args.out}")


if __name__ == "__main__":
    main()
