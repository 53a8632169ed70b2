"""Qwen3.5-MoE text (``qwen3_5_moe_text``): Qwen3.5 with a sparse MoE feed-forward in every layer.

Its mixers, attention and norms are Qwen3.5's (transformers generates both from the same modular source),
and its MoE block is Qwen3-Next's with ``norm_topk_prob`` fixed to true, so the decoder is ``SparseMoeLM``.
"""

from __future__ import annotations


from gdn_export.hf.families.base import Family
from gdn_export.hf.families.qwen3_next import SparseMoeLM


# Qwen3_5MoeTopKRouter always renormalizes its top-k weights (the config has no norm_topk_prob): that is
# SparseMoeLM's default.
FAMILY = Family(
    name="Qwen3.5-MoE", model_types=("qwen3_5_moe_text",), lm_class=SparseMoeLM,
    config_class="Qwen3_5MoeTextConfig", model_class="Qwen3_5MoeForCausalLM",
)
