"""The resident trainer: one long-lived process that keeps a trainer session (the policy, its
optimizer and the frozen reference: rlpipe.training.session) in memory between iterations. The
update step becomes a thin HTTP client, so no iteration pays torch's imports, a model load or a
cold process. This module is the wire: HTTP, which version the kept session is at, and the ranks'
protocol; the work is the session's, the same the per-step update does.

Storage stays the truth. The trainer trains only from the exact version its session is at (run
root, version, sha256, training settings: the key); any other request (a rerun after a failed sync,
a restarted trainer, another run) first opens a session at that version from the weight store,
exactly as the per-step update does, so both give the same v(N+1). An error drops the session: a
failed batch may have applied some of its optimizer steps.

    POST /generate {spec, run_root, weights, iteration, rollouts_uri, cache_root} -> {metrics}
                   (rollout.engine torch: sample with the session's policy, colocated as in TRL)
    POST /values   {spec, run_root, weights, iteration, scored_uri, valued_uri, cache_root} -> {metrics}
                   (PPO: the session's critic's values of the scored rollouts, written to valued_uri)
    POST /evaluate {spec, run_root, weights, iteration, cache_root} -> {metrics}
    POST /update   {spec, run_root, weights, batch_uri, iteration, cache_root} -> {staged, metrics}
                   4xx/5xx -> {error, message}
    POST /offload  {weights: bool, ...} -> {seconds, bytes}   (sharing.enabled: the device given back between
    POST /onload   {...} -> {seconds, bytes}                   its turns, rlpipe.training.offload; each rank its own)
    GET  /health  -> {weights: WeightRef | null}

Each POST it serves is appended to <run root>/logs/trainer-requests.jsonl: {path, iteration, status, began,
ended} (wall-clock seconds: while one process holds the request lock; several, from the request's arrival), the
record the samplers' request logs are laid beside (rlpipe.services.samplers.request_log).

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
trainer serves on, having dropped its session. Any other failure (a rank failing alone, a
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
    from rlpipe.training.session import TrainerSession


def training_settings(spec: RunSpec) -> str:
    """The spec keys that change what an update computes (a kept session is reused only for these)."""
    return json.dumps(pick(spec_to_dict(spec), TRAINING_KEYS), sort_keys=True)


@dataclass
class Resident:
    """What the service keeps between requests: a trainer session and the (run root, version, sha256,
    training settings) it is exactly at; empty while a request runs, until it succeeds."""

    session: TrainerSession | None = None
    key: tuple[str, int, str, str] | None = None
    waiting: int = 0  # requests waiting for the lock (work done ahead gives way to them)

    def take(self, request: dict[str, Any]) -> tuple[TrainerSession, bool]:
        """The session at the request's weights version: the one kept, or opened from the weight store.
        Returns (session, whether it was opened); the resident is empty until `keep`."""
        from rlpipe.store.weights import as_weight_ref
        from rlpipe.training.session import TrainerSession

        spec = parse_spec(request["spec"])
        run_root, weights = request["run_root"], as_weight_ref(request["weights"])
        wanted = (run_root, weights["version"], weights["sha256"], training_settings(spec))
        session, opened = self.session, self.session is None or self.key != wanted
        self.session = self.key = None
        if opened:
            session = TrainerSession.open(spec, run_root, weights, request["cache_root"])
        assert session is not None  # opened, or the kept one (not opened: self.session was there)
        session.onload()  # offloaded between turns (sharing) and asked without /onload first: back on the device
        return session, opened

    def keep(self, session: TrainerSession) -> None:
        weights = session.weights
        self.session = session
        self.key = (session.run_root, weights["version"], weights["sha256"], training_settings(session.spec))


def serve_generate(request: dict[str, Any], resident: Resident) -> dict[str, Any]:
    """Sample the iteration's rollouts with the session's policy (torch engine) into request["rollouts_uri"]."""
    started = time.time()
    session, opened = resident.take(request)
    loaded = time.time()
    metrics = session.generate(int(request["iteration"]), request["rollouts_uri"])
    resident.keep(session)
    metrics[GENERATE_LOAD] += loaded - started
    return {"metrics": metrics | {"trainer/reloaded": float(opened)}}


def serve_values(request: dict[str, Any], resident: Resident) -> dict[str, Any]:
    """The session's critic's value of every completion token of the scored rollouts (the values step)."""
    started = time.time()
    session, opened = resident.take(request)
    loaded = time.time()
    metrics = session.values(request["scored_uri"], request["valued_uri"])
    resident.keep(session)
    metrics[VALUES_LOAD] = loaded - started
    return {"metrics": metrics | {"trainer/reloaded": float(opened)}}


def serve_evaluate(request: dict[str, Any], resident: Resident) -> dict[str, Any]:
    """Greedy held-out accuracy of the session's policy; the eval metrics file is written by evaluate_policy."""
    started = time.time()
    session, opened = resident.take(request)
    loaded = time.time()
    metrics = session.evaluate(int(request["iteration"]))
    resident.keep(session)
    return {"metrics": metrics | {EVALUATE_LOAD: loaded - started, "trainer/reloaded": float(opened)}}


def serve_update(request: dict[str, Any], resident: Resident) -> dict[str, Any]:
    """One update from `request`, reusing the kept session when it is at the requested version."""
    started = time.time()
    session, opened = resident.take(request)
    loaded = time.time()
    staged, metrics = session.update(request["batch_uri"], int(request["iteration"]))
    resident.keep(session)
    return {
        "staged": staged,
        "metrics": metrics
        | {UPDATE_LOAD: loaded - started, UPDATE_TIME: time.time() - loaded, "trainer/reloaded": float(opened)},
    }


def serve_offload(request: dict[str, Any], resident: Resident) -> dict[str, Any]:
    """The kept session's device memory given back (optimizer state, gradients; its weights with
    request["weights"]); nothing to do without one."""
    session = resident.session
    return session.offload(bool(request.get("weights"))) if session else {"seconds": 0.0, "bytes": 0.0}


def serve_onload(request: dict[str, Any], resident: Resident) -> dict[str, Any]:
    """What /offload moved, back on the device; nothing to do without a session."""
    session = resident.session
    return session.onload() if session else {"seconds": 0.0, "bytes": 0.0}


def log_request(path: str, request: dict[str, Any], status: int, began: float) -> None:
    """One line of <run root>/logs/trainer-requests.jsonl for a request served (a run root this process sees)."""
    run_root = request.get("run_root", "")
    if not run_root or "://" in run_root or not os.path.isdir(run_root):
        return
    line = {"path": path, "iteration": request.get("iteration"), "status": status, "began": began}
    os.makedirs(os.path.join(run_root, "logs"), exist_ok=True)
    with open(os.path.join(run_root, "logs", "trainer-requests.jsonl"), "a") as f:
        f.write(json.dumps(line | {"ended": time.time()}) + "\n")


PREFETCH_ROWS = 256  # per forward pass ahead: a request arriving meanwhile waits for one at most


def prefetch_proximal_logprobs(resident: Resident, lock: threading.Lock, iteration: int) -> None:
    """After update N the session is at v(N) and its core idles while sync_weights, evaluate and the next
    iteration's light steps run. Asynchronous runs with an off_policy_correction need pi_prox = v(N)'s
    log-probs of iteration N+1's rollouts, most of which are already in the rollout buffer: compute
    them now, for the groups N+1 will take as they finish, a part at a time, each under the request lock
    (a request waits at most one part). One process only: a sharded trainer's forward passes need every
    rank."""
    from rlpipe.algorithms import resolve_options
    from rlpipe.services.producer.buffer import Slices, first_finished, group_bytes, read_group

    session = resident.session
    if session is None or service_for("generate", session.spec) != "producer":
        return
    if resolve_options(session.spec).off_policy_correction == "none":
        return
    sha256 = session.weights["sha256"]
    session.start_proximal()
    if iteration >= session.spec.loop.iterations:
        return
    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)  # this thread only: yield to the steps
    started, done = time.time(), 0

    def computed_ahead() -> None:
        print(
            f"rlpipe trainer: pi_prox of iteration {iteration + 1} ahead: {done} rows, {time.time() - started:.1f} s",
            flush=True,
        )

    wanted = len(Slices(session.spec, session.run_root)(iteration + 1))
    seen: set[str] = set()  # the groups' names
    while len(seen) < wanted:  # the groups iteration N+1 takes if nothing finishes before them
        chosen = first_finished(session.spec, session.run_root, iteration + 1, wanted)[0]
        names = [name for *_, name in chosen if name not in seen]
        if not names:  # the producer is still sampling them: wait, unless a request is due
            if resident.waiting:
                return computed_ahead()
            time.sleep(0.05)
            continue
        try:
            tables = [read_group(group_bytes(session.run_root, name)) for name in names]
            rows = [row for t in tables for row in t.select(["prompt_token_ids", "completion_token_ids"]).to_pylist()]
        except FileNotFoundError:  # dropped as too stale, or taken and retired meanwhile
            return computed_ahead()
        seen |= set(names)
        for part in session.proximal_parts(rows, PREFETCH_ROWS):
            if resident.waiting:  # a request is due: it computes the rest (a lock is not fair to it)
                return computed_ahead()
            with lock:
                if resident.session is not session or session.weights["sha256"] != sha256:
                    return computed_ahead()  # a request moved it on
                session.add_proximal(part)
            done += len(part)
    return computed_ahead()


ROUTES = {
    "/generate": serve_generate,
    "/values": serve_values,
    "/evaluate": serve_evaluate,
    "/update": serve_update,
    "/offload": serve_offload,
    "/onload": serve_onload,
}
INPUT_ERRORS = (ValueError, FileNotFoundError, FloatingPointError)  # bad input, NaN loss: 422


def answer(path: str, request: dict[str, Any], resident: Resident) -> tuple[int, dict[str, Any]]:
    """Run one request in this process: (HTTP status, body). A failed request leaves `resident` empty."""
    run_root = request.get("run_root", "")
    if run_root and "://" not in run_root and not os.path.isdir(run_root):
        return 422, {
            "error": "RunRootNotMounted",
            "message": f"the resident trainer does not see the run root {run_root}: mount it in the trainer's "
            "container at the same path as the steps (cluster: the weights PVC at cluster.mount_path; "
            "locally: rlpipe run --containers does)",
        }
    try:
        return 200, ROUTES[path](request, resident)
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
    host: str, port: int, resident: Resident | None = None, jobs: queue.Queue[Job] | None = None
) -> ThreadingHTTPServer:
    """The HTTP server; requests run one at a time, /health answers during one. One process: each
    request runs on its handler thread. Several: it goes to `jobs`, for the main thread (run_ranks)."""
    kept: Resident = resident or Resident()  # a name the handler's methods see as set
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def _reply(self, status: int, body: dict) -> None:
            reply_json(self, status, body)

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            if self.path != "/health":
                return self._reply(404, {"error": "NotFound", "message": f"no route {self.path}"})
            session = kept.session
            self._reply(200, {"weights": session.weights if session is not None else None})

        def do_POST(self) -> None:  # noqa: N802
            if self.path not in ROUTES:
                return self._reply(404, {"error": "NotFound", "message": f"no route {self.path}"})
            request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if jobs is None:
                kept.waiting += 1
                with lock:
                    kept.waiting -= 1
                    began = time.time()
                    status, body = answer(self.path, request, kept)
                    log_request(self.path, request, status, began)
                self._reply(status, body)
                if self.path == "/update" and status == 200:
                    prefetch_proximal_logprobs(kept, lock, int(request["iteration"]))
                return None
            job, began = Job(self.path, request), time.time()
            jobs.put(job)
            job.done.wait()
            log_request(self.path, request, job.answer[0], began)
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


def run_ranks(resident: Resident, jobs: queue.Queue[Job], control: Any) -> int:
    """Every rank's main loop under torchrun: take each request (rank 0: from `jobs`; the others: by
    broadcast over the gloo group `control`), run it together, agree on the outcome. Returns the exit
    code once the processes must be restarted (module docstring, "Errors")."""
    import torch.distributed as dist

    rank = dist.get_rank()
    while True:
        job = jobs.get() if rank == 0 else None
        message: list[tuple[str, dict[str, Any]] | None] = [(job.path, job.request) if job else None]
        try:
            dist.broadcast_object_list(message, src=0, group=control)
            received = message[0]
            assert received is not None  # rank 0 always sends one: jobs.get() waits for a request
            status, body, serve_on = agree(*answer(*received, resident), control)
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

    from rlpipe.training.session import join_processes  # torch + transformers before the first request

    rank, processes = join_processes(args.device, args.collective_timeout_s)
    resident = Resident()
    if processes == 1:
        server = make_server(args.host, args.port, resident)
        print(f"rlpipe trainer: serving on http://{args.host}:{args.port}", flush=True)
        server.serve_forever()
        return 0
    die_with_parent()  # torchrun starts each process in a session of its own: go when torchrun goes
    # idle ranks wait here for the next request, for as long as the trainer lives
    control = dist.new_group(backend="gloo", timeout=datetime.timedelta(days=365))
    jobs: queue.Queue[Job] = queue.Queue()
    if rank == 0:
        server = make_server(args.host, args.port, resident, jobs)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        print(f"rlpipe trainer: {processes} processes, serving on http://{args.host}:{args.port}", flush=True)
    return run_ranks(resident, jobs, control)


if __name__ == "__main__":
    sys.exit(serve())
