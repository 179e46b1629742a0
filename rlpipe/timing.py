"""Wall-clock bookkeeping for the overhead breakdown."""

from __future__ import annotations

import time


def import_overhead(step: str, entered_at: float) -> dict[str, float]:
    """overhead/<step>_import_s: component body entered -> step function imported (torch, transformers, ...)."""
    return {f"overhead/{step}_import_s": time.time() - entered_at}
