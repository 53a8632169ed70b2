"""LaraMini (``lara_mini``): Qwen3.5 GDN layers, NoPE global and RoPE sliding-window attention, MoE + shared expert."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gdn_export.hf.blocks import routed_experts
from gdn_export.hf.families.base import Family, require_silu_conv
from gdn_export.hf.families.qwen3_5 import Qwen3_5LM
from gdn_export.models import blocks


class LaraMiniLM(Qwen3_5LM):
    """Qwen3.5's states and GDN mixer (same submodule names; the f32-weight norms are LaraMini's own modules)."""

    def __init__(self, hf_model: nn.Module, dtype: torch.dtype) -> None:
        super().__init__(hf_model, dtype)
        require_silu_conv(hf_model.config)

    def rotary_tables(self, x, positions):
        if "sliding_attention" not in self.layer_types:
            return None
        return super().rotary_tables(x, positions)

    def attention(self, index, layer, x, states, context):
        from transformers.models.lara_mini.modeling_lara_mini import apply_rotary_pos_emb

        module = layer.self_attn
        hidden_shape = (*x.shape[:2], -1, module.head_dim)
        query = module.q_norm(module.q_proj(x).view(hidden_shape)).transpose(1, 2)
        key = module.k_norm(module.k_proj(x).view(hidden_shape)).transpose(1, 2)
        value = module.v_proj(x).view(hidden_shape).transpose(1, 2)
        # only the sliding layers are rotated; the global ("full_attention") layers use no position encoding
        if self.layer_types[index] == "sliding_attention":
            query, key = apply_rotary_pos_emb(query, key, *context.rotary)
        # module.sliding_window is the config's window on "sliding_attention" layers, None on global ones
        out, key, value = blocks.cached_attention(query, key, value, *states, context.mask, module.scaling,
                                                  module.sliding_window)
        return module.o_proj(out), key, value

    def moe_gate(self, index, layer):
        return blocks.softmax_gate(layer.mlp.gate.norm_topk_prob)

    def feed_forward(self, index, layer, x):
        block = layer.mlp
        router = block.gate
        flat = x.reshape(-1, router.hidden_dim)
        # the router runs in f32 whatever the model dtype
        router_logits = F.linear(flat.float(), router.weight.float())
        weights = blocks.top_k_routing(router_logits, router.top_k, router.norm_topk_prob)
        # the shared expert is added in full, with no gate
        # the fused op computes the router in f32 from the f32 weight: the same logits
        routed = routed_experts(block.experts, self.stacks(index), flat, weights, router.weight.float(), router.top_k)
        return (routed + block.shared_expert(flat)).reshape_as(x)


FAMILY = Family(
    name="LaraMini", model_types=("lara_mini",), lm_class=LaraMiniLM,
    config_class="LaraMiniConfig", model_class="LaraMiniForCausalLM",
)
