"""The rollout producer: a long-lived process that keeps generating into the run's rollout buffer
while the trainer updates (loop.max_staleness >= 1; rlpipe.rollout_buffer has the protocol).

Local: `rlpipe run` starts it once the weight store has v0, restarts it when it exits, and stops it
when the driver exits (rlpipe.services.local_servers). Cluster: the same command is the producer
Deployment's entrypoint (manifests/optional/rollout-producer.yaml), mounting the run root where the
steps do; it reads the spec the prepare step wrote to <run root>/spec.json. It samples with rollout.engine:
torch (its own copy of the policy, reloaded when a newer version is committed) or sampler (the vLLM
samplers, reloaded in place by the same pull).

    python -m rlpipe.services.rollout_producer --run-root R [--spec R/spec.json] [--port 8002]

GET /health answers 200 with the producer's status (version held, busy seconds, groups written);
<run root>/rollout_buffer/producer.json carries the same as a heartbeat, every HEARTBEAT_S.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from rlpipe.services.local_servers import LocalServers

HEARTBEAT_S = 2.0
NICENESS = 10  # lower priority than the trainer and the pipeline's steps
MARKER = "rlpipe.services.rollout_producer"


def LocalProducer(run_root: str, spec_path: str, cache_root: str) -> LocalServers:  # noqa: N802
    """One producer on loopback, started once v0 is published; `<run root>/producers/fleet.json` records it."""

    def launch(port: int) -> tuple[list[str], dict[str, str]]:
        argv = ["-m", MARKER, "--run-root", run_root, "--spec", spec_path, "--cache-root", cache_root]
        return [sys.executable, *argv, "--host", "127.0.0.1", "--port", str(port)], {}

    return LocalServers("producer", run_root, 1, launch, marker=MARKER, wait_for_weights=True)


def health_server(host: str, port: int, status: dict[str, Any]) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            body = json.dumps(status).encode()
            self.send_response(200 if self.path == "/health" else 404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

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

    from rlpipe.buffer_producer import produce, write_heartbeat
    from rlpipe.spec import parse_spec
    from rlpipe.store.run_root import cache_root_for, join, read_json

    # The producer works ahead, with slack: on a machine it shares with the trainer and the steps, it
    # yields the cores to them (their work is the iteration's critical path).
    os.nice(NICENESS)
    spec = parse_spec(read_json(args.spec or join(args.run_root, "spec.json")))
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
