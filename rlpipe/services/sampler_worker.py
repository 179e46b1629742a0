"""A vLLM worker extension loaded into every sampler (`--worker-extension-cls`).

vLLM calls its methods through `/collective_rpc` (server) or `LLM.collective_rpc` (in-step).
It runs inside vLLM's worker, where `self` is the worker: no rlpipe imports here.
"""


class PolicyReload:
    def reload_policy(self, weights_path: str) -> None:
        """Reload the policy's weights in place from a HF-layout directory.

        vLLM 0.32's `reload_weights` re-processes only the modules that received a checkpoint
        tensor. With tied embeddings (tie_word_embeddings) the checkpoint has no lm_head.weight,
        so on CPU the lm_head keeps its GEMM kernel packed from the *old* embedding and samples
        from a mix of the two versions. Re-tie the weight and re-process the head (a no-op for
        unquantized heads on GPU).
        """
        self.reload_weights(weights_path=weights_path)
        model = self.model_runner.get_model()
        lm_head = getattr(model, "lm_head", None)
        embed = getattr(getattr(model, "model", None), "embed_tokens", None)
        tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
        if tied and lm_head is not None and embed is not None and hasattr(lm_head, "quant_method"):
            lm_head.weight = embed.weight
            lm_head.quant_method.process_weights_after_loading(lm_head)
