"""Qwen3.5 text (``qwen3_5_text``): GDN layers and gated full attention, pre-norm ``(1+w)`` RMSNorm, dense MLP."""

from __future__ import annotations

import torch

from gdn_export.hf import blocks
from gdn_export.hf.families.base import ExportableLM, Family, StateSpec


def gdn_states(layer: int, config, dtype: torch.dtype) -> list[StateSpec]:
    key_dim = config.linear_num_key_heads * config.linear_key_head_dim
    channels = 2 * key_dim + config.linear_num_value_heads * config.linear_value_head_dim
    return [
        StateSpec(f"conv_{layer}", ("B", channels, config.linear_conv_kernel_dim), dtype, layer, "conv"),
        StateSpec(f"state_{layer}", ("B", config.linear_num_value_heads, config.linear_key_head_dim,
                                     config.linear_value_head_dim), torch.float32, layer, "recurrent"),
    ]


def attention_states(layer: int, kv_heads: int, head_dim: int, dtype: torch.dtype, value_dim: int | None = None):
    return [
        StateSpec(f"key_{layer}", ("B", kv_heads, "P", head_dim), dtype, layer, "key"),
        StateSpec(f"value_{layer}", ("B", kv_heads, "P", value_dim or head_dim), dtype, layer, "value"),
    ]


class Qwen3_5LM(ExportableLM):
    def __init__(self, hf_model, dtype: torch.dtype) -> None:
        super().__init__(hf_model)
        config = hf_model.config
        self.config = config
        self.states = []
        for i, kind in enumerate(config.layer_types):
            if kind == "linear_attention":
                self.states += gdn_states(i, config, dtype)
            else:
                self.states += attention_states(i, config.num_key_value_heads, config.head_dim, dtype)

    def gdn(self, module, x, conv_state, recurrent_state):
        batch, seq = x.shape[:2]
        z = module.in_proj_z(x).reshape(batch, seq, -1, module.head_v_dim)
        beta = module.in_proj_b(x).sigmoid()
        g = blocks.gdn_decay(module.in_proj_a(x), module.A_log, module.dt_bias)
        core, conv_state, recurrent_state = blocks.gated_delta_mixer(
            module.in_proj_qkv(x), module.conv1d.weight.squeeze(1), conv_state, recurrent_state, g, beta,
            key_heads=module.num_k_heads, heads=module.num_v_heads, width_k=module.head_k_dim, width_v=module.head_v_dim)
        out = module.norm(core.reshape(-1, module.head_v_dim), z.reshape(-1, module.head_v_dim))
        return module.out_proj(out.reshape(batch, seq, -1)), conv_state, recurrent_state

    def attention(self, module, x, cos, sin, position_ids, past_key, past_value, apply_rotary):
        batch, seq = x.shape[:2]
        hidden_shape = (batch, seq, -1, module.head_dim)
        query, gate = torch.chunk(module.q_proj(x).view(batch, seq, -1, module.head_dim * 2), 2, dim=-1)
        gate = gate.reshape(batch, seq, -1)
        query = module.q_norm(query.reshape(hidden_shape)).transpose(1, 2)
        key = module.k_norm(module.k_proj(x).view(hidden_shape)).transpose(1, 2)
        value = module.v_proj(x).view(hidden_shape).transpose(1, 2)
        query, key = apply_rotary(query, key, cos, sin)
        key, value = blocks.extend_cache(past_key, key), blocks.extend_cache(past_value, value)
        mask = blocks.causal_mask(position_ids, key, query.dtype)
        out = blocks.attend(query, key, value, mask, module.scaling).reshape(batch, seq, -1)
        return module.o_proj(out * torch.sigmoid(gate)), key, value

    def feed_forward(self, mlp, x):
        """The layer's MLP; subclasses with sparse MoE blocks replace transformers' data-dependent loop here."""
        return mlp(x)

    def rotary_tables(self, x, position_ids):
        """cos/sin for every attention layer. Qwen3.5-MoE's interleaved mRoPE reduces to this plain table for
        text, where the three position axes agree, so the same forward serves it."""
        rotary = self.hf.model.rotary_emb
        return blocks.rope_cos_sin(rotary.inv_freq, position_ids, rotary.attention_scaling, x.dtype)

    def attention_layer(self, index, layer, h, rotary, position_ids, past_key, past_value):
        from transformers.models.qwen3_5.modeling_qwen3_5 import apply_rotary_pos_emb

        return self.attention(layer.self_attn, h, *rotary, position_ids, past_key, past_value, apply_rotary_pos_emb)

    def forward(self, input_ids, *states):
        """Pre-norm decoder: GDN or attention mixer, then the feed-forward, each with its residual."""
        model = self.hf.model
        x = model.embed_tokens(input_ids)
        by_name = dict(zip((s.name for s in self.states), states))
        caches = [s for spec, s in zip(self.states, states) if spec.kind == "key"]
        position_ids = blocks.positions(input_ids, caches[0]) if caches else None
        rotary = self.rotary_tables(x, position_ids) if caches else None
        new_states = []
        for i, layer in enumerate(model.layers):
            h = layer.input_layernorm(x)
            if self.config.layer_types[i] == "linear_attention":
                h, *layer_states = self.gdn(layer.linear_attn, h, by_name[f"conv_{i}"], by_name[f"state_{i}"])
            else:
                h, *layer_states = self.attention_layer(i, layer, h, rotary, position_ids, by_name[f"key_{i}"],
                                                        by_name[f"value_{i}"])
            new_states += layer_states
            x = x + h
            x = x + self.feed_forward(layer.mlp, layer.post_attention_layernorm(x))
        logits = self.hf.lm_head(model.norm(x))
        return (logits, *new_states)


FAMILY = Family(
    name="Qwen3.5", model_types=("qwen3_5_text",), lm_class=Qwen3_5LM,
    config_class="Qwen3_5TextConfig", model_class="Qwen3_5ForCausalLM",
)
