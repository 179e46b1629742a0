"""The rollout buffer: generation running ahead of training (loop.max_staleness s >= 1).

    <run root>/rollout_buffer/
      iter_000007/chunk_000.parquet ...  rollout rows of iteration 7's prompts, a chunk at a time
      iter_000007/taken.json             what iteration 7's generate step took (committed with state.json)
      consumed/iter_000007/              the same, moved here once iteration 7 committed
      producer.json                      the producer's heartbeat: pid, version held, busy seconds

Iteration N trains v(N-1) into v(N) on its own prompts: the same slice of the data a synchronous run
uses (rlpipe.engines.iteration_prompts), cut into CHUNKS chunks of groups. A chunk may come from any
committed version v(N-1-s) .. v(N-1):
    staleness = (N - 1) - version  in [0, s]
The producer (`produce`: rlpipe.services.rollout_producer's process, beside the trainer) generates the
chunks in iteration order with the latest committed version, read before each chunk: it picks a new
version up as soon as it is committed, with no barrier. It starts iteration N's chunks only once
iteration N-1-s is committed, so the buffer holds at most s iterations ahead of training (bounded on
disk; in memory, one chunk). With loop.partial_rollouts (torch engine) it also picks one up between
decode steps: the unfinished completions go on under it, each token's version recorded (LatestVersion).

The generate step of iteration N (`take`) waits for its chunks while the producer is alive, drops a
chunk older than s (counted in async/stale_rows_dropped; the producer generates it again with a newer
version), and writes the rollouts artifact from the chunks, in order, plus `taken.json`: each chunk's
rows, version and sha256. sync_weights copies that record into state.json with the commit and moves
the iteration's directory to consumed/ (`retire`). A rerun of an uncommitted iteration takes the same
chunks again; a committed one is never taken again, nor sampled again (the producer checks that the
state it listed the buffer against is still the committed one). So each prompt of the consumed range
is used exactly once, whatever is killed when.
"""

from __future__ import annotations

import hashlib
import math
import os
import time
from typing import TYPE_CHECKING, Any

from rlpipe.store.run_root import failed_services, filesystem, join, read_json, read_state, write_json

if TYPE_CHECKING:
    from threading import Event

    from rlpipe.spec import RunSpec
    from rlpipe.store.weights import WeightRef

CHUNKS = 4  # per iteration: the producer picks up a newer version between chunks
HEARTBEAT_TIMEOUT_S = 60.0  # a producer silent this long is gone: the generate step stops waiting
POLL_S = 0.05


def buffer_uri(run_root: str) -> str:
    return join(run_root, "rollout_buffer")


def iteration_uri(run_root: str, iteration: int, consumed: bool = False) -> str:
    return join(buffer_uri(run_root), *(["consumed"] if consumed else []), f"iter_{iteration:06d}")


def chunk_uri(run_root: str, iteration: int, chunk: int) -> str:
    return join(iteration_uri(run_root, iteration), f"chunk_{chunk:03d}.parquet")


def producer_uri(run_root: str) -> str:
    return join(buffer_uri(run_root), "producer.json")


def chunk_orders(order: list[int]) -> list[list[int]]:
    """The iteration's prompt rows cut into CHUNKS consecutive chunks (fewer when there are fewer rows)."""
    size = math.ceil(len(order) / CHUNKS)
    return [order[start : start + size] for start in range(0, len(order), size)]


def oldest_allowed(spec: RunSpec, iteration: int) -> int:
    """The oldest weights version iteration N may train on: N - 1 - s."""
    return iteration - 1 - spec.loop.max_staleness


def file_sha256(uri: str) -> str:
    fs, path = filesystem(uri)
    with fs.open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


# --- the producer ---------------------------------------------------------------------------


def next_chunk(spec: RunSpec, run_root: str, committed: int) -> tuple[int, int] | None:
    """(iteration, chunk) the producer generates next: the first missing chunk of iterations
    committed+1 .. committed+1+s (and at most loop.iterations); None when they are all there, or when
    state.json has moved past `committed` meanwhile (the caller reads it again).

    `committed` was read before the listing: an iteration that commits in between is retired to
    consumed/ and lists as missing. Sampling it again would write a stray iter_N beside its consumed
    record (which retire used to move over the record, taken.json and all), so a listing only counts
    when state.json is still at `committed` after it (state.json is written before retire moves)."""
    from rlpipe.engines import iteration_prompts, read_train_rows

    last = min(committed + 1 + spec.loop.max_staleness, spec.loop.iterations)
    rows = None
    todo = None
    for iteration in range(committed + 1, last + 1):
        fs, directory = filesystem(iteration_uri(run_root, iteration))
        try:
            present = {p.rsplit("/", 1)[-1] for p in fs.ls(directory, detail=False)} if fs.exists(directory) else set()
        except FileNotFoundError:  # retired meanwhile: `committed` is out of date
            return None
        rows = rows if rows is not None else read_train_rows(run_root).num_rows
        chunks = len(chunk_orders(iteration_prompts(spec, run_root, rows, iteration)))
        todo = next(((iteration, c) for c in range(chunks) if f"chunk_{c:03d}.parquet" not in present), None)
        if todo is not None:
            break
    if todo is not None and (read_state(run_root) or {}).get("iteration") != committed:
        return None  # committed meanwhile: the listing may show a retired iteration as missing
    return todo


def generate_chunk(
    spec: RunSpec, run_root: str, weights: WeightRef, iteration: int, chunk: int, cache_root: str, policy: Any
) -> dict[str, float]:
    """Sample chunk `chunk` of iteration N's prompts with `weights` and publish it atomically (a file
    is there whole or not at all: a producer killed mid-write leaves only a .tmp file)."""
    from rlpipe.engines import iteration_prompts, read_train_rows, sample_to_rollouts
    from rlpipe.store.run_root import move

    started = time.time()
    table = read_train_rows(run_root)
    orders = chunk_orders(iteration_prompts(spec, run_root, table.num_rows, iteration))
    first_group = sum(len(order) for order in orders[:chunk])
    final = chunk_uri(run_root, iteration, chunk)
    tmp = f"{final}.tmp-{os.getpid()}"
    fs, tmp_path = filesystem(tmp)
    fs.makedirs(tmp_path.rsplit("/", 1)[0], exist_ok=True)
    stream = iteration * 1_000 + chunk + 1  # each chunk its own sampling stream
    metrics = sample_to_rollouts(
        spec,
        run_root,
        weights,
        cache_root,
        table,
        orders[chunk],
        first_group,
        iteration,
        stream,
        tmp_path,
        started,
        policy,
    )
    move(tmp, final)
    return metrics


class LatestVersion:
    """The producer's policy with the torch engine: the latest committed version, a delta written into the
    model held in place. With loop.partial_rollouts the engine asks `newer()` between decode steps (it reads
    state.json at most every CHECK_S seconds), so an unfinished completion goes on under a version
    committed meanwhile (rlpipe.engines.torch_engine.sample)."""

    CHECK_S = 0.25

    def __init__(self, spec: RunSpec, run_root: str, cache_root: str) -> None:
        self.spec, self.run_root, self.cache_root = spec, run_root, cache_root
        self.model: Any = None
        self.tokenizer: Any = None
        self.held: WeightRef | None = None
        self.version = -1
        self.checked = 0.0

    def load(self, weights: WeightRef) -> None:
        from rlpipe.modeling import load_weights
        from rlpipe.store.weight_deltas import advance_in_place

        if self.held == weights:
            return
        if self.model is None or not advance_in_place(self.model, self.held, weights, self.cache_root):
            trainer = self.spec.trainer
            self.model, self.tokenizer = load_weights(weights, self.cache_root, trainer.threads, trainer.device)
            self.model.eval()
        self.held, self.version = weights, weights["version"]

    def newer(self) -> tuple[Any, int] | None:
        from rlpipe.store.weights import read_ref

        if time.time() - self.checked < self.CHECK_S:
            return None
        self.checked = time.time()
        published = (read_state(self.run_root) or {}).get("weights_version", self.version)
        if published <= self.version:
            return None
        self.load(read_ref(self.run_root, published))
        return self.model, self.version

    def policy(self) -> Any:
        from rlpipe.engines import Policy

        return Policy(self.model, self.tokenizer, self if self.spec.loop.partial_rollouts else None)


def produce(spec: RunSpec, run_root: str, cache_root: str, stop: Event, status: dict[str, Any]) -> None:
    """Generate the buffer's chunks until `stop` is set, each with the latest committed version.
    `status` (read by the heartbeat) gets the version held, the busy seconds and the chunks written."""
    from rlpipe.store.weights import read_ref

    latest = LatestVersion(spec, run_root, cache_root) if spec.rollout.engine == "torch" else None
    clear_partial_writes(run_root)
    while not stop.is_set():
        state = read_state(run_root) or {}
        if "iteration" not in state:  # not initialized yet
            stop.wait(0.5)
            continue
        todo = next_chunk(spec, run_root, state["iteration"])
        if todo is None:
            stop.wait(POLL_S)
            continue
        iteration, chunk = todo
        started = time.time()
        weights = read_ref(run_root, state["weights_version"])
        policy = None
        if latest is not None:
            if latest.version < weights["version"]:  # a partial rollout may have loaded a newer one already
                latest.load(weights)
            weights, policy = latest.held, latest.policy()
        generate_chunk(spec, run_root, weights, iteration, chunk, cache_root, policy)
        status["busy_s"] = status.get("busy_s", 0.0) + time.time() - started
        status["chunks_written"] = status.get("chunks_written", 0) + 1
        status |= {"version": weights["version"], "iteration": iteration, "chunk": chunk}
        write_heartbeat(run_root, status)  # the generate step reads busy_s from it


def clear_partial_writes(run_root: str) -> None:
    """Remove .tmp files a killed producer left mid-write."""
    fs, root = filesystem(buffer_uri(run_root))
    if fs.exists(root):
        for path in fs.find(root):
            if ".tmp-" in path.rsplit("/", 1)[-1]:
                fs.rm(path)


def write_heartbeat(run_root: str, status: dict[str, Any]) -> None:
    write_json(producer_uri(run_root), status | {"pid": os.getpid(), "time": time.time()})


def producer_alive(run_root: str) -> bool:
    """A heartbeat within HEARTBEAT_TIMEOUT_S."""
    beat = read_json(producer_uri(run_root))
    return beat is not None and time.time() - beat.get("time", 0.0) < HEARTBEAT_TIMEOUT_S


# --- the generate step ----------------------------------------------------------------------


def take(spec: RunSpec, run_root: str, weights: WeightRef, iteration: int, out_path: str) -> dict[str, float]:
    """Iteration N's rollouts from the buffer (v(N-1) = `weights`, the version it trains): wait for each
    chunk while the producer is alive, drop and await again one older than loop.max_staleness, then
    write them in order to `out_path` and record what was taken in taken.json."""
    import pyarrow as pa

    from rlpipe.engines import iteration_prompts, read_train_rows
    from rlpipe.rollouts import length_metrics, read_table, write_table

    started = time.time()
    previous = read_json(join(iteration_uri(run_root, iteration - 1, consumed=True), "taken.json"))
    ahead = sum(filesystem(iteration_uri(run_root, i))[0].exists(filesystem(iteration_uri(run_root, i))[1])
                for i in range(iteration + 1, iteration + 1 + spec.loop.max_staleness))  # fmt: skip
    chunks = len(chunk_orders(iteration_prompts(spec, run_root, read_train_rows(run_root).num_rows, iteration)))
    oldest = oldest_allowed(spec, iteration)
    tables: list[pa.Table] = []
    record: list[dict[str, Any]] = []
    dropped, waited = 0, 0.0
    waited_since = time.time()
    for chunk in range(chunks):
        uri = chunk_uri(run_root, iteration, chunk)
        fs, path = filesystem(uri)
        while True:
            if fs.exists(path):
                table = read_table(uri)
                version = min(table.column("weights_version").to_pylist())
                if version >= oldest:
                    break
                dropped += table.num_rows  # too stale for this run's s: the producer samples it again
                fs.rm(path)
            elif why := failed_services(run_root, "producer"):
                raise RuntimeError(
                    f"iteration {iteration} waits for rollouts, but the rollout producer stopped: "
                    + "; ".join(why.values())
                )
            elif not producer_alive(run_root) and time.time() - waited_since > HEARTBEAT_TIMEOUT_S:
                raise RuntimeError(
                    f"iteration {iteration} waits for rollout chunk {chunk} ({uri}), but no rollout producer has "
                    f"written a heartbeat to {producer_uri(run_root)} for {HEARTBEAT_TIMEOUT_S:.0f} s. `rlpipe run` "
                    "starts one when loop.max_staleness >= 1; on a cluster, deploy it (manifests/optional/"
                    "rollout-producer.yaml, RLPIPE_RUN_ROOT set to this run root), or set loop.max_staleness: 0"
                )
            time.sleep(POLL_S)
            waited += POLL_S
        tables.append(table)
        record.append({"chunk": chunk, "rows": table.num_rows, "version": version, "sha256": file_sha256(uri)})
    rollouts = pa.concat_tables(tables, promote_options="default")  # token_versions: partial rollouts only
    write_table(rollouts, out_path)
    beat = read_json(producer_uri(run_root)) or {}
    taken = {"iteration": iteration, "chunks": record, "at": time.time(), "producer_busy_s": beat.get("busy_s")}
    write_json(join(iteration_uri(run_root, iteration), "taken.json"), taken)

    versions = rollouts.column("weights_version").to_pylist()
    staleness = [iteration - 1 - v for v in versions]
    metrics = (
        {
            "async/staleness_mean": sum(staleness) / len(staleness),
            "async/staleness_max": float(max(staleness)),
            "async/stale_rows_dropped": float(dropped),
            "async/buffer_depth": float(ahead),
            "async/wait_s": waited,
        }
        | length_metrics([len(t) for t in rollouts.column("completion_token_ids").to_pylist()])
        | partial_metrics(rollouts)
        | {
            f"async/staleness_{k}_fraction": staleness.count(k) / len(staleness)
            for k in range(spec.loop.max_staleness + 1)
        }
    )
    if previous and previous.get("producer_busy_s") is not None and beat.get("busy_s") is not None:
        span = taken["at"] - previous["at"]
        if span > 0:
            metrics["async/generation_busy_share"] = (beat["busy_s"] - previous["producer_busy_s"]) / span
    return metrics | {"time/generate_s": time.time() - started - waited}


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
    """What iteration N's generate step took (None in a synchronous run)."""
    return read_json(join(iteration_uri(run_root, iteration), "taken.json"))


def taken_for_commit(run_root: str, iteration: int) -> dict[str, Any]:
    """What asynchronous iteration N trained on, which its commit records; RuntimeError when the record
    is gone (never commit without it: a rerun takes the chunks again)."""
    taken = taken_record(run_root, iteration)
    if taken is None:
        raise RuntimeError(
            f"iteration {iteration} took its rollouts from the buffer, but its record of them "
            f"({iteration_uri(run_root, iteration)}/taken.json) is gone: not committing it. "
            "Rerun `rlpipe run`: the iteration takes its chunks again"
        )
    return taken


def retire(run_root: str, committed: int, keep: int) -> None:
    """Move the buffer's iterations <= `committed` to consumed/ (idempotent: also what a commit killed
    before it retired leaves), and keep the last `keep` consumed iterations. Only sync_weights calls it,
    once the commit is made. The producer does not write to an iteration <= committed (next_chunk checks
    the state after its listing); a directory without taken.json, which no generate step took, is
    deleted, never moved over the record of what the iteration trained on."""
    from rlpipe.store.run_root import move

    fs, root = filesystem(buffer_uri(run_root))
    if not fs.exists(root):
        return
    for path in fs.ls(root, detail=False):
        name = path.rsplit("/", 1)[-1]
        if name.startswith("iter_") and int(name[5:]) <= committed:
            if not fs.exists(join(path, "taken.json")):
                # no generate step took it: chunks a producer wrote after the iteration committed (it
                # read the state before the commit). Never moved over consumed/iter_N, N's record
                fs.rm(path, recursive=True)
                continue
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
