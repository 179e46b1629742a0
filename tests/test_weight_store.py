"""The weight store publishes atomically: a concurrent reader never sees a partial version."""

import json
import os
import threading
from pathlib import Path

import pytest

from rlpipe.store import pruning
from rlpipe.store import weights as ws


def _stage(run_root: str, version: int, size_mb: int = 4) -> ws.WeightRef:
    staged = ws.staging_uri(run_root, version)
    Path(staged).mkdir(parents=True)
    for name in ("model.safetensors", "config.json", "extra.bin"):
        (Path(staged) / name).write_bytes(os.urandom(size_mb << 20 if name != "config.json" else 64))
    return ws.seal(staged, version=version, iteration=version, parent=version - 1 if version else None)


def test_publish_moves_latest_last_and_verifies(tmp_path: Path):
    root = str(tmp_path / "run")
    ref = ws.publish(root, _stage(root, 0, 1)).ref
    assert ws.latest_version(root) == 0
    assert ws.read_weight_ref(root, 0) == ref
    assert not any(Path(root, "weights", ".staging").iterdir())  # staged dir moved, not copied
    ws.check_weight_ref(ref)


def test_reader_during_publish_never_sees_a_partial_version(tmp_path: Path):
    root = str(tmp_path / "run")
    ws.publish(root, _stage(root, 0, 1))
    stop = threading.Event()
    seen: list[int] = []
    errors: list[str] = []

    def reader() -> None:
        while True:
            finished = stop.is_set()  # read once more after the last publish
            version = ws.latest_version(root)
            ref = ws.read_weight_ref(root, version)
            sha, _ = ws.directory_sha256(ref["uri"])  # every file of the version LATEST names
            if sha != ref["sha256"]:
                errors.append(f"v{version}: partial or corrupt")
            seen.append(version)
            if finished:
                return

    thread = threading.Thread(target=reader)
    thread.start()
    for version in range(1, 6):
        ws.publish(root, _stage(root, version))
    stop.set()
    thread.join()
    assert not errors
    assert seen == sorted(seen) and seen[-1] == 5  # versions only move forward
    assert len(seen) > 5


def test_tampered_staging_is_rejected_and_nothing_moves(tmp_path: Path):
    root = str(tmp_path / "run")
    ws.publish(root, _stage(root, 0, 1))
    staged = _stage(root, 1, 1)
    with open(Path(staged["uri"]) / "model.safetensors", "r+b") as f:
        f.truncate(100)
    with pytest.raises(ValueError, match="expected"):
        ws.publish(root, staged)
    assert ws.latest_version(root) == 0
    assert not Path(ws.version_uri(root, 1)).exists()


def test_publish_replaces_a_leftover_uncommitted_version(tmp_path: Path):
    root = str(tmp_path / "run")
    first = ws.publish(root, _stage(root, 1, 1)).ref
    second = ws.publish(root, _stage(root, 1, 1)).ref  # a rerun of the same iteration after a kill
    assert first["sha256"] != second["sha256"]
    assert ws.read_weight_ref(root, 1) == second


def test_refs_survive_kfp_float_conversion_and_mismatch_is_caught(tmp_path: Path):
    root = str(tmp_path / "run")
    ref = ws.publish(root, _stage(root, 0, 1)).ref
    floated = json.loads(json.dumps({**ref, "version": 0.0}))
    assert ws.as_weight_ref(floated)["version"] == 0
    with pytest.raises(ValueError, match="handed version"):
        ws.check_weight_ref({**ref, "sha256": "0" * 64})
    with pytest.raises(ValueError, match="not a weights reference"):
        ws.as_weight_ref({"uri": "x"})


def test_prune_keeps_v0_and_the_last_versions(tmp_path: Path):
    root = str(tmp_path / "run")
    for version in range(6):
        ws.publish(root, _stage(root, version, 1))
    orphan = _stage(root, 5, 1)  # staged by an attempt killed before it published
    removed = pruning.prune(root, keep=2, current=5)
    assert not Path(orphan["uri"]).exists()
    assert sorted(removed) == [1, 2, 3]
    assert sorted(p.name for p in Path(root, "weights").glob("v*")) == ["v000000", "v000004", "v000005"]


def test_remote_store_through_fsspec_memory(tmp_path: Path):
    """The same code path a gs:// store takes: fsspec, no local rename, a cached local copy."""
    import fsspec

    memory = fsspec.filesystem("memory")
    local_staged = tmp_path / "staged"
    local_staged.mkdir()
    (local_staged / "model.safetensors").write_bytes(b"weights")
    staged_uri = ws.staging_uri("memory://bucket/run", 3)
    memory.put(str(local_staged) + "/", staged_uri.removeprefix("memory://"), recursive=True)
    ref = ws.publish("memory://bucket/run", ws.seal(staged_uri, 3, 3, 2)).ref
    assert ws.latest_version("memory://bucket/run") == 3
    local = ws.local_path(ref, tmp_path / "cache")
    assert Path(local, "model.safetensors").read_bytes() == b"weights"
