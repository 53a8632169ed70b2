"""Qwen3.5 text (``qwen3_5_text``): GDN layers and gated full attention, pre-norm ``(1+w)`` RMSNorm, dense MLP."""

from __future__ import annotations

from gdn_export.hf.blocks import gated_attention
from gdn_export.hf.families.base import Family, TransformersLM
from gdn_export.models import blocks


class Qwen3_5LM(TransformersLM):
    """The transformers defaults (pre-norm, ``mlp``, rotary from ``model.rotary_emb``) with Qwen3.5's mixers.

    Qwen3.5-MoE's interleaved mRoPE reduces to the plain rotary table for text, where the three position axes
    agree, so the same decoder serves it.
    """

    def gdn(self, module, x, conv_state, recurrent_state, rows=None):
        batch, seq = x.shape[:2]
        z = module.in_proj_z(x).reshape(batch, seq, -1, module.head_v_dim)
        beta = module.in_proj_b(x).sigmoid()
        g = blocks.gdn_decay(module.in_proj_a(x), module.A_log, module.dt_bias)
        core, conv_state, recurrent_state = blocks.gated_delta_mixer(
            module.in_proj_qkv(x), module.conv1d.weight.squeeze(1), conv_state, recurrent_state, g, beta,
            key_heads=module.num_k_heads, heads=module.num_v_heads, width_k=module.head_k_dim, width_v=module.head_v_dim,
            rows=rows)
        out = module.norm(core.reshape(-1, module.head_v_dim), z.reshape(-1, module.head_v_dim))
        return module.out_proj(out.reshape(batch, seq, -1)), conv_state, recurrent_state

    def delta_mixer(self, index, layer, x, states, rows):
        return self.gdn(layer.linear_attn, x, *states, rows=rows)

    def attention(self, index, layer, x, states, context):
        from transformers.models.qwen3_5.modeling_qwen3_5 import apply_rotary_pos_emb

        return gated_attention(layer.self_attn, x, *context.rotary, apply_rotary_pos_emb, *states, context.mask)


FAMILY = Family(
    name="Qwen3.5", model_types=("qwen3_5_text",), lm_class=Qwen3_5LM,
    config_class="Qwen3_5TextConfig", model_class="Qwen3_5ForCausalLM",
)
