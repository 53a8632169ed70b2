"""Kimi Linear (``kimi_linear``): KDA layers, NoPE multi-head latent attention, DeepSeek-style grouped MoE.

KDA is the gated delta rule with a per-key-channel decay, which ``models.blocks.gated_delta_mixer`` passes through
to the op unchanged. The MoE routing (DeepSeek-V3's, ``models.blocks.grouped_sigmoid_routing``) has no tract
``tract_moe_ffn`` gate mode: the graph computes the weights, and the node runs sparse on them (ops/moe_ffn.py's
given routing). The MLA layers apply no rotary embedding: transformers splits the compressed key into
``kv_nope`` and ``k_rot`` but only concatenates ``k_rot`` (shared by every head) after the per-head ``k_nope``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gdn_export.hf.blocks import routed_experts
from gdn_export.hf.families.base import Family, TransformersLM, require_silu_conv
from gdn_export.models import blocks
from gdn_export.models.state import attention_states, delta_states


class KimiLinearLM(TransformersLM):
    def __init__(self, hf_model: nn.Module, dtype: torch.dtype) -> None:
        require_silu_conv(hf_model.config)  # transformers' KDA conv runs hidden_act
        super().__init__(hf_model, dtype)

    def delta_states(self, index, layer, dtype):
        heads, width = self.config.linear_num_heads, self.config.linear_head_dim
        return delta_states(index, 3 * heads * width, self.config.linear_conv_kernel_dim, heads, width, width, dtype)

    def attention_states(self, index, layer, dtype):
        # per-head keys [k_nope | k_rot] and values after kv_b_proj: decode then needs no re-expansion of the
        # latent cache (transformers caches the latents and re-expands them every step)
        config = self.config
        return attention_states(index, config.num_attention_heads, config.qk_nope_head_dim + config.qk_rope_head_dim,
                                dtype, value_dim=config.v_head_dim)

    def rotary_tables(self, x, positions):
        return None  # NoPE: only the attention masks need positions

    def delta_mixer(self, index, layer, x, states, rows):
        module = layer.self_attn
        conv_state, recurrent_state = states
        batch, seq = x.shape[:2]
        # the checkpoint's separate q/k/v convs are one depthwise conv over [q|k|v] in transformers
        mixed = torch.cat([module.q_proj(x), module.k_proj(x), module.v_proj(x)], dim=-1)
        g = module.forget_gate(x)  # [B, S, H, K] f32, transformers' own softplus spelling
        beta = module.b_proj(x).sigmoid()
        core, conv_state, recurrent_state = blocks.gated_delta_mixer(
            mixed, module.conv1d.weight.squeeze(1), conv_state, recurrent_state, g, beta,
            key_heads=module.num_heads, heads=module.num_heads, width_k=module.head_dim, width_v=module.head_dim,
            rows=rows)
        gate = module.g_b_proj(module.g_a_proj(x)).view(batch, seq, -1, module.head_dim)
        out = module.o_norm(core, gate).reshape(batch, seq, -1)  # o_norm is sigmoid-gated and all f32
        return module.o_proj(out), conv_state, recurrent_state

    def attention(self, index, layer, x, states, context):
        module = layer.self_attn
        batch, seq = x.shape[:2]
        if module.q_lora_rank is None:
            query = module.q_proj(x)
        else:
            query = module.q_b_proj(module.q_a_layernorm(module.q_a_proj(x)))
        query = query.view(batch, seq, -1, module.qk_head_dim).transpose(1, 2)
        kv_nope, k_rot = torch.split(module.kv_a_proj_with_mqa(x), [module.kv_lora_rank, module.qk_rope_head_dim],
                                     dim=-1)
        kv = module.kv_b_proj(module.kv_a_layernorm(kv_nope)).view(batch, seq, -1,
                                                                   module.qk_nope_head_dim + module.v_head_dim)
        k_nope, value = torch.split(kv.transpose(1, 2), [module.qk_nope_head_dim, module.v_head_dim], dim=-1)
        # no rotary: k_rot enters as computed, one copy per head
        k_rot = k_rot[:, None].expand(-1, module.num_heads, -1, -1)
        key = torch.cat([k_nope, k_rot], dim=-1)
        out, key, value = blocks.cached_attention(query, key, value, *states, context.mask, module.scaling)
        return module.o_proj(out), key, value

    def moe_gate(self, index, layer):
        if self.config.mlp_layer_types[index] != "sparse":
            return None
        # the weights are non-negative exactly when the scaling is: only then do they choose the experts (sparse)
        return "grouped_sigmoid" if layer.mlp.gate.routed_scaling_factor > 0 else "grouped_sigmoid_signed"

    def feed_forward(self, index, layer, x):
        if self.config.mlp_layer_types[index] != "sparse":
            return layer.mlp(x)
        block = layer.mlp
        router = block.gate
        flat = x.reshape(-1, router.hidden_dim)
        router_logits = F.linear(flat.float(), router.weight.float())  # the router runs in f32 whatever the dtype
        weights = blocks.grouped_sigmoid_routing(
            router_logits, router.e_score_correction_bias, top_k=router.top_k, groups=router.num_group,
            top_groups=router.topk_group, normalize=router.norm_topk_prob, scaling=router.routed_scaling_factor)
        routed = routed_experts(block.experts, self.stacks(index), flat, weights, router.weight, router.top_k)
        return routed.view_as(x) + block.shared_experts(x)


FAMILY = Family(
    name="Kimi Linear", model_types=("kimi_linear",), lm_class=KimiLinearLM,
    config_class="KimiLinearConfig", model_class="KimiLinearForCausalLM",
)
