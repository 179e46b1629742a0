"""The rollout buffer: generation running ahead of training (loop.max_staleness s >= 1), a group at a time.

    <run root>/rollout_buffer/
      groups/000000123-h000007-p00031-v000005.arrow   a finished group: the samples of prompt 31 of
                                    iteration 7's slice of the data, sampled from v5, 123rd to finish
      iter_000008/taken.json        what iteration 8's generate step took (committed with state.json)
      consumed/iter_000008/         the same and the group files it names, moved here once 8 committed
      producer.json                 the producer's heartbeat: pid, version held, busy seconds

Groups. The prompts come in a synchronous run's order: group (h, p) is position p of iteration h's
slice of the data (rlpipe.data.order.iteration_prompts), h its home. The producer (`produce`:
rlpipe.services.producer.server's process, beside the trainer) samples the groups of homes up to
committed + 1 + s that are neither consumed nor in the buffer, lowest first, rollout.batch_size rows at a
time, with the latest committed version, read before each batch. It writes each group the moment it
finishes: the torch engine hands over a group at the decode step its last completion ends, while the
batch decodes on (other engines and multi-turn rollouts: at the end of the batch). With
loop.partial_rollouts (torch engine) it also picks a newer version up between decode steps: the
unfinished completions go on under it, each token's version recorded (LatestVersion).

Consumption. The generate step of iteration N (`take`) takes the groups that finished first (lowest
sequence number) and are at most s versions old,
    staleness = (N - 1) - version  in [0, s]
as many as its own slice holds; a straggler, a group with a long completion, stays buffered for a later
iteration instead of holding the others back, its version recorded and corrected for like any other's.
A group older than s is dropped (async/stale_rows_dropped) and sampled again with a newer version. The
buffer holds at most s + 1 iterations' groups (bounded on disk; in memory, one batch).

Exactly once. take writes the rollouts artifact and `taken.json`: each group's file, home, position,
version and sha256. sync_weights commits that record into state.json with the set of consumed groups
(`groups_consumed`: every group of homes <= `through`, and those listed in `beyond`), then moves the
files to consumed/ (`retire`). A rerun of an uncommitted iteration takes the same groups again; the
producer never samples a consumed group nor one in the buffer (it checks that the state it listed the
buffer against is still the committed one), so each prompt of the consumed range is used exactly once,
whatever is killed when.
"""

from __future__ import annotations

import hashlib
import time
from typing import TYPE_CHECKING, Any

from rlpipe.metric_keys import GENERATE_TIME, STALENESS_MAX, STALENESS_MEAN
from rlpipe.store.run_root import failed_services, filesystem, join, read_json, read_state, write_json

if TYPE_CHECKING:
    from rlpipe.spec import RunSpec
    from rlpipe.store.weights import WeightRef

Group = tuple[int, int]  # (home iteration, position in its slice)
HEARTBEAT_TIMEOUT_S = 60.0  # a producer silent this long is gone: the generate step stops waiting
POLL_S = 0.05


def buffer_uri(run_root: str) -> str:
    return join(run_root, "rollout_buffer")


def groups_uri(run_root: str) -> str:
    return join(buffer_uri(run_root), "groups")


def iteration_uri(run_root: str, iteration: int, consumed: bool = False) -> str:
    return join(buffer_uri(run_root), *(["consumed"] if consumed else []), f"iter_{iteration:06d}")


def producer_uri(run_root: str) -> str:
    return join(buffer_uri(run_root), "producer.json")


def group_file(sequence: int, group: Group, version: int) -> str:
    return f"{sequence:09d}-h{group[0]:06d}-p{group[1]:05d}-v{version:06d}.arrow"


def parse_group_file(name: str) -> tuple[int, Group, int] | None:
    """(sequence, group, version) of a finished group's file name; None for anything else (a .tmp file)."""
    parts = name.removesuffix(".arrow").split("-")
    if not name.endswith(".arrow") or len(parts) != 4:
        return None
    return int(parts[0]), (int(parts[1][1:]), int(parts[2][1:])), int(parts[3][1:])


def buffered(run_root: str) -> list[tuple[int, Group, int, str]]:
    """The finished groups in the buffer, first finished first: (sequence, group, version, file name)."""
    fs, directory = filesystem(groups_uri(run_root))
    try:
        names = [p.rsplit("/", 1)[-1] for p in fs.ls(directory, detail=False)] if fs.exists(directory) else []
    except FileNotFoundError:
        names = []
    return sorted((*parsed, name) for name in names if (parsed := parse_group_file(name)) is not None)


def write_group(uri: str, rows: Any) -> None:
    """A group's rows as an Arrow IPC file: the generate step reads a hundred of them an iteration, at
    a tenth of a Parquet file's cost each."""
    import pyarrow as pa

    fs, path = filesystem(uri)
    with fs.open(path, "wb") as f, pa.ipc.new_file(f, rows.schema) as writer:
        writer.write_table(rows)


def group_bytes(run_root: str, name: str) -> bytes:
    """The bytes of finished group file `name` in the buffer."""
    fs, path = filesystem(join(groups_uri(run_root), name))
    return fs.cat_file(path)


def read_group(data: bytes) -> Any:
    """A group's rows from its file's bytes (`write_group`)."""
    import pyarrow as pa

    return pa.ipc.open_file(pa.BufferReader(data)).read_all()


def oldest_allowed(spec: RunSpec, iteration: int) -> int:
    """The oldest weights version iteration N may train on: N - 1 - s."""
    return iteration - 1 - spec.loop.max_staleness


class Slices:
    """Each home iteration's prompt rows (rlpipe.data.order.iteration_prompts), computed once."""

    def __init__(self, spec: RunSpec, run_root: str) -> None:
        from rlpipe.rollouts import table_rows
        from rlpipe.store.run_root import data_uri

        self.spec, self.run_root = spec, run_root
        self.rows = table_rows(data_uri(run_root, "train"))  # not the rows: Slices is built every iteration
        self.known: dict[int, list[int]] = {}

    def __call__(self, home: int) -> list[int]:
        from rlpipe.data.order import iteration_prompts

        if home not in self.known:
            self.known[home] = iteration_prompts(self.spec, self.run_root, self.rows, home)
        return self.known[home]


def consumed_groups(state: dict[str, Any]) -> tuple[int, set[Group]]:
    """(through, beyond): every group of homes <= through is consumed, and the groups in beyond."""
    consumed = state.get("groups_consumed") or {"through": 0, "beyond": []}
    return consumed["through"], {tuple(g) for g in consumed["beyond"]}


def consumed_after(state: dict[str, Any], taken: dict[str, Any], slices: Slices) -> dict[str, Any]:
    """state.json's groups_consumed once the groups `taken` names are consumed too."""
    through, beyond = consumed_groups(state)
    beyond |= {(g["home"], g["position"]) for g in taken["groups"]}
    while beyond and all((through + 1, p) in beyond for p in range(len(slices(through + 1)))):
        through += 1
        beyond = {g for g in beyond if g[0] != through}
    return {"through": through, "beyond": sorted(beyond)}


def producer_busy_s(beat: dict[str, Any]) -> float | None:
    """The producer's busy seconds now, from its heartbeat: the batches it finished, plus the one it has
    been sampling since `busy_since` (a batch may span several iterations at small sizes)."""
    if beat.get("busy_s") is None:
        return None
    return beat["busy_s"] + (time.time() - beat["busy_since"] if beat.get("busy_since") else 0.0)


def producer_alive(run_root: str) -> bool:
    """A heartbeat within HEARTBEAT_TIMEOUT_S."""
    beat = read_json(producer_uri(run_root))
    return beat is not None and time.time() - beat.get("time", 0.0) < HEARTBEAT_TIMEOUT_S


# --- the generate step ----------------------------------------------------------------------


def first_finished(spec: RunSpec, run_root: str, iteration: int, wanted: int) -> tuple[list[tuple], list[tuple]]:
    """(the first `wanted` finished groups iteration N may train on, the groups too old for it), each as
    `buffered` lists them; not those iteration N-1 took, until its commit retires them."""
    oldest = oldest_allowed(spec, iteration)
    before = {group["file"] for group in (taken_record(run_root, iteration - 1) or {"groups": []})["groups"]}
    listed = [entry for entry in buffered(run_root) if entry[3] not in before]
    return [g for g in listed if g[2] >= oldest][:wanted], [g for g in listed if g[2] < oldest]


def wait_for_groups(spec: RunSpec, run_root: str, iteration: int) -> tuple[dict[str, Any], int, float]:
    """(taken.json's record of the first-finished groups iteration N may train on, rows dropped as too
    stale, seconds waited): wait for as many as N's slice holds while the producer is alive."""
    dropped, waited = 0, 0.0
    wanted = len(Slices(spec, run_root)(iteration))
    waited_since = time.time()
    while True:
        chosen, stale = first_finished(spec, run_root, iteration, wanted)
        for *_, name in stale:  # too old for this run's s: the producer samples the group again
            fs, path = filesystem(join(groups_uri(run_root), name))
            dropped += spec.rollout.samples_per_prompt
            fs.rm(path)
        if len(chosen) == wanted:
            break
        if why := failed_services(run_root, "producer"):
            raise RuntimeError(
                f"iteration {iteration} waits for rollouts, but the rollout producer stopped: "
                + "; ".join(why.values())
            )
        if not producer_alive(run_root) and time.time() - waited_since > HEARTBEAT_TIMEOUT_S:
            raise RuntimeError(
                f"iteration {iteration} waits for {wanted - len(chosen)} more finished groups in "
                f"{groups_uri(run_root)}, but no rollout producer has written a heartbeat to "
                f"{producer_uri(run_root)} for {HEARTBEAT_TIMEOUT_S:.0f} s. `rlpipe run` starts one when "
                "loop.max_staleness >= 1; on a cluster, deploy it (manifests/optional/rollout-producer.yaml, "
                "RLPIPE_RUN_ROOT set to this run root), or set loop.max_staleness: 0"
            )
        time.sleep(POLL_S)
        waited += POLL_S
    groups = [{"file": name, "home": group[0], "position": group[1], "version": version}
              for _, group, version, name in chosen]  # fmt: skip
    return {"iteration": iteration, "groups": groups}, dropped, waited


def take(spec: RunSpec, run_root: str, weights: WeightRef, iteration: int, out_path: str) -> dict[str, float]:
    """Iteration N's rollouts from the buffer (v(N-1) = `weights`, the version it trains): the first
    finished groups at most loop.max_staleness versions old, as many as N's slice holds, waited for while
    the producer is alive (older ones dropped: the producer samples them again); written in the order
    they finished to `out_path`, group_id their rank, and recorded in taken.json. A rerun of an
    uncommitted iteration takes what its taken.json names."""
    import pyarrow as pa

    from rlpipe.rollouts import length_metrics, write_table

    started = time.time()
    retire(run_root, iteration - 1, spec.storage.keep_versions)  # what a kill after N-1's commit left in groups/
    previous = read_json(join(iteration_uri(run_root, iteration - 1, consumed=True), "taken.json"))
    record = taken_record(run_root, iteration)
    dropped, waited = 0, 0.0
    if record is None:
        record, dropped, waited = wait_for_groups(spec, run_root, iteration)
    tables = []
    for rank, group in enumerate(record["groups"]):  # each file read once: its rows and its sha256
        data = group_bytes(run_root, group["file"])
        digest = hashlib.sha256(data).hexdigest()
        if group.setdefault("sha256", digest) != digest:
            raise RuntimeError(f"{group['file']} changed since iteration {iteration} took it: another writer?")
        tables.append(with_column(read_group(data), "group_id", rank))
    rollouts = pa.concat_tables(tables, promote_options="default")  # token_versions: partial rollouts only
    rollouts = with_column(rollouts, "iteration", iteration)  # the iteration that trains on them
    write_table(rollouts, out_path)
    busy = producer_busy_s(read_json(producer_uri(run_root)) or {})
    record |= {"at": time.time(), "producer_busy_s": busy}
    write_json(join(iteration_uri(run_root, iteration), "taken.json"), record)

    versions = rollouts.column("weights_version").to_pylist()
    staleness = [iteration - 1 - v for v in versions]
    homes = [g["home"] for g in record["groups"]]
    metrics = (
        {
            STALENESS_MEAN: sum(staleness) / len(staleness),
            STALENESS_MAX: float(max(staleness)),
            "async/stale_rows_dropped": float(dropped),
            "async/buffer_groups": float(len(buffered(run_root)) - len(record["groups"])),
            "async/straggler_groups": float(sum(home < iteration for home in homes)),
            "async/wait_s": waited,
        }
        | length_metrics([len(t) for t in rollouts.column("completion_token_ids").to_pylist()])
        | partial_metrics(rollouts)
        | {
            f"async/staleness_{k}_fraction": staleness.count(k) / len(staleness)
            for k in range(spec.loop.max_staleness + 1)
        }
    )
    if previous and previous.get("producer_busy_s") is not None and busy is not None:
        span = record["at"] - previous["at"]
        if span > 0:
            metrics["async/generation_busy_share"] = (busy - previous["producer_busy_s"]) / span
    return metrics | {GENERATE_TIME: time.time() - started - waited}


def with_column(table: Any, name: str, value: int) -> Any:
    """`table` with int64 column `name` set to `value` in every row. Built from a numpy buffer: pa.array
    imports pandas (0.6 s in a step process)."""
    import numpy as np
    import pyarrow as pa

    column = pa.Array.from_buffers(
        pa.int64(), table.num_rows, [None, pa.py_buffer(np.full(table.num_rows, value, np.int64))]
    )
    index = table.schema.get_field_index(name)
    return table.set_column(index, table.schema.field(index), column)


def partial_metrics(rollouts: Any) -> dict[str, float]:
    """How much of the iteration partial rollouts sampled across versions (loop.partial_rollouts):
    async/partial_rows_fraction, rows whose tokens more than one version sampled, and
    async/newer_version_tokens_fraction, tokens a version newer than their row's first sampled."""
    if "token_versions" not in rollouts.column_names:
        return {}
    versions = [v for v in rollouts.column("token_versions").to_pylist() if v]
    tokens = sum(map(len, versions))
    return {
        "async/partial_rows_fraction": sum(v[-1] != v[0] for v in versions) / max(len(versions), 1),
        "async/newer_version_tokens_fraction": sum(t != v[0] for v in versions for t in v) / max(tokens, 1),
    }


# --- after the commit -----------------------------------------------------------------------


def taken_record(run_root: str, iteration: int) -> dict[str, Any] | None:
    """What iteration N's generate step took (None in a synchronous run, or before it took)."""
    return read_json(join(iteration_uri(run_root, iteration), "taken.json"))


def taken_for_commit(spec: RunSpec, run_root: str, iteration: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """What asynchronous iteration N trained on, and the groups consumed once it is committed, which its
    commit records; RuntimeError when the record is gone (never commit without it: a rerun takes the
    groups again)."""
    taken = taken_record(run_root, iteration)
    if taken is None:
        raise RuntimeError(
            f"iteration {iteration} took its rollouts from the buffer, but its record of them "
            f"({iteration_uri(run_root, iteration)}/taken.json) is gone: not committing it. "
            "Rerun `rlpipe run`: the iteration takes its groups again"
        )
    return taken, consumed_after(read_state(run_root) or {}, taken, Slices(spec, run_root))


def retire(run_root: str, committed: int, keep: int) -> None:
    """Move what the buffer's iterations <= `committed` took to consumed/ (idempotent: also what a commit
    killed before it retired leaves): first the group files taken.json names, then the directory. Keep
    the last `keep` consumed iterations. Only sync_weights calls it, once the commit is made."""
    from rlpipe.store.run_root import move

    fs, root = filesystem(buffer_uri(run_root))
    if not fs.exists(root):
        return
    for path in fs.ls(root, detail=False):
        name = path.rsplit("/", 1)[-1]
        if not (name.startswith("iter_") and int(name[5:]) <= committed):
            continue
        taken = read_json(join(buffer_uri(run_root), name, "taken.json"))
        if taken is None:  # no generate step took anything: nothing to keep
            fs.rm(path, recursive=True)
            continue
        for group in taken["groups"]:
            try:
                move(join(groups_uri(run_root), group["file"]), join(buffer_uri(run_root), name, group["file"]))
            except FileNotFoundError:  # moved before a kill
                pass
        target = iteration_uri(run_root, int(name[5:]), consumed=True)
        target_fs, target_path = filesystem(target)
        if target_fs.exists(target_path):
            target_fs.rm(target_path, recursive=True)
        target_fs.makedirs(target_path.rsplit("/", 1)[0], exist_ok=True)
        move(join(buffer_uri(run_root), name), target)
    consumed_fs, consumed = filesystem(join(buffer_uri(run_root), "consumed"))
    if consumed_fs.exists(consumed):
        for path in consumed_fs.ls(consumed, detail=False):
            name = path.rsplit("/", 1)[-1]
            if name.startswith("iter_") and int(name[5:]) <= committed - keep:
                consumed_fs.rm(path, recursive=True)
