"""Methods we add to vLLM's worker processes (``worker_extension_cls``), called with ``collective_rpc``.

vLLM's in-place ``reload_weights`` rebuilds every layer that the checkpoint holds weights for and puts the
old tensors back into the others. A model whose output head is tied to its input embedding (Qwen2.5
0.5B-3B, Llama-3.2 1B/3B) has no head weight in its checkpoint, so after a reload the head kept its old
values (on the CPU also its pre-packed GEMM copy): the tie was broken. ``ajet_reload_weights`` reloads the
same way, then ties the head to the freshly loaded embedding again and re-runs the head's post-loading
step (which re-packs it on the CPU and is a no-op for unquantized weights on GPUs).

This module is imported inside vLLM's worker processes: it must not import vLLM at module level.
"""

from __future__ import annotations

import logging
import time

log = logging.getLogger(__name__)

EXTENSION = f"{__name__}.WeightLoadExtension"
"""The value of vLLM's ``worker_extension_cls`` for our engine."""


def retie_output_head(model) -> bool:
    """Point a tied model's output head at its input embedding again and re-process it; False when the
    model does not tie them."""
    config = getattr(model, "config", None)
    head = getattr(model, "lm_head", None)
    if config is None or head is None or not getattr(config, "tie_word_embeddings", False):
        return False
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if embed is None or not hasattr(embed, "weight"):
        embed = model.model.embed_tokens
    head.tie_weights(embed)
    if callable(getattr(embed, "cpu_linear", None)):
        # on the CPU the embedding was just processed with the new values, and its pre-packed GEMM is the
        # head's (the same matrix): share it rather than pack the vocabulary a second time
        head.cpu_linear = embed.cpu_linear
        return True
    method = getattr(head, "quant_method", None)
    if method is not None and hasattr(method, "process_weights_after_loading"):
        method.process_weights_after_loading(head)
    return True


class WeightLoadExtension:
    """Mixed into vLLM's worker class (see the module doc)."""

    def ajet_reload_weights(self, weights_path: str) -> dict[str, float]:
        """Reload a ``save_pretrained`` folder into the running model in place, ties kept."""
        started = time.monotonic()
        runner = self.model_runner  # type: ignore[attr-defined]
        runner.reload_weights(weights_path=weights_path)
        tied = retie_output_head(runner.get_model())
        return {"tied": float(tied), "seconds": time.monotonic() - started}

    def ajet_retie_output_head(self) -> bool:
        """After an in-memory weight update: the tied head follows the new embedding again."""
        return retie_output_head(self.model_runner.get_model())  # type: ignore[attr-defined]

    def ajet_abort_weight_update(self) -> None:
        """After a transfer that failed midway: finish the layerwise reload it began, so every layer holds
        real tensors again (those that arrived new, the others old), and leave the update state."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        runner = self.model_runner  # type: ignore[attr-defined]
        config = self.vllm_config  # type: ignore[attr-defined]
        with set_current_vllm_config(config):
            finalize_layerwise_reload(runner.get_model(), config.model_config)
        retie_output_head(runner.get_model())
        self._weight_update_active = False
