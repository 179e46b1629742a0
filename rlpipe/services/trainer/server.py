"""The resident trainer: one long-lived process that keeps the policy, its optimizer and the
frozen reference in memory between iterations. The update step becomes a thin HTTP client,
so no iteration pays torch's imports, a model load or a cold process.

Storage stays the truth. The trainer trains only from the exact version it holds (run root,
version, sha256, training settings); any other request (a rerun after a failed sync, a
restarted trainer, another run) first reloads that version and its optimizer state from the
weight store, exactly as the per-step update does, so both give the same v(N+1). An error
drops what it holds: a failed batch may have applied some of its optimizer steps.

    POST /generate {spec, run_root, weights, iteration, rollouts_uri, cache_root} -> {metrics}
                   (rollout.engine torch: sample with the held policy, colocated as in TRL)
    POST /values   {spec, run_root, weights, iteration, scored_uri, valued_uri, cache_root} -> {metrics}
                   (PPO: the held critic's values of the scored rollouts, written to valued_uri)
    POST /evaluate {spec, run_root, weights, iteration, cache_root} -> {metrics}
    POST /update   {spec, run_root, weights, batch_uri, iteration, cache_root} -> {staged, metrics}
                   4xx/5xx -> {error, message}
    GET  /health  -> {weights: WeightRef | null}

Several processes (trainer.gpus x trainer.nodes > 1) run under torchrun, one per GPU (gloo
processes on CPU), FSDP2 sharding policy, gradients and optimizer state. Rank 0 serves HTTP and
hands each request to its main thread, which broadcasts it to every rank over a gloo group of its
own; all ranks execute it together, so FSDP's collectives line up (the same micro-batches, the same
forward passes), and rank 0 answers. Generate and evaluate: every rank samples the same prompts
with the same seed, after gathering the policy's whole weights once (distributed.gathered), and
rank 0 alone writes what they produce. Redundant, but it costs no wall time (the other GPUs would
wait anyway), needs nothing of the engines, and the decode loop runs no collectives, so processes
that stop decoding at different steps cannot deadlock; data-parallel sampling would need a decode
loop that keeps every rank's forward passes in step.

Errors: after each request the ranks exchange their outcomes. When every rank succeeded, or every
rank met the same input error (a bad request; a NaN loss, whose loss and gradient norm are reduced
over the ranks before the check, so every rank raises at the same point), rank 0 answers and the
trainer serves on, having dropped what it held. Any other failure (a rank failing alone, a
collective that timed out) leaves the process group unusable: rank 0 answers 500 with each rank's
error, then every process exits non-zero and is restarted (by `rlpipe run` locally, by the JobSet's
failure policy on a cluster), and the next request reloads from the weight store. A rank waiting in
a collective for one that failed alone waits at most --collective-timeout-s. A process that dies
takes the others down unanswered (torchrun stops them; a broken exchange ends the rest), as a
crashed one-process trainer does: the step's client asks the restarted trainer again.

Local: `rlpipe run` starts it on loopback (trainer.resident, no trainer.endpoint), under torchrun
with trainer.gpus processes when that is more than 1, and restarts it if it exits. Cluster:
`rlpipe compile` writes a JobSet that runs it under torchrun on trainer.nodes nodes
(pipelines/trainer_jobset.py), with the PVC mounted where the steps mount it.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

from rlpipe.http_json import reply_json
from rlpipe.metric_keys import EVALUATE_LOAD, GENERATE_LOAD, UPDATE_LOAD, UPDATE_TIME, VALUES_LOAD
from rlpipe.services.local_servers import LocalServers, die_with_parent
from rlpipe.spec import TRAINING_KEYS, RunSpec, parse_spec, pick, spec_to_dict
from rlpipe.steps import service_for

if TYPE_CHECKING:
    from rlpipe.training.state import Trainer


def training_settings(spec: RunSpec) -> str:
    """The spec keys that change what an update computes (a held trainer is reused only for these)."""
    return json.dumps(pick(spec_to_dict(spec), TRAINING_KEYS), sort_keys=True)


@dataclass
class Held:
    """What the service holds between requests: a trainer and the (run root, version, sha256,
    training settings) it is exactly at; empty while a request runs, until it succeeds."""

    trainer: Trainer | None = None
    key: tuple[str, int, str, str] | None = None
    waiting: int = 0  # requests waiting for the lock (work done ahead gives way to them)


def hold(request: dict[str, Any], held: Held) -> tuple[Trainer, bool]:
    """The trainer at the request's weights version: the one held, or loaded from the weight store.
    Returns (trainer, whether it was loaded)."""
    from rlpipe.store.weights import as_weight_ref
    from rlpipe.training.trainer import load_trainer

    spec = parse_spec(request["spec"])
    run_root, weights = request["run_root"], as_weight_ref(request["weights"])
    wanted = (run_root, weights["version"], weights["sha256"], training_settings(spec))
    trainer, loaded = held.trainer, held.trainer is None or held.key != wanted
    held.trainer = held.key = None
    if loaded:
        trainer = load_trainer(spec, run_root, weights, request["cache_root"])
    return trainer, loaded


def keep(held: Held, trainer: Trainer) -> None:
    weights = trainer.weights
    held.trainer = trainer
    held.key = (trainer.run_root, weights["version"], weights["sha256"], training_settings(trainer.spec))


def serve_generate(request: dict[str, Any], held: Held) -> dict[str, Any]:
    """Sample the iteration's rollouts with the held policy (torch engine) into request["rollouts_uri"]."""
    import tempfile

    from rlpipe.engines import LoadedModel, generate_rollouts
    from rlpipe.models.loading import release_memory
    from rlpipe.store.run_root import filesystem
    from rlpipe.training.distributed import gathered, world

    started = time.time()
    trainer, reloaded = hold(request, held)
    loaded = time.time()
    with tempfile.TemporaryDirectory() as tmp, gathered(trainer.policy):
        local = f"{tmp}/rollouts.parquet"
        metrics = generate_rollouts(
            trainer.spec,
            trainer.run_root,
            trainer.weights,
            int(request["iteration"]),
            local,
            request["cache_root"],
            loaded=LoadedModel(trainer.policy, trainer.tokenizer),
        )
        if world()[0] == 0:
            fs, remote = filesystem(request["rollouts_uri"])
            fs.makedirs(remote.rsplit("/", 1)[0], exist_ok=True)
            fs.put_file(local, remote)
    keep(held, trainer)
    metrics[GENERATE_LOAD] += loaded - started
    metrics |= release_memory(trainer.policy.device, "generate")
    return {"metrics": metrics | {"trainer/reloaded": float(reloaded)}}


def serve_values(request: dict[str, Any], held: Held) -> dict[str, Any]:
    """The held critic's value of every completion token of the scored rollouts (the values step)."""
    import tempfile

    from rlpipe.models.loading import release_memory
    from rlpipe.store.run_root import filesystem
    from rlpipe.training.critic import compute_values
    from rlpipe.training.distributed import world

    started = time.time()
    trainer, reloaded = hold(request, held)
    if trainer.critic is None:
        raise ValueError(f"algorithm {trainer.spec.algorithm.name} has no critic: its iterations have no values step")
    loaded = time.time()
    fs, scored_remote = filesystem(request["scored_uri"])
    _, valued_remote = filesystem(request["valued_uri"])
    with tempfile.TemporaryDirectory() as tmp:
        fs.get_file(scored_remote, f"{tmp}/scored.parquet")
        metrics = compute_values(
            trainer.spec,
            trainer.run_root,
            trainer.weights,
            f"{tmp}/scored.parquet",
            f"{tmp}/valued.parquet",
            request["cache_root"],
            critic=trainer.critic,
        )
        if world()[0] == 0:
            fs.put_file(f"{tmp}/valued.parquet", valued_remote)
    keep(held, trainer)
    metrics[VALUES_LOAD] = loaded - started
    metrics |= release_memory(trainer.policy.device, "values")
    return {"metrics": metrics | {"trainer/reloaded": float(reloaded)}}


def serve_evaluate(request: dict[str, Any], held: Held) -> dict[str, Any]:
    """Greedy held-out accuracy of the held policy; the eval metrics file is written by evaluate_policy."""
    from rlpipe.engines import LoadedModel
    from rlpipe.evaluation.accuracy import evaluate_policy
    from rlpipe.models.loading import release_memory
    from rlpipe.training.distributed import gathered, world

    started = time.time()
    trainer, reloaded = hold(request, held)
    loaded = time.time()
    with gathered(trainer.policy):
        metrics = evaluate_policy(
            trainer.spec,
            trainer.run_root,
            trainer.weights,
            int(request["iteration"]),
            request["cache_root"],
            LoadedModel(trainer.policy, trainer.tokenizer),
            record=world()[0] == 0,
        )
    keep(held, trainer)
    metrics |= release_memory(trainer.policy.device, "evaluate")
    return {"metrics": metrics | {EVALUATE_LOAD: loaded - started, "trainer/reloaded": float(reloaded)}}


def serve_update(request: dict[str, Any], held: Held) -> dict[str, Any]:
    """One update from `request`, reusing the trainer in `held` when it holds the requested version."""
    from rlpipe.models.loading import release_memory
    from rlpipe.training.checkpoints import keeps_state_in_memory
    from rlpipe.training.trainer import save_trained, train_on_batch

    started = time.time()
    trainer, reloaded = hold(request, held)
    iteration = int(request["iteration"])
    loaded = time.time()
    metrics = train_on_batch(trainer, request["batch_uri"], iteration) | trainer.replayed
    trainer.replayed = {}
    kept = request["batch_uri"] if keeps_state_in_memory(trainer.spec) else None  # to replay to v(N+1)
    staged = save_trained(trainer, iteration, request["cache_root"], batch_path=kept)
    keep(held, trainer)
    metrics |= release_memory(trainer.policy.device, "update")
    return {
        "staged": staged,
        "metrics": metrics
        | {
            UPDATE_LOAD: loaded - started,
            UPDATE_TIME: time.time() - loaded,
            "trainer/reloaded": float(reloaded),
        },
    }


PREFETCH_ROWS = 256  # per forward pass ahead: a request arriving meanwhile waits for one at most


def prefetch_proximal_logprobs(held: Held, lock: threading.Lock, iteration: int) -> None:
    """After update N the trainer holds v(N) and its core idles while sync_weights, evaluate and the next
    iteration's light steps run. Asynchronous runs with an off_policy_correction need pi_prox = v(N)'s
    log-probs of iteration N+1's rollouts, most of which are already in the rollout buffer: compute
    them now, for the groups N+1 will take as they finish, a part at a time, each under the request lock
    (a request waits at most one part). One process only: a sharded trainer's forward passes need every
    rank."""
    from rlpipe.algorithms import resolve_options
    from rlpipe.services.producer.buffer import Slices, first_finished, group_bytes, read_group
    from rlpipe.training.batching import micro_batches, token_budget
    from rlpipe.training.logprobs import sequence_key
    from rlpipe.training.off_policy import policy_logprobs

    trainer = held.trainer
    if trainer is None or service_for("generate", trainer.spec) != "producer":
        return
    if resolve_options(trainer.spec).off_policy_correction == "none":
        return
    sha256 = trainer.weights["sha256"]
    trainer.proximal = {"sha256": sha256, "logprobs": {}}
    if iteration >= trainer.spec.loop.iterations:
        return
    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)  # this thread only: yield to the steps
    started, done = time.time(), 0

    def computed_ahead() -> None:
        print(
            f"rlpipe trainer: pi_prox of iteration {iteration + 1} ahead: {done} rows, {time.time() - started:.1f} s",
            flush=True,
        )

    wanted, seen = len(Slices(trainer.spec, trainer.run_root)(iteration + 1)), set()
    while len(seen) < wanted:  # the groups iteration N+1 takes if nothing finishes before them
        chosen = first_finished(trainer.spec, trainer.run_root, iteration + 1, wanted)[0]
        names = [name for *_, name in chosen if name not in seen]
        if not names:  # the producer is still sampling them: wait, unless a request is due
            if held.waiting:
                return computed_ahead()
            time.sleep(0.05)
            continue
        try:
            tables = [read_group(group_bytes(trainer.run_root, name)) for name in names]
            rows = [row for t in tables for row in t.select(["prompt_token_ids", "completion_token_ids"]).to_pylist()]
        except FileNotFoundError:  # dropped as too stale, or taken and retired meanwhile
            return computed_ahead()
        seen |= set(names)
        groups = micro_batches(rows, token_budget(trainer.spec.trainer.micro_batch_tokens, trainer.policy.device.type))
        for part in (group[i : i + PREFETCH_ROWS] for group in groups for i in range(0, len(group), PREFETCH_ROWS)):
            if held.waiting:  # a request is due: it computes the rest (a lock is not fair to it)
                return computed_ahead()
            with lock:
                if held.trainer is not trainer or trainer.weights["sha256"] != sha256:
                    return computed_ahead()  # a request moved it on
                logprobs = policy_logprobs(trainer, part)
            trainer.proximal["logprobs"].update(zip(map(sequence_key, part), logprobs))
            done += len(part)
    return computed_ahead()


ROUTES = {"/generate": serve_generate, "/values": serve_values, "/evaluate": serve_evaluate, "/update": serve_update}
INPUT_ERRORS = (ValueError, FileNotFoundError, FloatingPointError)  # bad input, NaN loss: 422


def answer(path: str, request: dict[str, Any], held: Held) -> tuple[int, dict[str, Any]]:
    """Run one request in this process: (HTTP status, body). A failed request leaves `held` empty."""
    run_root = request.get("run_root", "")
    if run_root and "://" not in run_root and not os.path.isdir(run_root):
        return 422, {
            "error": "RunRootNotMounted",
            "message": f"the resident trainer does not see the run root {run_root}: mount it in the trainer's "
            "container at the same path as the steps (cluster: the weights PVC at cluster.mount_path; "
            "locally: rlpipe run --containers does)",
        }
    try:
        return 200, ROUTES[path](request, held)
    except INPUT_ERRORS as err:
        return 422, {"error": type(err).__name__, "message": str(err)}
    except Exception as err:  # noqa: BLE001 (reported to the step, which fails with it)
        return 500, {"error": type(err).__name__, "message": str(err)}


@dataclass
class Job:
    """A request rank 0's HTTP thread hands to its main thread, which runs it with every rank."""

    path: str
    request: dict[str, Any]
    answer: tuple[int, dict[str, Any]] = (500, {})
    done: threading.Event = field(default_factory=threading.Event)
    replied: threading.Event = field(default_factory=threading.Event)


def make_server(
    host: str, port: int, held: Held | None = None, jobs: queue.Queue[Job] | None = None
) -> ThreadingHTTPServer:
    """The HTTP server; requests run one at a time, /health answers during one. One process: each
    request runs on its handler thread. Several: it goes to `jobs`, for the main thread (run_ranks)."""
    held = held or Held()
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def _reply(self, status: int, body: dict) -> None:
            reply_json(self, status, body)

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            if self.path != "/health":
                return self._reply(404, {"error": "NotFound", "message": f"no route {self.path}"})
            trainer = held.trainer
            self._reply(200, {"weights": trainer.weights if trainer is not None else None})

        def do_POST(self) -> None:  # noqa: N802
            if self.path not in ROUTES:
                return self._reply(404, {"error": "NotFound", "message": f"no route {self.path}"})
            request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if jobs is None:
                held.waiting += 1
                with lock:
                    held.waiting -= 1
                    status, body = answer(self.path, request, held)
                self._reply(status, body)
                if self.path == "/update" and status == 200:
                    prefetch_proximal_logprobs(held, lock, int(request["iteration"]))
                return None
            job = Job(self.path, request)
            jobs.put(job)
            job.done.wait()
            try:
                self._reply(*job.answer)
            finally:
                job.replied.set()

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            print(f"rlpipe trainer: {format % args}", flush=True)

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    return server


RESTARTING = "; the trainer's processes exit and are restarted (the next request reloads from the weight store)"


def agree(status: int, body: dict[str, Any], control: Any) -> tuple[int, dict[str, Any], bool]:
    """Exchange one request's outcome between the ranks over `control`: (status and body to answer,
    whether to serve on). Serve on when every rank succeeded or met the same input error; otherwise
    answer 500 with each failing rank's error."""
    import torch.distributed as dist

    processes = dist.get_world_size()
    mine = (status, body.get("error"), body.get("message"))
    outcomes: list[Any] = [None] * processes
    dist.all_gather_object(outcomes, mine, group=control)
    if status in (200, 422) and all(outcome[:2] == mine[:2] for outcome in outcomes):
        return status, body, True
    failed = [(rank, error, text) for rank, (code, error, text) in enumerate(outcomes) if code != 200]
    errors = "; ".join(f"rank {rank} of {processes}: {error}: {text}" for rank, error, text in failed)
    return 500, {"error": failed[0][1], "message": errors + RESTARTING}, False


def run_ranks(held: Held, jobs: queue.Queue[Job], control: Any) -> int:
    """Every rank's main loop under torchrun: take each request (rank 0: from `jobs`; the others: by
    broadcast over the gloo group `control`), run it together, agree on the outcome. Returns the exit
    code once the processes must be restarted (module docstring, "Errors")."""
    import torch.distributed as dist

    rank = dist.get_rank()
    while True:
        job = jobs.get() if rank == 0 else None
        message = [(job.path, job.request) if job else None]
        try:
            dist.broadcast_object_list(message, src=0, group=control)
            status, body, serve_on = agree(*answer(*message[0], held), control)
        except RuntimeError as err:  # a process is gone: leave unanswered, as a crashed trainer does
            print(f"rlpipe trainer rank {rank}: a process is gone ({err}); exiting to be restarted", flush=True)
            return 1
        if not serve_on:
            print(f"rlpipe trainer rank {rank}: {body['message']}", flush=True)
        if job is not None:
            job.answer = (status, body)
            job.done.set()
            if not serve_on:
                job.replied.wait(timeout=30)
        if not serve_on:
            try:  # rank 0 has answered: now all go (a rank leaving first gets the others killed)
                dist.barrier(group=control)
            except RuntimeError:
                pass
            return 1


def LocalTrainer(run_root: str, gpus: int = 1, device: str = "auto") -> LocalServers:  # noqa: N802
    """One resident trainer on loopback (under torchrun with `gpus` processes when more than one);
    `<run root>/trainers/fleet.json` records it."""

    def launch(port: int) -> tuple[list[str], dict[str, str]]:
        serve = ["-m", "rlpipe.services.trainer.server", "--host", "127.0.0.1", "--port", str(port)]
        if gpus == 1:
            return [sys.executable, *serve, "--device", device], {}
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(gpus)]
        return [*torchrun, *serve, "--device", device], {}

    # started at once: its imports overlap the warm start
    return LocalServers("trainer", run_root, 1, launch, marker="rlpipe.services.trainer.server", wait_for_weights=False)


def serve(argv: list[str] | None = None) -> int:
    """Container entrypoint: serve requests until stopped (or, under torchrun, until the processes
    must restart: returns the exit code)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument(
        "--device", default="auto", help="trainer.device the processes train on: picks NCCL (cuda) or gloo (cpu)"
    )
    parser.add_argument(
        "--collective-timeout-s",
        type=float,
        default=1800.0,
        help="under torchrun: how long a rank waits in a collective for the others before it fails",
    )
    args = parser.parse_args(argv)
    import datetime

    import torch.distributed as dist

    import rlpipe.training.trainer  # noqa: F401 (torch + transformers before the first request)
    from rlpipe.models.devices import resolve_device
    from rlpipe.training.distributed import init_from_torchrun

    rank, processes = init_from_torchrun(resolve_device(args.device), args.collective_timeout_s)
    held = Held()
    if processes == 1:
        server = make_server(args.host, args.port, held)
        print(f"rlpipe trainer: serving on http://{args.host}:{args.port}", flush=True)
        server.serve_forever()
        return 0
    die_with_parent()  # torchrun starts each process in a session of its own: go when torchrun goes
    # idle ranks wait here for the next request, for as long as the trainer lives
    control = dist.new_group(backend="gloo", timeout=datetime.timedelta(days=365))
    jobs: queue.Queue[Job] = queue.Queue()
    if rank == 0:
        server = make_server(args.host, args.port, held, jobs)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        print(f"rlpipe trainer: {processes} processes, serving on http://{args.host}:{args.port}", flush=True)
    return run_ranks(held, jobs, control)


if __name__ == "__main__":
    sys.exit(serve())
