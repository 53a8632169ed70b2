"""LaraMini (``lara_mini``): Qwen3.5 GDN layers, NoPE global and RoPE sliding-window attention, MoE + shared expert."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gdn_export.hf import blocks
from gdn_export.hf.families.base import Family
from gdn_export.hf.families.olmo_hybrid import require_silu_conv
from gdn_export.hf.families.qwen3_5 import Qwen3_5LM


class LaraMiniLM(Qwen3_5LM):
    """Qwen3.5's states and GDN mixer (same submodule names; the f32-weight norms are LaraMini's own modules)."""

    def __init__(self, hf_model: nn.Module, dtype: torch.dtype) -> None:
        super().__init__(hf_model, dtype)
        require_silu_conv(hf_model.config)

    def attention(self, module: nn.Module, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor] | None,
                  position_ids: torch.Tensor, past_key: torch.Tensor,
                  past_value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        from transformers.models.lara_mini.modeling_lara_mini import apply_rotary_pos_emb

        hidden_shape = (*x.shape[:2], -1, module.head_dim)
        query = module.q_norm(module.q_proj(x).view(hidden_shape)).transpose(1, 2)
        key = module.k_norm(module.k_proj(x).view(hidden_shape)).transpose(1, 2)
        value = module.v_proj(x).view(hidden_shape).transpose(1, 2)
        if rotary is not None:
            query, key = apply_rotary_pos_emb(query, key, *rotary)
        # module.sliding_window is the config's window on "sliding_attention" layers, None on global ones
        out, key, value = blocks.cached_attention(query, key, value, past_key, past_value, position_ids,
                                                  module.scaling, module.sliding_window)
        return module.o_proj(out), key, value

    def moe(self, block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        router = block.gate
        flat = x.reshape(-1, router.hidden_dim)
        # the router runs in f32 whatever the model dtype
        router_logits = F.linear(flat.float(), router.weight.float())
        # not blocks.dense_moe: its scatter on axis -1 makes tract panic (see blocks.top_k_routing)
        weights = blocks.top_k_routing(router_logits, router.top_k, router.norm_topk_prob)
        experts = block.experts
        routed = blocks.dense_experts(flat, weights, experts.gate_up_proj, experts.down_proj, experts.act_fn)
        # the shared expert is added in full, with no gate
        return (routed + block.shared_expert(flat)).reshape_as(x)

    def rotary_tables(self, x: torch.Tensor, position_ids: torch.Tensor):
        if "sliding_attention" not in self.config.layer_types:
            return None
        return super().rotary_tables(x, position_ids)

    def attention_layer(self, index, layer, h, rotary, position_ids, past_key, past_value):
        # only the sliding layers are rotated; the global ("full_attention") layers use no position encoding
        layer_rotary = rotary if self.config.layer_types[index] == "sliding_attention" else None
        return self.attention(layer.self_attn, h, layer_rotary, position_ids, past_key, past_value)

    def feed_forward(self, mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return self.moe(mlp, x)


FAMILY = Family(
    name="LaraMini", model_types=("lara_mini",), lm_class=LaraMiniLM,
    config_class="LaraMiniConfig", model_class="LaraMiniForCausalLM",
)
