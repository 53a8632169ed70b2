"""OLMo-Hybrid (``olmo_hybrid``): GDN layers with separate q/k/v projections, post-norm attention, dense MLP."""

from __future__ import annotations

import torch
from torch import nn

from gdn_export.hf.blocks import rope_tables
from gdn_export.hf.families.base import Family, TransformersLM, require_silu_conv
from gdn_export.models import blocks


class OlmoHybridLM(TransformersLM):
    def __init__(self, hf_model: nn.Module, dtype: torch.dtype) -> None:
        require_silu_conv(hf_model.config)
        super().__init__(hf_model, dtype)

    def delta_mixer(self, index, layer, x, states, rows):
        module = layer.linear_attn
        conv_state, recurrent_state = states
        batch, seq = x.shape[:2]
        mixed_qkv = torch.cat([module.q_proj(x), module.k_proj(x), module.v_proj(x)], dim=-1)
        beta = blocks.delta_beta(module.b_proj(x), module.allow_neg_eigval)
        g = blocks.gdn_decay(module.a_proj(x), module.A_log, module.dt_bias)
        # transformers 5.24 loads the checkpoint's q/k/v convs concatenated into one depthwise conv1d
        core, conv_state, recurrent_state = blocks.gated_delta_mixer(
            mixed_qkv, module.conv1d.weight.squeeze(1), conv_state, recurrent_state, g, beta,
            key_heads=module.num_k_heads, heads=module.num_v_heads, width_k=module.head_k_dim, width_v=module.head_v_dim,
            rows=rows)
        gate = module.g_proj(x).reshape(-1, module.head_v_dim)
        out = module.o_norm(core.reshape(-1, module.head_v_dim), gate)  # its eps is 1e-5 whatever the config says
        return module.o_proj(out.reshape(batch, seq, -1)), conv_state, recurrent_state

    def rotary_tables(self, x, positions):
        # released checkpoints have no rope_theta: NoPE. OLMo keeps cos/sin in f32 (apply_rotary_pos_emb casts
        # q and k back)
        rotary = self.hf.model.rotary_emb
        return None if rotary is None else rope_tables(rotary, positions, torch.float32)

    def attention(self, index, layer, x, states, context):
        from transformers.models.olmo_hybrid.modeling_olmo_hybrid import apply_rotary_pos_emb

        module = layer.self_attn
        # q/k norms span all heads at once, so they run before the split into heads
        hidden_shape = (*x.shape[:2], -1, module.head_dim)
        query = module.q_norm(module.q_proj(x)).view(hidden_shape).transpose(1, 2)
        key = module.k_norm(module.k_proj(x)).view(hidden_shape).transpose(1, 2)
        value = module.v_proj(x).view(hidden_shape).transpose(1, 2)
        if context.rotary is not None:
            query, key = apply_rotary_pos_emb(query, key, *context.rotary)
        out, key, value = blocks.cached_attention(query, key, value, *states, context.mask, module.scaling)
        return module.o_proj(out), key, value

    def norms(self, index, layer, part):
        if self.layer_types[index] == "linear_attention":
            return super().norms(index, layer, part)
        # attention layers are post-norm: the norms act on the branch outputs, not the inputs
        return None, (layer.post_attention_layernorm if part == "mixer" else layer.post_feedforward_layernorm)


FAMILY = Family(
    name="OLMo-Hybrid", model_types=("olmo_hybrid",), lm_class=OlmoHybridLM,
    config_class="OlmoHybridConfig", model_class="OlmoHybridForCausalLM",
)
