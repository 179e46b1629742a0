"""The machine a benchmark figure came from: `lscpu`'s model name (family/model when the name is
generic, as in VMs), SIMD level and cores, or the GPU."""

from __future__ import annotations

import os
import platform
import re
from pathlib import Path


def describe_machine() -> str:
    """e.g. 'AMD EPYC (family 25 model 17, AVX-512), 2 cores, x86_64, Python 3.11.7'."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""

    def field(name: str) -> str:
        found = re.search(rf"^{name}\s*:\s*(.*)$", info, flags=re.MULTILINE)
        return found.group(1).strip() if found else ""

    flags = field("flags").split()
    simd = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    cpu = (
        f"{field('model name') or platform.processor() or 'unknown CPU'} (family {field('cpu family')} model "
        f"{field('model')}, {simd})"
    )
    gpu = ""
    try:
        import torch

        if torch.cuda.is_available():
            gpu = f", GPU {torch.cuda.get_device_name(0)}"
    except ImportError:
        pass
    return f"{cpu}, {os.cpu_count()} cores{gpu}, {platform.machine()}, Python {platform.python_version()}"
