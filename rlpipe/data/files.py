"""Rows from data a user brings: files (JSONL, JSON, Parquet, CSV; a file, directory or glob, local or
any fsspec URI), a dataset saved with `datasets`' save_to_disk, or a hub dataset id."""

from __future__ import annotations

import json
from pathlib import PurePosixPath
from typing import Any

Rows = list[dict[str, Any]]
EXTENSIONS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


def read_rows(path: str, format: str, config: str | None, split: str, key: str) -> Rows:
    """Every row `path` holds; `key` is the spec key naming it (for errors)."""
    from rlpipe.store.run_root import filesystem

    if format == "hub":
        return _hub_rows(path, config, split, key)
    try:
        fs, location = filesystem(path)
    except (ValueError, ImportError) as err:
        raise ValueError(f"{key} {path}: cannot open it ({err})") from None
    if format == "saved" or (format == "auto" and fs.isdir(location) and _is_saved_dataset(fs, location)):
        return _saved_rows(path, split, key)
    if fs.isdir(location):
        files = sorted(f for f in fs.find(location) if PurePosixPath(f).suffix in EXTENSIONS)
    elif any(ch in location for ch in "*?["):
        files = sorted(fs.glob(location))
    elif fs.exists(location):
        files = [location]
    elif format == "auto" and "://" not in path and not path.startswith(("/", ".", "~")) and path.count("/") <= 1:
        return _hub_rows(path, config, split, key)  # 'owner/name' that is no local path: a hub id
    else:
        raise ValueError(f"{key} {path} does not exist; point it at data files, a directory, a glob or a hub id")
    if not files:
        raise ValueError(f"{key} {path} holds no data files ({', '.join(EXTENSIONS)})")
    rows: Rows = []
    for file in files:
        kind = format if format not in ("auto", "saved") else EXTENSIONS.get(PurePosixPath(file).suffix)
        if kind is None:
            raise ValueError(f"{key}: cannot tell the format of {file}; set data.format")
        with fs.open(file, "rb") as f:
            rows += _parse(f.read(), kind, file, key)
    return rows


def _parse(content: bytes, kind: str, name: str, key: str) -> Rows:
    import io

    import pyarrow.csv
    import pyarrow.parquet as pq

    try:
        if kind == "jsonl":
            return [json.loads(line) for line in content.decode().splitlines() if line.strip()]
        if kind == "json":
            data = json.loads(content)
            if isinstance(data, dict):  # {"data": [...]} or {"train": [...]}: the one list inside
                lists = [v for v in data.values() if isinstance(v, list)]
                data = lists[0] if len(lists) == 1 else data
            if not isinstance(data, list):
                raise ValueError("expected a list of rows")
            return data
        if kind == "parquet":
            return pq.read_table(io.BytesIO(content)).to_pylist()
        if kind == "csv":
            return pyarrow.csv.read_csv(io.BytesIO(content)).to_pylist()
    except (ValueError, json.JSONDecodeError) as err:
        raise ValueError(f"{key}: cannot read {name} as {kind} ({err})") from None
    raise ValueError(f"{key}: unknown data format {kind!r}")


def _is_saved_dataset(fs, location: str) -> bool:
    names = {PurePosixPath(p).name for p in fs.ls(location, detail=False)}
    if names & {"dataset_dict.json", "dataset_info.json", "state.json"}:
        return True
    return any(fs.exists(f"{location.rstrip('/')}/{name}/state.json") for name in names)


def _saved_rows(path: str, split: str, key: str) -> Rows:
    from datasets import Dataset, DatasetDict, load_from_disk

    saved = load_from_disk(path)
    if isinstance(saved, DatasetDict):
        if split not in saved:
            raise ValueError(f"{key} {path} has splits {sorted(saved)}, not {split!r}; set data.split/eval_split")
        saved = saved[split]
    assert isinstance(saved, Dataset)
    return saved.to_list()


def _hub_rows(name: str, config: str | None, split: str, key: str) -> Rows:
    from datasets import load_dataset

    try:
        return load_dataset(name, config, split=split).to_list()
    except Exception as err:  # noqa: BLE001 (no network, unknown id or split, ...)
        raise ValueError(
            f"{key} {name!r} (config {config}, split {split}): could not load it as a hub dataset "
            f"({type(err).__name__}: {err}). Offline? Point it at local files or a URI"
        ) from None
