"""What the store lets go of: old weight versions (all but the newest `storage.keep_versions`, v0, the
registered ones and every version a kept delta is rebuilt from), staging left by attempts that died, and old
optimizer states (a run resumes from the newest, replaying the updates since). Called by sync_weights once a
version is committed (rlpipe.loop.prune_store)."""

from __future__ import annotations

import json

from rlpipe.store.run_root import filesystem, join, optimizer_dir
from rlpipe.store.weights import MANIFEST, weights_root


def prune(
    run_root: str, keep: int, current: int, lineage: str = "policy", registered: frozenset[int] = frozenset()
) -> list[int]:
    """Delete versions older than the last `keep` (v0, the reference, and the `registered` versions the
    MLflow Model Registry points at are always kept), and staging left by attempts that died before
    publishing (versions <= current)."""
    fs, root = filesystem(weights_root(run_root, lineage))
    if not fs.exists(root):
        return []
    staging = f"{root}/.staging"
    if fs.exists(staging):
        for path in fs.ls(staging, detail=False):
            if int(path.rsplit("/", 1)[-1][1:7]) <= current:
                fs.rm(path, recursive=True)
    versions = {
        int(name[1:]): path
        for path in fs.ls(root, detail=False)
        if (name := path.rsplit("/", 1)[-1]).startswith("v") and name[1:].isdigit()
    }
    kept = {v for v in versions if v == 0 or v > current - keep or v in registered}
    for version in sorted(kept):  # and every version a kept delta version is rebuilt from
        while version in versions and (parent := delta_parent(versions[version], fs)) is not None:
            kept.add(parent)
            version = parent
    removed = sorted(set(versions) - kept)
    for version in removed:
        fs.rm(versions[version], recursive=True)
    return removed


def delta_parent(path: str, fs) -> int | None:
    """The version a stored version is a delta against (its manifest's delta_of); None when whole."""
    manifest = f"{path}/{MANIFEST}"
    if not fs.exists(manifest):
        return None
    with fs.open(manifest, "r") as f:
        return json.load(f).get("delta_of")


def prune_optimizer_states(run_root: str, current: int, lineage: str = "policy") -> None:
    """Delete optimizer states (and masters) older than the newest one at or below v(current), and .tmp
    files of writes killed midway below v(current) (v(current)'s may still be being written in the
    background): a run resumes from the newest state, replaying the updates since
    (rlpipe.training.checkpoints)."""
    fs, opt_dir = filesystem(optimizer_dir(run_root, lineage))
    if not fs.exists(opt_dir):
        return
    names = [p.rsplit("/", 1)[-1] for p in fs.ls(opt_dir, detail=False)]
    states = [int(n[1:7]) for n in names if n.startswith("v") and n.endswith(".pt") and int(n[1:7]) <= current]
    newest = max(states, default=0)
    for name in names:
        if not name.startswith("v"):
            continue
        stale = name.endswith((".pt", ".safetensors")) and int(name[1:7]) < newest
        if stale or (name.endswith(".tmp") and int(name[1:7]) < current):
            fs.rm(join(optimizer_dir(run_root, lineage), name))
