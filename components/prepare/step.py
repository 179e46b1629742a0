"""prepare: generate the task's train prompts and fixed held-out eval set (seeded, no torch)."""

from __future__ import annotations

from rlpipe.run_store import filesystem, join, move
from rlpipe.spec import RunSpec
from rlpipe.tasks import task_rows


def prepare_data(spec: RunSpec, run_root: str) -> dict[str, int]:
    """Write data/train.parquet and data/eval.parquet with `datasets`; skip if present."""
    from datasets import Dataset

    train_uri, eval_uri = join(run_root, "data", "train.parquet"), join(run_root, "data", "eval.parquet")
    fs, _ = filesystem(run_root)
    if not (fs.exists(filesystem(train_uri)[1]) and fs.exists(filesystem(eval_uri)[1])):
        train, held_out = task_rows(spec)
        fs.makedirs(filesystem(join(run_root, "data"))[1], exist_ok=True)
        for uri, part in ((eval_uri, held_out), (train_uri, train)):
            tmp = f"{uri}.tmp"
            with fs.open(filesystem(tmp)[1], "wb") as f:
                Dataset.from_list(part).to_parquet(f)
            move(tmp, uri)
    return {"data/train_rows": spec.task.train_size, "data/eval_rows": spec.task.eval_size}
