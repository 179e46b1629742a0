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
    POST /evaluate {spec, run_root, weights, iteration, cache_root} -> {metrics}
    POST /update   {spec, run_root, weights, batch_uri, iteration, cache_root} -> {staged, metrics}
                   4xx/5xx -> {error, message}
    GET  /health  -> {weights: WeightRef | null}

Local: `rlpipe run` starts it on loopback (trainer.resident, no trainer.endpoint) and
restarts it if it exits. Cluster: `python -m rlpipe.services.trainer_service --port 8001` in the
trainer image (manifests/base/trainer.yaml), with the PVC mounted where the steps mount it.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

from rlpipe.services.local_servers import LocalServers
from rlpipe.spec import TRAINING_KEYS, RunSpec, parse_spec, pick, spec_to_dict

if TYPE_CHECKING:
    from rlpipe.training.trainer import Trainer


def training_settings(spec: RunSpec) -> str:
    """The spec keys that change what an update computes (a held trainer is reused only for these)."""
    return json.dumps(pick(spec_to_dict(spec), TRAINING_KEYS), sort_keys=True)


@dataclass
class Held:
    """What the service holds between requests: a trainer and the (run root, version, sha256,
    training settings) it is exactly at; empty while a request runs, until it succeeds."""

    trainer: Trainer | None = None
    key: tuple[str, int, str, str] | None = None


def hold(request: dict[str, Any], held: Held) -> tuple[Trainer, bool]:
    """The trainer at the request's weights version: the one held, or loaded from the weight store.
    Returns (trainer, whether it was loaded)."""
    from rlpipe.store.weights import as_ref
    from rlpipe.training.trainer import load_trainer

    spec = parse_spec(request["spec"])
    run_root, weights = request["run_root"], as_ref(request["weights"])
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

    from rlpipe.engines import Policy, generate_rollouts
    from rlpipe.modeling import release_memory
    from rlpipe.store.run_root import filesystem

    started = time.time()
    trainer, reloaded = hold(request, held)
    loaded = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        local = f"{tmp}/rollouts.parquet"
        metrics = generate_rollouts(
            trainer.spec,
            trainer.run_root,
            trainer.weights,
            int(request["iteration"]),
            local,
            request["cache_root"],
            policy=Policy(trainer.policy, trainer.tokenizer),
        )
        fs, remote = filesystem(request["rollouts_uri"])
        fs.makedirs(remote.rsplit("/", 1)[0], exist_ok=True)
        fs.put_file(local, remote)
    keep(held, trainer)
    metrics["overhead/generate_load_s"] += loaded - started
    metrics |= release_memory(trainer.policy.device, "generate")
    return {"metrics": metrics | {"trainer/reloaded": float(reloaded)}}


def serve_evaluate(request: dict[str, Any], held: Held) -> dict[str, Any]:
    """Greedy held-out accuracy of the held policy; the eval metrics file is written by evaluate_policy."""
    from rlpipe.engines import Policy
    from rlpipe.evaluation import evaluate_policy
    from rlpipe.modeling import release_memory

    started = time.time()
    trainer, reloaded = hold(request, held)
    loaded = time.time()
    policy = Policy(trainer.policy, trainer.tokenizer)
    metrics = evaluate_policy(
        trainer.spec, trainer.run_root, trainer.weights, int(request["iteration"]), request["cache_root"], policy
    )
    keep(held, trainer)
    metrics |= release_memory(trainer.policy.device, "evaluate")
    return {"metrics": metrics | {"overhead/evaluate_load_s": loaded - started, "trainer/reloaded": float(reloaded)}}


def serve_update(request: dict[str, Any], held: Held) -> dict[str, Any]:
    """One update from `request`, reusing the trainer in `held` when it holds the requested version."""
    from rlpipe.modeling import release_memory
    from rlpipe.training.trainer import save_trained, train_on_batch

    started = time.time()
    trainer, reloaded = hold(request, held)
    iteration = int(request["iteration"])
    loaded = time.time()
    metrics = train_on_batch(trainer, request["batch_uri"], iteration)
    staged = save_trained(trainer, iteration, request["cache_root"])
    keep(held, trainer)
    metrics |= release_memory(trainer.policy.device, "update")
    return {
        "staged": staged,
        "metrics": metrics
        | {
            "overhead/update_load_s": loaded - started,
            "time/update_s": time.time() - loaded,
            "trainer/reloaded": float(reloaded),
        },
    }


ROUTES = {"/generate": serve_generate, "/evaluate": serve_evaluate, "/update": serve_update}


def make_server(host: str, port: int) -> ThreadingHTTPServer:
    """The HTTP server; requests run one at a time, /health answers during one."""
    held = Held()
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def _reply(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            if self.path != "/health":
                return self._reply(404, {"error": "NotFound", "message": f"no route {self.path}"})
            trainer = held.trainer
            self._reply(200, {"weights": trainer.weights if trainer is not None else None})

        def do_POST(self) -> None:  # noqa: N802
            route = ROUTES.get(self.path)
            if route is None:
                return self._reply(404, {"error": "NotFound", "message": f"no route {self.path}"})
            request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with lock:
                try:
                    body = route(request, held)
                except (ValueError, FileNotFoundError, FloatingPointError) as err:  # bad input, NaN loss
                    return self._reply(422, {"error": type(err).__name__, "message": str(err)})
                except Exception as err:  # noqa: BLE001 (reported to the step, which fails with it)
                    return self._reply(500, {"error": type(err).__name__, "message": str(err)})
            self._reply(200, body)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            print(f"rlpipe trainer: {format % args}", flush=True)

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    return server


def LocalTrainer(run_root: str) -> LocalServers:  # noqa: N802 (reads as the thing it builds)
    """One resident trainer on loopback; `<run root>/trainers/fleet.json` records it."""

    def launch(port: int) -> tuple[list[str], dict[str, str]]:
        return [sys.executable, "-m", "rlpipe.services.trainer_service", "--host", "127.0.0.1", "--port", str(port)], {}

    # started at once: its imports overlap the warm start
    return LocalServers(
        "trainer", run_root, 1, launch, marker="rlpipe.services.trainer_service", wait_for_weights=False
    )


def serve(argv: list[str] | None = None) -> None:
    """Container entrypoint: serve updates until stopped."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=8001)
    args = parser.parse_args(argv)
    import rlpipe.training.trainer  # noqa: F401 (torch + transformers before the first request)

    server = make_server(args.host, args.port)
    print(f"rlpipe trainer: serving on http://{args.host}:{args.port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    serve()
