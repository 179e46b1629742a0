"""The rollout producer: a long-lived process that keeps generating into the run's rollout buffer
while the trainer updates (loop.max_staleness >= 1; rlpipe.services.producer.buffer has the protocol). It samples
the groups no iteration has consumed and the buffer lacks, a batch at a time with the latest committed
version, and writes each group as it finishes (`produce`).

Local: `rlpipe run` starts it once the weight store has v0, restarts it when it exits, and stops it
when the driver exits (rlpipe.services.local_servers). Cluster: the same command is the producer
Deployment's entrypoint (manifests/optional/rollout-producer.yaml), mounting the run root where the
steps do; it reads the spec the prepare step wrote to <run root>/spec.json. It samples with rollout.engine:
torch (its own copy of the policy, reloaded when a newer version is committed) or sampler (the vLLM
samplers, reloaded in place by the same pull).

    python -m rlpipe.services.producer.server --run-root R [--spec R/spec.json] [--port 8002]

GET /health answers 200 with the producer's status (version held, busy seconds, groups written);
<run root>/rollout_buffer/producer.json carries the same as a heartbeat, every HEARTBEAT_S.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

from rlpipe.http_json import reply_json
from rlpipe.services.local_servers import LocalServers
from rlpipe.services.producer.buffer import (
    POLL_S,
    Group,
    Slices,
    buffer_uri,
    buffered,
    consumed_groups,
    group_file,
    groups_uri,
    producer_uri,
    with_column,
    write_group,
)
from rlpipe.store.run_root import filesystem, join, read_state, write_json

if TYPE_CHECKING:
    from threading import Event

    from rlpipe.spec import RunSpec
    from rlpipe.store.weights import WeightRef


def next_groups(spec: RunSpec, run_root: str, state: dict[str, Any], slices: Slices, limit: int) -> list[Group] | None:
    """The first `limit` groups the producer samples next: of homes up to committed + 1 + s (and at most
    loop.iterations), neither consumed nor in the buffer. None when state.json has moved past `state`
    meanwhile (the caller reads it again): a commit between reading the state and the listing would
    show the groups it retired as neither."""
    present = {group for _, group, _, _ in buffered(run_root)}
    if (read_state(run_root) or {}).get("iteration") != state["iteration"]:
        return None
    through, beyond = consumed_groups(state)
    done = beyond | present
    last = min(state["iteration"] + 1 + spec.loop.max_staleness, spec.loop.iterations)
    todo: list[Group] = []
    for home in range(through + 1, last + 1):
        todo += [(home, p) for p in range(len(slices(home))) if (home, p) not in done]
        if len(todo) >= limit:
            break
    return todo[:limit]


def sample_to_buffer(
    spec: RunSpec, run_root: str, weights: WeightRef, groups: list[Group], slices: Slices, cache_root: str, loaded: Any
) -> None:
    """Sample `groups` with `weights` (`loaded`: the producer's model at them) and write each to the buffer
    as it finishes, atomically (a file is there whole or not at all: a producer killed mid-write leaves
    only a .tmp file). A group's sequence number orders it among the finished."""
    from dataclasses import replace

    from rlpipe.engines import read_train_rows, rollout_table, sample_rows
    from rlpipe.store.run_root import move

    if spec.rollout.engine == "sampler":  # the samplers reload the version the producer pulled
        from rlpipe.services.samplers.client import serve_version

        serve_version(spec, run_root, weights)
    table = read_train_rows(run_root)
    order = [slices(home)[position] for home, position in groups]
    samples = spec.rollout.samples_per_prompt
    sequence = max((s for s, *_ in buffered(run_root)), default=-1) + 1
    written: set[int] = set()
    fs, directory = filesystem(groups_uri(run_root))
    fs.makedirs(directory, exist_ok=True)

    def write(indices: list[int], sampled: Any) -> None:
        nonlocal sequence
        if not indices:
            return
        positions = [groups[i][1] for i in indices]
        rollouts = rollout_table(spec, table, [order[i] for i in indices], positions, 0, sampled, weights)
        for k, i in enumerate(indices):
            rows = with_column(rollouts.slice(k * samples, samples), "iteration", groups[i][0])  # its home
            version = min(rows.column("weights_version").to_pylist())
            final = join(groups_uri(run_root), group_file(sequence, groups[i], version))
            tmp = f"{final}.tmp-{os.getpid()}"
            write_group(tmp, rows)
            move(tmp, final)
            sequence += 1
            written.add(i)

    def publish(indices: list[int], completions: Any) -> None:  # the torch engine, mid-batch
        from rlpipe.engines import Sampled

        texts = loaded.tokenizer.batch_decode(completions.token_ids, skip_special_tokens=True)
        columns = {"token_versions": completions.token_versions} if completions.token_versions is not None else {}
        write(indices, Sampled(completions, texts, time.time(), {}, columns))

    single_turn_torch = loaded is not None and spec.rollout.environment is None
    stream = 1_000_000 + groups[0][0] * 10_000 + groups[0][1]  # each batch its own sampling stream
    sampled = sample_rows(spec, run_root, weights, cache_root, table, order, stream,
                          replace(loaded, publish=publish) if single_turn_torch else loaded)  # fmt: skip
    rest = [i for i in range(len(groups)) if i not in written]  # every group (other engines, multi-turn), or none
    write(rest, sampled.select([i * samples + k for i in rest for k in range(samples)]))


class LatestVersion:
    """The producer's policy with the torch engine: the latest committed version, a delta written into the
    model held in place. With loop.partial_rollouts the engine asks `newer()` between decode steps (it reads
    state.json at most every CHECK_S seconds), so an unfinished completion goes on under a version
    committed meanwhile (rlpipe.engines.torch_engine.hf_decode)."""

    CHECK_S = 0.25

    def __init__(self, spec: RunSpec, run_root: str, cache_root: str) -> None:
        self.spec, self.run_root, self.cache_root = spec, run_root, cache_root
        self.model: Any = None
        self.tokenizer: Any = None
        self.held: WeightRef | None = None
        self.version = -1
        self.checked = 0.0

    def load(self, weights: WeightRef) -> None:
        from rlpipe.models.loading import load_weights
        from rlpipe.store.weights import advance_in_place

        if self.held == weights:
            return
        held = self.held  # None exactly while no model is loaded
        if self.model is None or held is None or not advance_in_place(self.model, held, weights, self.cache_root):
            trainer = self.spec.trainer
            self.model, self.tokenizer = load_weights(weights, self.cache_root, trainer.threads, trainer.device)
            self.model.eval()
        self.held, self.version = weights, weights["version"]

    def newer(self) -> tuple[Any, int] | None:
        from rlpipe.store.weights import read_weight_ref

        if time.time() - self.checked < self.CHECK_S:
            return None
        self.checked = time.time()
        published = (read_state(self.run_root) or {}).get("weights_version", self.version)
        if published <= self.version:
            return None
        self.load(read_weight_ref(self.run_root, published))
        return self.model, self.version

    def loaded_model(self) -> Any:
        from rlpipe.engines import LoadedModel

        return LoadedModel(self.model, self.tokenizer, self if self.spec.loop.partial_rollouts else None)


def produce(spec: RunSpec, run_root: str, cache_root: str, stop: Event, status: dict[str, Any]) -> None:
    """Sample the buffer's groups until `stop` is set, a batch at a time, each with the latest committed
    version. `status` (read by the heartbeat) gets the version held, the busy seconds and the groups written."""
    from rlpipe.store.weights import read_weight_ref

    latest = LatestVersion(spec, run_root, cache_root) if spec.rollout.engine == "torch" else None
    per_batch = max(1, spec.rollout.batch_size // spec.rollout.samples_per_prompt)
    slices: Slices | None = None
    clear_partial_writes(run_root)
    while not stop.is_set():
        state = read_state(run_root) or {}
        if "iteration" not in state:  # not initialized yet
            stop.wait(0.5)
            continue
        slices = slices or Slices(spec, run_root)
        todo = next_groups(spec, run_root, state, slices, per_batch)
        if not todo:
            stop.wait(POLL_S)
            continue
        started = status["busy_since"] = time.time()  # the heartbeat counts the batch while it runs
        weights = read_weight_ref(run_root, state["weights_version"])
        loaded = None
        if latest is not None:
            if latest.version < weights["version"]:  # a partial rollout may have loaded a newer one already
                latest.load(weights)
            assert latest.held is not None  # loaded above, or for an earlier batch (its version is >= 0)
            weights, loaded = latest.held, latest.loaded_model()
        sample_to_buffer(spec, run_root, weights, todo, slices, cache_root, loaded)
        status["busy_s"], status["busy_since"] = status.get("busy_s", 0.0) + time.time() - started, None
        status["groups_written"] = status.get("groups_written", 0) + len(todo)
        status |= {"version": weights["version"], "group": list(todo[-1])}
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


HEARTBEAT_S = 2.0
NICENESS = 10  # lower priority than the trainer and the pipeline's steps
MARKER = "rlpipe.services.producer.server"


def LocalProducer(run_root: str, spec_path: str, cache_root: str) -> LocalServers:  # noqa: N802
    """One producer on loopback, started once v0 is published; `<run root>/producers/fleet.json` records it."""

    def launch(port: int) -> tuple[list[str], dict[str, str]]:
        argv = ["-m", MARKER, "--run-root", run_root, "--spec", spec_path, "--cache-root", cache_root]
        return [sys.executable, *argv, "--host", "127.0.0.1", "--port", str(port)], {}

    return LocalServers("producer", run_root, 1, launch, marker=MARKER, wait_for_weights=True)


def health_server(host: str, port: int, status: dict[str, Any]) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            reply_json(self, 200 if self.path == "/health" else 404, status)

        def log_message(self, *args: Any) -> None:
            pass

    return ThreadingHTTPServer((host, port), Handler)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-root", default=os.environ.get("RLPIPE_RUN_ROOT"), help="default: $RLPIPE_RUN_ROOT")
    parser.add_argument("--spec", help="the run's spec as JSON (default: <run root>/spec.json)")
    parser.add_argument("--cache-root", help="default: the spec's storage cache")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=8002)
    args = parser.parse_args(argv)
    if not args.run_root:
        parser.error("--run-root (or RLPIPE_RUN_ROOT) is required: the run root the pipeline's steps use")

    from rlpipe.spec import parse_spec
    from rlpipe.store.run_root import cache_root_for, read_json

    # The producer works ahead, with slack: on a machine it shares with the trainer and the steps, it
    # yields the cores to them (their work is the iteration's critical path).
    os.nice(NICENESS)
    data: Any = read_json(args.spec or join(args.run_root, "spec.json"))  # None (no file): parse_spec says so
    spec = parse_spec(data)
    cache_root = args.cache_root or cache_root_for(spec.storage.root, spec.storage.cache)
    status: dict[str, Any] = {"busy_s": 0.0, "groups_written": 0, "version": None}
    stop = threading.Event()
    # SIGTERM keeps its default action: the kernel ends the process at once, mid-batch too (a group lands
    # by an atomic rename or not at all, as under kill -9). A Python handler would have to be scheduled
    # first, and at NICENESS beside a busy trainer that took up to 30 s: longer than `rlpipe run` waits.
    server = health_server(args.host, args.port, status)
    threading.Thread(target=server.serve_forever, daemon=True).start()

    def beat() -> None:
        while not stop.wait(HEARTBEAT_S):
            write_heartbeat(args.run_root, status)

    write_heartbeat(args.run_root, status)
    threading.Thread(target=beat, daemon=True).start()
    print(f"rlpipe producer: run root {args.run_root}, serving /health on {args.host}:{args.port}", flush=True)
    produce(spec, args.run_root, cache_root, stop, status)
    server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
