"""A vLLM worker extension loaded into every sampler (`--worker-extension-cls`).

vLLM calls its methods through `/collective_rpc` (server) or `LLM.collective_rpc` (in-step).
It runs inside vLLM's worker, where `self` is the worker: no rlpipe imports here.
"""

from __future__ import annotations

import json
from pathlib import Path

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
                    weight = f.get_tensor(name)
                    merged[name] = (weight.float() + scale * (b @ a)).to(weight.dtype)
    if len(merged) != len(targets):
        missing = sorted(targets - {n.removesuffix(".weight") for n in merged})[:3]
        raise ValueError(f"adapter {adapter_path} targets modules the base {base_path} lacks: {missing}")
    return merged


class PolicyReload:
    def reload_policy(self, weights_path: str) -> None:
        """Reload the policy's weights in place from a HF-layout directory."""
        self.reload_weights(weights_path=weights_path)
        self._retie_head()

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
