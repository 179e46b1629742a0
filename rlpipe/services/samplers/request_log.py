"""The sampler servers' own record of the requests they served: an ASGI middleware vLLM's server loads
(`--middleware rlpipe.services.samplers.request_log.RequestLog`) that appends one JSON line per POST request,
{path, query, status, began, ended} (wall-clock seconds), to the file $RLPIPE_SAMPLER_REQUEST_LOG; without it,
nothing. The local fleet sets it to <run root>/logs/sampler-<i>-requests.jsonl, so that the samplers' generate requests
can be laid beside the resident trainer's (<run root>/logs/trainer-requests.jsonl) on one clock: with
sharing.enabled, none overlaps an update (tests/test_sharing_protocol.py).

Light on purpose: a pure ASGI wrapper (no request body read, no response buffered) and one write(2) of a
short line on an O_APPEND descriptor per request; GETs (/health, /weight_info, polled often) are left out."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

REQUEST_LOG_ENV = "RLPIPE_SAMPLER_REQUEST_LOG"
MIDDLEWARE = "rlpipe.services.samplers.request_log.RequestLog"

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class RequestLog:
    """ASGI middleware: each POST's path, status and [began, ended] interval, one JSON line each."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        self.app = app
        path = os.environ.get(REQUEST_LOG_ENV)
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644) if path else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.fd is None or scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        began, status = time.time(), 500  # 500: the app raised before it answered

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:  # after the last byte of the body (a streamed one too): the request's end
            line = {"path": scope["path"], "query": scope["query_string"].decode(errors="replace")}
            line |= {"status": status, "began": began, "ended": time.time()}
            os.write(self.fd, (json.dumps(line) + "\n").encode())
