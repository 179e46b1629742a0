"""Serve a registered environment over HTTP, for `{type: remote}` (rlpipe.environments.remote):

    python -m rlpipe.environments.server --type calculator --port 8000
    python -m rlpipe.environments.server --type tools --options '{"tools": ["python"]}'

One session per trajectory (POST /reset, /step, /close; GET /health). Sessions idle for longer than
--idle-s are closed, so a generate step that died leaks nothing. On a cluster:
manifests/base/environment-service.yaml (a Deployment with deny-all egress).
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import threading
import time
import uuid
from collections.abc import Awaitable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from rlpipe.environments.registry import Environment, environment_factory
from rlpipe.http_json import reply_json
from rlpipe.spec import EnvironmentSpec


def settled(value: Any) -> Any:
    """An environment method's result: awaited when it is a coroutine (an async environment)."""
    if inspect.isawaitable(value):
        import asyncio

        return asyncio.run(_awaited(value))  # a fresh loop per call: each handler runs in its own thread
    return value


async def _awaited(value: Awaitable[Any]) -> Any:
    return await value


class Sessions:
    """The live environments, one per trajectory, by session id."""

    def __init__(self, spec: EnvironmentSpec, idle_s: float) -> None:
        self.make = environment_factory(spec)
        self.idle_s = idle_s
        self.live: dict[str, tuple[Environment, float]] = {}
        self.lock = threading.Lock()

    def reset(self, row: dict[str, Any]) -> dict[str, Any]:
        self.expire()
        environment = self.make()
        observation = settled(environment.reset(row))
        session = uuid.uuid4().hex
        with self.lock:
            self.live[session] = (environment, time.monotonic())
        return {"session": session, "observation": observation}

    def step(self, session: str, text: str, token_ids: list[int]) -> dict[str, Any]:
        with self.lock:
            environment, _ = self.live[session]
            self.live[session] = (environment, time.monotonic())
        result = settled(environment.step(text, token_ids))
        if result.done:
            self.close(session)
        return {"observation": result.observation, "reward": result.reward, "done": result.done, "info": result.info}

    def close(self, session: str) -> None:
        with self.lock:
            environment, _ = self.live.pop(session, (None, 0.0))
        if environment is not None:
            environment.close()

    def expire(self) -> None:
        now = time.monotonic()
        with self.lock:
            stale = [s for s, (_, last) in self.live.items() if now - last > self.idle_s]
        for session in stale:
            self.close(session)


def make_server(host: str, port: int, sessions: Sessions) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:  # one line per turn would drown the pod's log
            pass

        def answer(self, status: int, body: Any) -> None:
            reply_json(self, status, body)

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            self.answer(200 if self.path == "/health" else 404, {"sessions": len(sessions.live)})

        def do_POST(self) -> None:  # noqa: N802
            try:
                request = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                if self.path == "/reset":
                    self.answer(200, sessions.reset(request.get("row") or {}))
                elif self.path == "/step":
                    self.answer(200, sessions.step(request["session"], request["text"], request.get("token_ids", [])))
                elif self.path == "/close":
                    sessions.close(request.get("session", ""))
                    self.answer(200, {})
                else:
                    self.answer(404, {"error": f"no route {self.path}; routes: /reset, /step, /close, /health"})
            except KeyError as err:
                self.answer(400, {"error": f"unknown session or missing field {err}"})
            except Exception as err:  # noqa: BLE001 (the client records it on the trajectory)
                self.answer(500, {"error": f"{type(err).__name__}: {err}"})

    return ThreadingHTTPServer((host, port), Handler)


def serve(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--type", required=True, help="a registered environment, or 'package.module:name'")
    parser.add_argument("--options", default="{}", help="the environment's options, as JSON")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--idle-s", type=float, default=600.0, help="close sessions idle this long")
    args = parser.parse_args(argv)
    sessions = Sessions(EnvironmentSpec(type=args.type, options=json.loads(args.options)), args.idle_s)
    server = make_server(args.host, args.port, sessions)
    print(f"rlpipe environment {args.type}: serving on http://{args.host}:{args.port}", flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(serve())
