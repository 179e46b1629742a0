"""What every check shares: CheckFailed, and `within`, a probe bounded in time."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar


class CheckFailed(ValueError):
    """One pre-flight check failed; the message says what to change."""


T = TypeVar("T")


PROBE_S = 10.0  # what a probe of storage waits: gcsfs retries an unreachable endpoint for ~90 s


def within(seconds: float, probe: Callable[[], T]) -> T:
    """probe()'s result, or TimeoutError when it has not returned in `seconds`. It runs in a daemon thread,
    left to end on its own: a library retrying with backoff cannot be interrupted from outside."""
    outcome: list[tuple[bool, Any]] = []

    def run() -> None:
        try:
            outcome.append((True, probe()))
        except BaseException as err:  # noqa: BLE001 (raised again in the caller's thread)
            outcome.append((False, err))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if not outcome:
        raise TimeoutError(f"no answer in {seconds:g} s")
    returned, value = outcome[0]
    if not returned:
        raise value
    return value
