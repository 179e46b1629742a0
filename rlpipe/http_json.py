"""JSON over HTTP with the standard library, for the thin step clients, health checks and the
services' http.server handlers.

A step process that imported `requests` paid ~0.06 s for it (each iteration starts several);
http.client costs ~0.02 s.
"""

from __future__ import annotations

import http.client
import json
import time
from http.server import BaseHTTPRequestHandler
from typing import Any
from urllib.parse import urlsplit

RETRIED_STATUS = (429, 500, 502, 503, 504)


class Unreachable(ConnectionError):
    """Nothing answered at the URL, or the server went away mid-request."""


class Unanswered(ConnectionError):
    """Every attempt of post_with_retries went unanswered or was refused for now (RETRIED_STATUS); the
    message is the last attempt's problem."""


def request_json(
    method: str,
    url: str,
    payload: Any = None,
    connect_timeout_s: float = 10.0,
    read_timeout_s: float | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, Any]:
    """(status, decoded JSON body or None) of one request; raises Unreachable when there is no answer.

    `read_timeout_s=None` waits for the answer as long as it takes (an update may run minutes)."""
    parts = urlsplit(url)
    connection_class = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    connection = connection_class(parts.hostname or "", parts.port, timeout=connect_timeout_s)
    body = None if payload is None else json.dumps(payload).encode()
    headers = ({"Content-Type": "application/json"} if body is not None else {}) | (headers or {})
    try:
        connection.connect()
        connection.sock.settimeout(read_timeout_s)
        path = parts.path or "/"
        connection.request(method, f"{path}?{parts.query}" if parts.query else path, body=body, headers=headers)
        response = connection.getresponse()
        raw = response.read()
    except (OSError, http.client.HTTPException) as err:
        raise Unreachable(f"{method} {url}: {type(err).__name__}: {err}") from None
    finally:
        connection.close()
    try:
        decoded = json.loads(raw) if raw else None
    except ValueError:
        decoded = None
    return response.status, decoded


def is_healthy(url: str, timeout_s: float = 5.0) -> bool:
    """GET {url}/health answers 200."""
    try:
        status, _ = request_json("GET", url.rstrip("/") + "/health", None, timeout_s, timeout_s)
    except Unreachable:
        return False
    return status == 200


def post_with_retries(
    url: str, payload: Any, timeout_s: float, retries: int, headers: dict[str, str] | None = None
) -> tuple[int, Any]:
    """(status, body) of the first answer to POST `url` not in RETRIED_STATUS, in at most retries + 1
    attempts with backoff 0.5 s, 1 s, 2 s, ...; raises Unanswered when none came."""
    problem = ""
    for attempt in range(retries + 1):
        if attempt:
            time.sleep(0.5 * 2 ** (attempt - 1))
        try:
            status, body = request_json("POST", url, payload, timeout_s, timeout_s, headers)
        except Unreachable as err:
            problem = str(err)
            continue
        if status not in RETRIED_STATUS:
            return status, body
        problem = f"HTTP {status}"
    raise Unanswered(problem)


def reply_json(handler: BaseHTTPRequestHandler, status: int, body: Any) -> None:
    """Answer the request `handler` is serving with `body` as JSON."""
    raw = json.dumps(body).encode()
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(raw)))
    handler.end_headers()
    handler.wfile.write(raw)
