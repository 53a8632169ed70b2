"""OLMo-Hybrid (``olmo_hybrid``): GDN layers with separate q/k/v projections, post-norm attention, dense MLP."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from gdn_export.hf import blocks
from gdn_export.hf.checkpoint import CheckpointError
from gdn_export.hf.families.base import ExportableLM, Family
from gdn_export.hf.families.qwen3_5 import attention_states, gdn_states

if TYPE_CHECKING:
    from transformers import PreTrainedConfig


def require_silu_conv(config: PreTrainedConfig) -> None:
    """transformers runs the GDN short conv with ``hidden_act``; the exported conv op always applies SiLU."""
    if config.hidden_act != "silu":
        raise CheckpointError(f"hidden_act {config.hidden_act!r}: the gated delta net conv is exported with SiLU only")


class OlmoHybridLM(ExportableLM):
    def __init__(self, hf_model: nn.Module, dtype: torch.dtype) -> None:
        super().__init__(hf_model)
        config = hf_model.config
        require_silu_conv(config)
        self.states = []
        for i, layer in enumerate(hf_model.model.layers):
            if config.layer_types[i] == "linear_attention":
                self.states += gdn_states(i, config, dtype)
            else:
                # the config may carry no head_dim: the attention module derives it
                self.states += attention_states(i, config.num_key_value_heads, layer.self_attn.head_dim, dtype)

    def gdn(self, module: nn.Module, x: torch.Tensor, conv_state: torch.Tensor,
            recurrent_state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        batch, seq = x.shape[:2]
        mixed_qkv = torch.cat([module.q_proj(x), module.k_proj(x), module.v_proj(x)], dim=-1)
        beta = module.b_proj(x).sigmoid()
        if module.allow_neg_eigval:
            beta = beta * 2.0  # beta in [0, 2]: the transition may have a negative eigenvalue
        g = blocks.gdn_decay(module.a_proj(x), module.A_log, module.dt_bias)
        # transformers 5.24 loads the checkpoint's q/k/v convs concatenated into one depthwise conv1d
        core, conv_state, recurrent_state = blocks.gated_delta_mixer(
            mixed_qkv, module.conv1d.weight.squeeze(1), conv_state, recurrent_state, g, beta,
            key_heads=module.num_k_heads, heads=module.num_v_heads, width_k=module.head_k_dim, width_v=module.head_v_dim)
        gate = module.g_proj(x).reshape(-1, module.head_v_dim)
        out = module.o_norm(core.reshape(-1, module.head_v_dim), gate)  # its eps is 1e-5 whatever the config says
        return module.o_proj(out.reshape(batch, seq, -1)), conv_state, recurrent_state

    def attention(self, module: nn.Module, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor] | None,
                  position_ids: torch.Tensor, past_key: torch.Tensor,
                  past_value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        from transformers.models.olmo_hybrid.modeling_olmo_hybrid import apply_rotary_pos_emb

        # q/k norms span all heads at once, so they run before the split into heads
        hidden_shape = (*x.shape[:2], -1, module.head_dim)
        query = module.q_norm(module.q_proj(x)).view(hidden_shape).transpose(1, 2)
        key = module.k_norm(module.k_proj(x)).view(hidden_shape).transpose(1, 2)
        value = module.v_proj(x).view(hidden_shape).transpose(1, 2)
        if rotary is not None:  # released checkpoints have no rope_theta: NoPE
            query, key = apply_rotary_pos_emb(query, key, *rotary)
        out, key, value = blocks.cached_attention(query, key, value, past_key, past_value, position_ids,
                                                  module.scaling)
        return module.o_proj(out), key, value

    def forward(self, input_ids: torch.Tensor, *states: torch.Tensor) -> tuple[torch.Tensor, ...]:
        model = self.hf.model
        x = model.embed_tokens(input_ids)
        by_name = dict(zip((s.name for s in self.states), states))
        first_cache = next(s for spec, s in zip(self.states, states) if spec.kind == "key")
        position_ids = blocks.positions(input_ids, first_cache)
        rotary = None
        if model.rotary_emb is not None:
            # OLMo keeps cos/sin in f32 (apply_rotary_pos_emb casts q and k back)
            rotary = blocks.rope_cos_sin(model.rotary_emb.inv_freq, position_ids, model.rotary_emb.attention_scaling,
                                         torch.float32)
        new_states = []
        for i, layer in enumerate(model.layers):
            if self.hf.config.layer_types[i] == "linear_attention":
                h, conv, rec = self.gdn(layer.linear_attn, layer.input_layernorm(x), by_name[f"conv_{i}"],
                                        by_name[f"state_{i}"])
                new_states += [conv, rec]
                x = x + h
                x = x + layer.mlp(layer.post_attention_layernorm(x))
            else:
                # attention layers are post-norm: the norms act on the branch outputs, not the inputs
                h, key, value = self.attention(layer.self_attn, x, rotary, position_ids, by_name[f"key_{i}"],
                                               by_name[f"value_{i}"])
                new_states += [key, value]
                x = x + layer.post_attention_layernorm(h)
                x = x + layer.post_feedforward_layernorm(layer.mlp(x))
        logits = self.hf.lm_head(model.norm(x))
        return (logits, *new_states)


FAMILY = Family(
    name="OLMo-Hybrid", model_types=("olmo_hybrid",), lm_class=OlmoHybridLM,
    config_class="OlmoHybridConfig", model_class="OlmoHybridForCausalLM",
)
