"""Methods rlgate adds to vLLM's workers (``worker_extension_cls``).

vLLM mixes this class into its worker class, so ``self`` is the worker; the
engine reaches these methods through ``AsyncLLM.collective_rpc``. This module
is imported inside vLLM's worker processes (the engine core's, for a
one-shard CPU engine) and must not import rlgate's heavier modules.
"""

from __future__ import annotations


class WeightSyncExtension:
    """In-place weight loading that is correct for tied embeddings."""

    def rlgate_load_weights(self, path: str) -> int:
        """Load every tensor of a safetensors file (Hugging Face names) into the
        running model; return how many were loaded.

        After the stock in-place reload, an ``lm_head`` tied to the embedding
        received no tensor of its own, so on CPU its packed GEMM handle still
        holds the old embedding. Rebuilding it from the (shared, now updated)
        weight is what makes tied models correct.
        """
        from safetensors import safe_open

        with safe_open(path, framework="pt", device="cpu") as handle:
            weights = [(name, handle.get_tensor(name)) for name in handle.keys()]
        self.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)
        for head in _tied_lm_heads(self.model_runner.get_model()):
            head.quant_method.process_weights_after_loading(head)
        return len(weights)

    def rlgate_weight_checksum(self) -> float:
        """Sum of every parameter, for tests that check an update landed."""
        model = self.model_runner.get_model()
        return float(sum(p.detach().double().sum() for p in model.parameters()))


def _tied_lm_heads(model):
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        VocabParallelEmbedding,
    )

    embeddings = [
        m.weight for m in model.modules() if isinstance(m, VocabParallelEmbedding) and not isinstance(m, ParallelLMHead)
    ]
    for module in model.modules():
        if isinstance(module, ParallelLMHead) and any(module.weight is w for w in embeddings):
            yield module
