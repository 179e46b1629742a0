"""Wall-clock bookkeeping for the overhead breakdown (process start, imports, model load)."""

from __future__ import annotations

import os
import time


def process_age_s() -> float:
    """Seconds since this process started (Linux /proc, 10 ms resolution); 0.0 elsewhere."""
    try:
        with open(f"/proc/{os.getpid()}/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


def component_overhead(step: str, process_s: float, entered_at: float) -> dict[str, float]:
    """overhead/<step>_process_s: process start -> component body (interpreter + KFP executor);
    overhead/<step>_import_s: component body -> step function imported (torch, transformers, ...)."""
    return {f"overhead/{step}_process_s": process_s, f"overhead/{step}_import_s": time.time() - entered_at}
