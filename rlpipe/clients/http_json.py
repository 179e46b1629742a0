"""JSON over HTTP with the standard library, for the thin step clients and health checks.

A step process that imported `requests` paid ~0.06 s for it (each iteration starts several);
http.client costs ~0.02 s.
"""

from __future__ import annotations

import http.client
import json
from typing import Any
from urllib.parse import urlsplit


class Unreachable(ConnectionError):
    """Nothing answered at the URL, or the server went away mid-request."""


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
