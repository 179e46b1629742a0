"""The run root: where a run's state, data, metrics and weights live (local path or fsspec URI).

<run root>/
  spec.json            the spec the run was started with
  state.json           iteration, weights version, MLflow run id, data cursor (the commit point)
  data/train.parquet   task prompts;  data/eval.parquet (fixed held-out set)
  metrics/iter_000007.json, metrics/eval_000005.json
  metrics/eval_000005_samples.jsonl   that eval's held-out rows: prompt, greedy completion, answer, reward
  weights/ (see weight_store)   optimizer/v000007/optimizer.pt
  trainers/fleet.json, samplers/fleet.json, producers/fleet.json   the local services `rlpipe run` started
  mlflow.db, tracked.json   the default MLflow store; what the last complete flush to MLflow logged from
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import fsspec
from fsspec import AbstractFileSystem


def run_root_for(storage_root: str, name: str) -> str:
    """`<storage.root>/<name>`; local paths become absolute (KFP steps run elsewhere)."""
    if "://" in storage_root:
        return storage_root.rstrip("/") + "/" + name
    return str((Path(storage_root).expanduser() / name).resolve())


def cache_root_for(storage_root: str, cache: str | None) -> str:
    """Local cache for warm starts and copies of remote weights: storage.cache, else
    <storage.root>/.cache for a local root, else ~/.cache/rlpipe."""
    if cache:
        return str(Path(cache).expanduser().resolve())
    if "://" not in storage_root:
        return str((Path(storage_root).expanduser() / ".cache").resolve())
    return str(Path("~/.cache/rlpipe").expanduser())


def filesystem(uri: str) -> tuple[AbstractFileSystem, str]:
    fs, path = fsspec.core.url_to_fs(uri)
    return fs, path


def join(uri: str, *parts: str) -> str:
    return "/".join([uri.rstrip("/"), *parts])


def is_local(uri: str) -> bool:
    return "://" not in uri or uri.startswith("file://")


def move(source: str, destination: str) -> None:
    """Rename on a local or mounted filesystem (atomic); copy then delete on object stores
    (gcsfs's mv first tries GCS moveTo, which plain buckets reject after ~30 s of retries)."""
    fs, src = filesystem(source)
    _, dst = filesystem(destination)
    if is_local(source):
        fs.mv(src, dst, recursive=True)
    else:
        fs.copy(src, dst, recursive=fs.isdir(src))
        fs.rm(src, recursive=True)


def atomic_write_text(uri: str, text: str) -> None:
    """A reader sees the old content or the new, never a partial file: write-then-rename
    locally; on object stores a single-object PUT is already atomic."""
    fs, path = filesystem(uri)
    if not is_local(uri):
        fs.pipe_file(path, text.encode())
        return
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    with fs.open(tmp, "w") as f:
        f.write(text)
    fs.mv(tmp, path)


class CorruptFileError(ValueError):
    """A run-root JSON file that does not parse; the message names it and the way out."""


def read_json(uri: str, way_out: str = "restore it or delete it") -> Any | None:
    """The parsed file, None when it does not exist; a corrupt file raises CorruptFileError."""
    fs, path = filesystem(uri)
    if not fs.exists(path):
        return None
    with fs.open(path, "r") as f:
        text = f.read()
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise CorruptFileError(f"{uri} is corrupt (not JSON: {err}); {way_out}") from None


def write_json(uri: str, data: Any) -> None:
    atomic_write_text(uri, json.dumps(data, indent=2, sort_keys=True))


# --- state.json: the commit point of the loop -------------------------------------------


def data_uri(run_root: str, split: str) -> str:
    """data/train.parquet and data/eval.parquet: the rows the prepare step wrote."""
    return join(run_root, "data", f"{split}.parquet")


def data_counts_uri(run_root: str) -> str:
    """data/counts.json: rows kept and dropped by the prepare step (recorded with iteration 0)."""
    return join(run_root, "data", "counts.json")


def optimizer_dir(run_root: str, lineage: str = "policy") -> str:
    """optimizer/ for the policy, critic/optimizer/ for a critic's (rlpipe.store.weights.LINEAGES)."""
    return join(run_root, "optimizer") if lineage == "policy" else join(run_root, lineage, "optimizer")


def masters_uri(run_root: str, version: int) -> str:
    """The trainer's fp32 master weights after training v(version), when versions store a narrower
    serving copy (storage.weights_dtype)."""
    return join(optimizer_dir(run_root), f"v{version:06d}.masters.safetensors")


def replay_dir(run_root: str) -> str:
    """The batches kept to replay the updates since the resident trainer's last checkpoint."""
    return join(optimizer_dir(run_root), "replay")


def optimizer_uri(run_root: str, version: int, lineage: str = "policy") -> str:
    """The trainer's optimizer state after training weights v(version), beside that version."""
    return join(optimizer_dir(run_root, lineage), f"v{version:06d}.pt")


def state_uri(run_root: str) -> str:
    return join(run_root, "state.json")


def read_state(run_root: str) -> dict[str, Any] | None:
    way_out = (
        "it is the run's commit point, which rlpipe only replaces atomically, so something else wrote it. "
        "Restore it from a backup (it holds iteration, weights_version and weights_sha256: weights/LATEST and "
        "that version's manifest.json give them), or start the run again under a new run name / --run-dir"
    )
    return read_json(state_uri(run_root), way_out)


# --- metrics files: one per committed iteration, one per eval ------------------------------


def iteration_metrics_uri(run_root: str, iteration: int) -> str:
    return join(run_root, "metrics", f"iter_{iteration:06d}.json")


def eval_metrics_uri(run_root: str, iteration: int) -> str:
    return join(run_root, "metrics", f"eval_{iteration:06d}.json")


def eval_samples_uri(run_root: str, iteration: int, name: str | None = None) -> str:
    """metrics/eval_N_samples.jsonl; a named evaluation set's: eval_N_<name>_samples.jsonl."""
    return join(run_root, "metrics", f"eval_{iteration:06d}{'' if name is None else '_' + name}_samples.jsonl")


def write_eval_samples(run_root: str, iteration: int, samples: list[dict[str, Any]], name: str | None = None) -> None:
    """One JSON object a line, written atomically like the metrics files."""
    text = "".join(json.dumps(sample, sort_keys=True) + "\n" for sample in samples)
    atomic_write_text(eval_samples_uri(run_root, iteration, name), text)


def read_eval_samples(run_root: str, iteration: int, name: str | None = None) -> list[dict[str, Any]]:
    """The held-out rows of iteration N's eval (rlpipe.evaluation.accuracy.evaluate_policy): dicts with index,
    prompt, completion, answer, reward (the verifier's score), correct and strict (absent in runs recorded
    before it), and with evaluation.samples the sampled `samples` (completion, reward); [] when none were
    recorded. `name`: an evaluation set's."""
    fs, path = filesystem(eval_samples_uri(run_root, iteration, name))
    if not fs.exists(path):
        return []
    with fs.open(path, "r") as f:
        return [json.loads(line) for line in f if line.strip()]


def list_metrics(run_root: str, kind: str) -> dict[int, dict[str, float]]:
    """{iteration: metrics} for kind 'iter' or 'eval'."""
    fs, path = filesystem(join(run_root, "metrics"))
    if not fs.exists(path):
        return {}
    found: dict[int, dict[str, float]] = {}
    for name in sorted(fs.ls(path, detail=False)):
        base = name.rsplit("/", 1)[-1]
        if base.startswith(f"{kind}_") and base.endswith(".json"):
            with fs.open(name, "r") as f:
                found[int(base[len(kind) + 1 : -5])] = json.load(f)
    return found


def tracked_uri(run_root: str) -> str:
    """What the last complete MLflow flush logged from (rlpipe.tracking.mlflow_runs.flush): a later flush with
    nothing new returns without importing MLflow. Delete it to make the next flush ask MLflow again."""
    return join(run_root, "tracked.json")


def created_whole(path: Path, create: Callable[[Path], object]) -> None:
    """`path` made by `create` under another name and linked into place, unless it exists: a kill while
    `create` runs leaves nothing at `path` (MLflow migrates a new sqlite database for seconds, and one
    cut short fails every later open). Of two makers at once, the first to link wins."""
    if path.exists():
        return
    making = path.with_name(f"{path.name}.creating-{os.getpid()}")
    making.unlink(missing_ok=True)
    try:
        create(making)
        os.link(making, path)
    except FileExistsError:
        pass
    finally:
        making.unlink(missing_ok=True)


@contextlib.contextmanager
def one_flush_at_a_time(run_root: str) -> Iterator[None]:
    """An exclusive lock on a local run root's .tracking.lock, serializing its MLflow flushes (rlpipe run's
    live ones and the track step's, also across a container's bind mount); nothing for a remote run root,
    whose flushes are a cluster's track steps, one at a time."""
    if not is_local(run_root):
        yield
        return
    path = Path(run_root.removeprefix("file://")) / ".tracking.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def fleet_uri(run_root: str, kind: str) -> str:
    """The record of the local `kind` servers (trainer, sampler, producer) that `rlpipe run` supervises."""
    return join(run_root, f"{kind}s", "fleet.json")


def failed_services(run_root: str, kind: str) -> dict[str, str]:
    """{url: why} of the local `kind` servers their supervisor gave up on (each one's last error line
    and its log), so a step waiting for one fails at once. Empty on a cluster: Kubernetes restarts pods."""
    record = read_json(fleet_uri(run_root, kind)) or {}
    return {
        r["url"]: f"{r.get('error') or 'it exited'} (log: {r['log']})"
        for r in record.get("replicas", [])
        if r.get("state") == "failed"
    }
