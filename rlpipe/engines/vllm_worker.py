"""A vLLM worker extension loaded into every sampler (`--worker-extension-cls`).

vLLM calls its methods through `/collective_rpc` (server) or `LLM.collective_rpc` (in-step).
It runs inside vLLM's worker, where `self` is the worker; it imports only rlpipe.store.weight_deltas
(torch and safetensors), to apply and check versions stored as deltas.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

PEFT_PREFIX = "base_model.model."  # peft's name for the wrapped model in adapter_model.safetensors


def merged_lora_weights(base_path: str, adapter_path: str) -> dict[str, torch.Tensor]:
    """The base's weights that a peft LoRA adapter changes, merged: W' = W + (alpha / r) B A
    (alpha / sqrt(r) with rsLoRA), by the base checkpoint's names."""
    config = json.loads((Path(adapter_path) / "adapter_config.json").read_text())
    if config.get("rank_pattern") or config.get("alpha_pattern") or config.get("use_dora"):
        raise ValueError(f"adapter {adapter_path}: per-module ranks or alphas, or DoRA, do not merge here")
    rank = config["r"]
    scale = config["lora_alpha"] / (rank**0.5 if config.get("use_rslora") else rank)
    with safe_open(str(Path(adapter_path) / "adapter_model.safetensors"), "pt") as f:
        lora = {name.removeprefix(PEFT_PREFIX): f.get_tensor(name) for name in f.keys()}
    targets = {name.removesuffix(".lora_A.weight") for name in lora if name.endswith(".lora_A.weight")}
    merged: dict[str, torch.Tensor] = {}
    for path in sorted(Path(base_path).glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():
                module = name.removesuffix(".weight")
                if module in targets:
                    a, b = lora[f"{module}.lora_A.weight"].float(), lora[f"{module}.lora_B.weight"].float()
                    tensor = f.get_tensor(name)
                    merged[name] = (tensor.float() + scale * (b @ a)).to(tensor.dtype)
    if len(merged) != len(targets):
        missing = sorted(targets - {n.removesuffix(".weight") for n in merged})[:3]
        raise ValueError(f"adapter {adapter_path} targets modules the base {base_path} lacks: {missing}")
    return merged


class PolicyReload:
    # vLLM's worker, which this class extends, has these (annotations only: vLLM refuses an extension
    # whose attributes clash with the worker's)
    model_runner: Any
    reload_weights: Callable[..., None]
    # the version this worker serves as a serving copy: its weights_sha256 and its tensors (reload_version)
    _served: tuple[str | None, dict[str, torch.Tensor] | None]

    def reload_policy(self, weights_path: str) -> None:
        """Reload the policy's weights in place from a HF-layout directory."""
        self._served = (None, None)
        self.reload_weights(weights_path=weights_path)
        self._retie_head()

    def reload_version(
        self, whole_path: str, delta_paths: list[str], weights_sha256: str, parent_sha256: str | None
    ) -> str:
        """Serve a serving-copy version (storage.weights_dtype): the whole version at `whole_path` with
        the deltas at `delta_paths` applied in order. When this worker holds the last delta's parent
        (`parent_sha256`), only that delta is applied to the tensors it keeps, and only the tensors it
        changes are reloaded; else the chain is rebuilt from the whole files. Checked against
        `weights_sha256` before anything is reloaded. Returns "delta" or "rebuilt"."""
        from safetensors.torch import load_file

        from rlpipe.store.weight_deltas import DELTA_FILE, apply_delta, content_sha256

        served: tuple[str | None, dict[str, torch.Tensor] | None] = getattr(self, "_served", (None, None))
        held_sha, held = served
        self._served = (None, None)  # until this call succeeds
        incremental = held is not None and delta_paths and parent_sha256 is not None and held_sha == parent_sha256
        tensors: dict[str, torch.Tensor]
        if incremental:
            assert held is not None  # incremental only when this worker holds the parent's tensors
            tensors = held
        else:
            tensors = {}
            for path in sorted(Path(whole_path).glob("*.safetensors")):
                tensors |= load_file(path)
        changed: set[str] = set(tensors)
        for delta_dir in delta_paths[-1:] if incremental else delta_paths:
            delta = load_file(str(Path(delta_dir) / DELTA_FILE))
            apply_delta(tensors, delta)
            if incremental:
                changed = {
                    k.rsplit("#", 1)[0]
                    for k, t in delta.items()
                    if k.endswith("#whole") or (k.endswith("#value") and t.numel())
                }
        if content_sha256(tensors) != weights_sha256:
            source = delta_paths[-1] if delta_paths else whole_path
            raise ValueError(f"the weights rebuilt from {source} do not hash to {weights_sha256[:12]}")
        self.reload_weights(weights_iterator=iter([(name, tensors[name]) for name in sorted(changed)]))
        self._retie_head()
        self._served = (weights_sha256, tensors)
        return "delta" if incremental else "rebuilt"

    def reload_merged(self, base_path: str, adapter_path: str) -> None:
        """Serve the LoRA version at `adapter_path` merged into the sealed base at `base_path`:
        the modules it adapts are reloaded in place with W + (alpha / r) B A, the rest stay the
        base's (every LoRA version of a run shares its base)."""
        self.reload_weights(weights_iterator=iter(merged_lora_weights(base_path, adapter_path).items()))
        self._retie_head()

    def _retie_head(self) -> None:
        """vLLM 0.32's `reload_weights` re-processes only the modules that received a checkpoint
        tensor. With tied embeddings (tie_word_embeddings) the checkpoint has no lm_head.weight,
        so on CPU the lm_head keeps its GEMM kernel packed from the *old* embedding and samples
        from a mix of the two versions. Re-tie the weight and re-process the head (a no-op for
        unquantized heads on GPU)."""
        model = self.model_runner.get_model()
        lm_head = getattr(model, "lm_head", None)
        embed = getattr(getattr(model, "model", None), "embed_tokens", None)
        tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
        if tied and lm_head is not None and embed is not None and hasattr(lm_head, "quant_method"):
            lm_head.weight = embed.weight
            lm_head.quant_method.process_weights_after_loading(lm_head)
