"""Qwen3.5-MoE text (``qwen3_5_moe_text``): Qwen3.5 with a sparse MoE feed-forward in every layer.

Its mixers, attention and norms are Qwen3.5's (transformers generates both from the same modular source),
and its MoE block is Qwen3-Next's with ``norm_topk_prob`` fixed to true, so the decoder is ``SparseMoeLM``.
"""

from __future__ import annotations

import torch
from torch import nn

from gdn_export.hf.families.base import Family
from gdn_export.hf.families.qwen3_next import SparseMoeLM


class Qwen3_5MoeFamily(Family):
    name = "Qwen3.5-MoE"
    model_types = ("qwen3_5_moe_text",)
    config_class = "Qwen3_5MoeTextConfig"
    model_class = "Qwen3_5MoeForCausalLM"

    def exportable(self, hf_model: nn.Module, state_dtype: torch.dtype) -> SparseMoeLM:
        # Qwen3_5MoeTopKRouter always renormalizes its top-k weights (the config has no norm_topk_prob)
        return SparseMoeLM(hf_model, state_dtype, normalize_topk=True)


FAMILY = Qwen3_5MoeFamily()
