"""STUB of the KFP v2beta1 REST API (no KFP API server can run here).

Answers the calls kfp.Client makes to create experiments, runs and recurring runs, and
records every request (method, path, query, JSON body, Authorization header) for tests.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

from rlpipe.http_json import reply_json


class KfpApiStub:
    def __init__(self) -> None:
        self.requests: list[dict] = []
        self.experiments: dict[str, dict] = {}
        self.runs: dict[str, dict] = {}
        self.recurring_runs: dict[str, dict] = {}
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # keep test output clean
                pass

            def _reply(self, status: int, payload: dict) -> None:
                reply_json(self, status, payload)

            def _handle(self, method: str) -> None:
                url = urlparse(self.path)
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                stub.requests.append(
                    {
                        "method": method,
                        "path": url.path,
                        "query": parse_qs(url.query),
                        "body": body,
                        "authorization": self.headers.get("Authorization"),
                    }
                )
                status, payload = stub.route(method, url.path, parse_qs(url.query), body)
                self._reply(status, payload)

            def do_GET(self) -> None:  # noqa: N802 (http.server API)
                self._handle("GET")

            def do_POST(self) -> None:  # noqa: N802
                self._handle("POST")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.host = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "KfpApiStub":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def route(self, method: str, path: str, query: dict, body: dict | None) -> tuple[int, dict]:
        api = "/apis/v2beta1"
        if path == f"{api}/healthz":
            return 200, {"commit_sha": "stub", "tag_name": "2.17.0", "multi_user": False}
        if path == f"{api}/experiments" and method == "GET":
            wanted = json.dumps(query.get("filter", [""])[0])
            found = [e for e in self.experiments.values() if json.dumps(e["display_name"])[1:-1] in wanted]
            return 200, {"experiments": found, "total_size": len(found)}
        if path == f"{api}/experiments" and method == "POST":
            experiment = {**body, "experiment_id": f"exp-{len(self.experiments) + 1}"}
            self.experiments[experiment["experiment_id"]] = experiment
            return 200, experiment
        if path.startswith(f"{api}/experiments/") and method == "GET":
            return 200, self.experiments[path.rsplit("/", 1)[1]]
        if path == f"{api}/runs" and method == "POST":
            run = {**body, "run_id": f"run-{len(self.runs) + 1}", "state": "PENDING"}
            self.runs[run["run_id"]] = run
            return 200, run
        if path.startswith(f"{api}/runs/") and method == "GET":
            run = self.runs[path.rsplit("/", 1)[1]]
            run.update(state="SUCCEEDED", finished_at="2026-11-21T00:00:00Z")
            return 200, run
        if path == f"{api}/recurringruns" and method == "POST":
            recurring = {**body, "recurring_run_id": f"rr-{len(self.recurring_runs) + 1}", "status": "ENABLED"}
            self.recurring_runs[recurring["recurring_run_id"]] = recurring
            return 200, recurring
        return 404, {"error": f"stub does not implement {method} {path}"}
