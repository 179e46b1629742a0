"""STUB of the Kubeflow Model Registry REST API (stub: no Model Registry server runs here).

Answers the calls the Kubeflow SDK's ModelRegistryClient (kubeflow.hub, over model-registry's generated
mr_openapi client) makes to register a model and read it back, under /api/model_registry/v1 as the
server's OpenAPI spec (model-registry 0.3.x) has them: create and find registered models, model versions
and model artifacts, list registered models and a model's versions. It answers as that spec does: server
ids (strings), createTimeSinceEpoch / lastUpdateTimeSinceEpoch (epoch milliseconds as strings), state
LIVE, customProperties as sent, 201 on create, 404 {code, message} when a find finds nothing. Every
request is recorded (method, path, query, JSON body, Authorization header) for the tests.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

from rlpipe.http_json import reply_json

API = "/api/model_registry/v1"


class ModelRegistryStub:
    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.models: dict[str, dict] = {}  # id -> RegisteredModel
        self.versions: dict[str, dict] = {}  # id -> ModelVersion
        self.artifacts: dict[str, dict] = {}  # id -> ModelArtifact
        self.links: dict[str, list[str]] = {}  # model version id -> its artifacts' ids
        self.next_id = 1
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # keep test output clean
                pass

            def _handle(self, method: str) -> None:
                url = urlparse(self.path)
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                query = {key: values[0] for key, values in parse_qs(url.query).items()}
                stub.requests.append(
                    {
                        "method": method,
                        "path": url.path,
                        "query": query,
                        "body": body,
                        "authorization": self.headers.get("Authorization"),
                    }
                )
                status, payload = stub.route(method, url.path, query, body)
                reply_json(self, status, payload)

            def do_GET(self) -> None:  # noqa: N802 (http.server API)
                self._handle("GET")

            def do_POST(self) -> None:  # noqa: N802
                self._handle("POST")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.address = "http://127.0.0.1"
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> ModelRegistryStub:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def writes(self) -> list[tuple[str, str, Any]]:
        """(method, path, body) of every request that changed something: what a registration sent."""
        return [(r["method"], r["path"], r["body"]) for r in self.requests if r["method"] != "GET"]

    def created(self, body: dict, **server_side: Any) -> dict:
        """`body` as the server stores it: an id, the timestamps, customProperties ({} when none)."""
        now = str(int(time.time() * 1000))
        resource = {"customProperties": {}, **body, **server_side}
        resource |= {"id": str(self.next_id), "createTimeSinceEpoch": now, "lastUpdateTimeSinceEpoch": now}
        self.next_id += 1
        return resource

    def route(self, method: str, path: str, query: dict, body: dict | None) -> tuple[int, dict]:
        if method == "GET" and path == f"{API}/registered_models":
            return 200, page(list(self.models.values()), query)
        if method == "GET" and path == f"{API}/registered_model":
            return found([m for m in self.models.values() if m["name"] == query.get("name")], "registered model")
        if method == "POST" and path == f"{API}/registered_models":
            if any(m["name"] == body["name"] for m in self.models.values()):
                return 409, {"code": "ALREADY_EXISTS", "message": f"registered model {body['name']} exists"}
            model = self.created(body, state=body.get("state", "LIVE"))
            self.models[model["id"]] = model
            return 201, model
        if method == "GET" and path.startswith(f"{API}/registered_models/") and path.endswith("/versions"):
            parent = path.split("/")[-2]
            return 200, page([v for v in self.versions.values() if v["registeredModelId"] == parent], query)
        if method == "GET" and path == f"{API}/model_version":
            parent, name = query.get("parentResourceId"), query.get("name")
            matches = [v for v in self.versions.values() if v["registeredModelId"] == parent and v["name"] == name]
            return found(matches, "model version")
        if method == "POST" and path == f"{API}/model_versions":
            if body["registeredModelId"] not in self.models:
                return 404, {"code": "NOT_FOUND", "message": f"no registered model {body['registeredModelId']}"}
            version = self.created(body, state=body.get("state", "LIVE"))
            self.versions[version["id"]] = version
            return 201, version
        if method == "POST" and path.startswith(f"{API}/model_versions/") and path.endswith("/artifacts"):
            parent = path.split("/")[-2]
            artifact = self.created(body)
            self.artifacts[artifact["id"]] = artifact
            self.links.setdefault(parent, []).append(artifact["id"])
            return 201, artifact
        if method == "GET" and path == f"{API}/model_artifact":
            ids = self.links.get(query.get("parentResourceId"), [])
            return found([self.artifacts[i] for i in ids if self.artifacts[i]["name"] == query.get("name")], "artifact")
        return 404, {"code": "NOT_FOUND", "message": f"the stub has no {method} {path}"}


def found(matches: list[dict], kind: str) -> tuple[int, dict]:
    """A find's answer: the one match, or 404 as the server's Error schema has it."""
    if not matches:
        return 404, {"code": "NOT_FOUND", "message": f"no {kind} found"}
    return 200, matches[0]


def page(items: list[dict], query: dict) -> dict:
    """A list answer (one page: the stub holds few resources)."""
    size = int(query.get("pageSize") or len(items) or 1)
    return {"items": items[:size], "nextPageToken": "", "pageSize": size, "size": len(items[:size])}
