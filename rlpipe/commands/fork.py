"""Fork a run: a new run that starts from version N of another, to try another setting from the same
point (`rlpipe fork RUN --from-iteration N --name NEW --set key=value`).

The child gets, under its own run root, what the loop reads to go on from iteration N:
    data/                      the parent's prepared rows (the same prompts, the same held-out set)
    weights/v000000, v{N}      the reference (KL, a LoRA base) and the version it starts from; LATEST = v{N}
    optimizer/v{N}.pt, critic/ the trainer's state at v{N} (a critic's too), when the parent still has it: the
                               store keeps only the latest version's, so a fork from an earlier version
                               starts a fresh optimizer (forked_from.optimizer_state says which); with
                               storage.optimizer_every, the last checkpoint and the batches to replay to v{N}
    weights/v{k}..v{N}         with delta versions, also the versions v{N} is rebuilt from
    metrics/ up to N           the parent's curve up to the fork, so the child's continues it
    spec.json                  the parent's spec with the overrides, named NEW, tracked in the parent's
                               MLflow store (its run nested under the parent's: mlflow.parentRunId)
    state.json                 iteration N, weights v{N}, and `forked_from` (parent run root, run uid,
                               MLflow run id, iteration, sha256)
Files are hard links on a local filesystem (shared by reference: sealed versions are never written
again) and copies elsewhere. The weights' sha256 is checked, so the child's v{N} is the parent's.
"""

from __future__ import annotations

import copy
import os
from typing import Any

from rlpipe.spec import RunSpec, parse_spec, spec_to_dict, with_overrides
from rlpipe.store.commit import commit_fork
from rlpipe.store.run_root import (
    atomic_write_text,
    data_counts_uri,
    data_uri,
    eval_metrics_uri,
    eval_samples_uri,
    filesystem,
    is_local,
    iteration_metrics_uri,
    join,
    masters_uri,
    optimizer_uri,
    read_json,
    read_state,
    replay_dir,
    write_json,
)
from rlpipe.store.weights import read_weight_ref, verify, version_chain, version_name, version_uri

INHERITED = ("model", "data")  # what made the parent's v0 and data: a fork keeps them


def share(source: str, target: str) -> None:
    """`source` (a file or directory) at `target`: hard links locally, copies elsewhere."""
    fs, src = filesystem(source)
    _, dst = filesystem(target)
    files = [src] if fs.isfile(src) else [p for p in fs.find(src)]
    for path in files:
        out = dst if path == src else dst + path[len(src) :]
        fs.makedirs(out.rsplit("/", 1)[0], exist_ok=True)
        if is_local(source) and is_local(target):
            try:
                os.link(path, out)
                continue
            except OSError:  # another filesystem
                pass
        fs.copy(path, out)


def local_services(spec: dict[str, Any]) -> dict[str, Any]:
    """Overrides that drop the loopback addresses of the trainer and samplers `rlpipe run` started for
    the parent (its spec.json records them): the fork's `rlpipe run` starts its own."""
    loopback = ("http://127.0.0.1:", "http://localhost:")
    dropped: dict[str, Any] = {}
    if str((spec.get("trainer") or {}).get("endpoint") or "").startswith(loopback):
        dropped["trainer.endpoint"] = None
    if any(str(url).startswith(loopback) for url in (spec.get("samplers") or {}).get("endpoints") or []):
        dropped["samplers.endpoints"] = []
    return dropped


def fork_run(parent_root: str, child_root: str, iteration: int, name: str, overrides: dict[str, Any]) -> RunSpec:
    """Make `child_root` a run at `parent_root`'s iteration N with the parent's spec plus `overrides`
    (dotted keys); returns the child's spec. Raises ValueError saying what to change."""
    parent_state, parent_spec = check_fork(parent_root, child_root, iteration, overrides)
    start = read_weight_ref(parent_root, iteration)
    verify(start)

    from rlpipe.tracking.uri import tracking_uri

    parent_tracking = tracking_uri(parse_spec(parent_spec, "the parent's spec"), parent_root)
    # the fork tracks where its parent does (its sqlite store, by default), so MLflow compares the two
    overrides = {"tracking.uri": parent_tracking, **local_services(parent_spec), **overrides, "name": name}
    spec = parse_spec(with_overrides(copy.deepcopy(parent_spec), overrides), "the fork's spec")
    optimizer_state = share_run_files(parent_root, child_root, iteration)
    atomic_write_text(join(child_root, "weights", "LATEST"), version_name(iteration))
    verify(read_weight_ref(child_root, iteration))
    write_json(join(child_root, "spec.json"), spec_to_dict(spec))
    forked_from = {
        "run_root": parent_root,
        "run_uid": parent_state.get("run_uid"),
        "mlflow_run_id": parent_state.get("mlflow_run_id"),
        "tracking_uri": parent_tracking,
        "iteration": iteration,
        "weights_sha256": start["sha256"],
        "optimizer_state": optimizer_state,
    }
    commit_fork(child_root, iteration, start["sha256"], forked_from)
    return spec


def check_fork(
    parent_root: str, child_root: str, iteration: int, overrides: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The parent's state and spec, when a fork of its iteration N into `child_root` can be made;
    otherwise ValueError saying what to change."""
    parent_state = read_state(parent_root)
    parent_spec = read_json(join(parent_root, "spec.json"))
    if parent_state is None or parent_spec is None:
        raise ValueError(
            f"{parent_root} is not a run root (no state.json and spec.json): name the parent's run directory"
        )
    if parent_state["iteration"] < iteration or iteration < 0:
        raise ValueError(
            f"--from-iteration {iteration}: the parent has committed iterations 0..{parent_state['iteration']}"
        )
    fs, child = filesystem(child_root)
    if fs.exists(child) and fs.ls(child):
        raise ValueError(f"{child_root} exists and is not empty: pick another --name")
    touched = sorted({key.split(".")[0] for key in overrides} & set(INHERITED))
    if touched:
        raise ValueError(
            f"--set {', '.join(touched)}.*: a fork keeps the parent's {' and '.join(INHERITED)} (its weights and "
            "prompts come from them); start a new run to change them"
        )
    try:
        read_weight_ref(parent_root, iteration)
    except FileNotFoundError:
        fs, root = filesystem(join(parent_root, "weights"))
        kept = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(root, detail=False) if p.rsplit("/", 1)[-1].startswith("v"))
        raise ValueError(
            f"the parent's weights v{iteration:06d} were pruned (storage.keep_versions keeps the last few); "
            f"fork from one of {', '.join(kept)}, or raise storage.keep_versions in runs you mean to fork"
        ) from None
    return parent_state, parent_spec


def share_run_files(parent_root: str, child_root: str, iteration: int) -> str:
    """Share what the loop reads to go on from iteration N (module docstring); returns whose optimizer
    state the child starts from: "parent's", "fresh" (the store keeps only the latest version's, so a
    fork from an earlier one starts AdamW anew) or "none" (v0 has none)."""

    def exists(uri: str) -> bool:
        fs, path = filesystem(uri)
        return fs.exists(path)

    for split in ("train", "eval"):
        share(data_uri(parent_root, split), data_uri(child_root, split))
    if exists(data_counts_uri(parent_root)):
        share(data_counts_uri(parent_root), data_counts_uri(child_root))
    chain = [link["version"] for link, _ in version_chain(read_weight_ref(parent_root, iteration))]
    for version in sorted({0, *chain}):  # a delta version with the versions it is rebuilt from
        share(version_uri(parent_root, version), version_uri(child_root, version))
    checkpoint = iteration  # the trainer's state at v{N}, or the last checkpoint and the batches to replay to it
    while (
        checkpoint > 0 and not exists(optimizer_uri(parent_root, checkpoint)) and replay_uris(parent_root, checkpoint)
    ):
        checkpoint -= 1
    trainer_state = [optimizer_uri(parent_root, checkpoint), masters_uri(parent_root, checkpoint)]
    trainer_state += [u for v in range(checkpoint + 1, iteration + 1) for u in replay_uris(parent_root, v)]
    trainer_state += [version_uri(parent_root, iteration, "critic"), optimizer_uri(parent_root, iteration, "critic")]
    for uri in trainer_state:  # a critic's only with PPO; an optimizer's unless v{N} is v0
        if exists(uri):
            share(uri, child_root + uri[len(parent_root) :])
    for n in range(iteration + 1):
        for uri in (
            iteration_metrics_uri(parent_root, n),
            eval_metrics_uri(parent_root, n),
            eval_samples_uri(parent_root, n),
        ):
            if exists(uri):
                share(uri, child_root + uri[len(parent_root) :])
    if exists(optimizer_uri(parent_root, iteration)):
        return "parent's"
    if checkpoint < iteration and (checkpoint == 0 or exists(optimizer_uri(parent_root, checkpoint))):
        return f"parent's (v{checkpoint}'s, replayed to v{iteration})"
    return "fresh" if iteration else "none"


def replay_uris(run_root: str, version: int) -> list[str]:
    """The batch kept to replay v{version} (rlpipe.training.checkpoints), if there is one."""
    fs, replays = filesystem(replay_dir(run_root))
    if not fs.exists(replays):
        return []
    names = [p.rsplit("/", 1)[-1] for p in fs.ls(replays, detail=False)]
    return [join(replay_dir(run_root), n) for n in names if n.startswith(f"v{version:06d}.") and n.endswith(".parquet")]
