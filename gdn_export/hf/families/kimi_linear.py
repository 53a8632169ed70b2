"""Kimi Linear (``kimi_linear``): KDA layers, NoPE multi-head latent attention, DeepSeek-style grouped MoE.

KDA is the gated delta rule with a per-key-channel decay, which ``blocks.gated_delta_mixer`` passes through
to the op unchanged. The MLA layers apply no rotary embedding: transformers splits the compressed key into
``kv_nope`` and ``k_rot`` but only concatenates ``k_rot`` (shared by every head) after the per-head ``k_nope``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gdn_export.hf import blocks
from gdn_export.hf.families.base import ExportableLM, Family, StateSpec
from gdn_export.hf.families.olmo_hybrid import require_silu_conv
from gdn_export.hf.families.qwen3_5 import attention_states


def kda_states(layer: int, config, dtype: torch.dtype) -> list[StateSpec]:
    heads, width = config.linear_num_heads, config.linear_head_dim
    return [
        StateSpec(f"conv_{layer}", ("B", 3 * heads * width, config.linear_conv_kernel_dim), dtype, layer, "conv"),
        StateSpec(f"state_{layer}", ("B", heads, width, width), torch.float32, layer, "recurrent"),
    ]


def grouped_sigmoid_routing(router_logits: torch.Tensor, score_bias: torch.Tensor, *, top_k: int, groups: int,
                            top_groups: int, normalize: bool, scaling: float) -> torch.Tensor:
    """``KimiLinearTopkRouter`` (DeepSeek-V3 routing) as dense weights ``[N, E]``, zero for unselected experts.

    Sigmoid scores plus the correction bias choose the experts: first the ``top_groups`` groups with the best
    top-2 sum, then the top k experts inside them; the chosen experts weigh their unbiased scores
    (renormalized if asked) times ``scaling``. Selection is topk, one-hot masks and where, so nothing data-dependent
    reaches Python. The topks are sorted (transformers' are not: torch_to_nnef exports only sorted topk; the
    chosen set, hence the scattered weights, is the same). The scatter names axis 1: tract 0.23 panics on
    torch_to_nnef's unnormalized axis -1.
    """
    experts = router_logits.shape[-1]
    # spelled with exp: tract's sigmoid bottoms out at ~4.5e-7 below x ~ -14.6, and renormalizing top-k scores
    # of that size would turn the floor into O(1) weight errors
    scores = 1.0 / (1.0 + torch.exp(-router_logits))
    choice = scores + score_bias.float()
    group_scores = choice.reshape(-1, groups, experts // groups).topk(2, dim=-1)[0].sum(dim=-1)  # [N, G]
    group_index = torch.topk(group_scores, k=top_groups, dim=-1)[1]
    # one-hot rows summed, not a scatter: tract panics on torch_to_nnef's scatter of a scalar source
    group_mask = (group_index[:, :, None] == torch.arange(groups)).sum(1)  # [N, G], 1 for a chosen group
    expert_mask = group_mask[:, :, None].expand(-1, groups, experts // groups).reshape(-1, experts)
    choice = torch.where(expert_mask > 0, choice, float("-inf"))
    top_index = torch.topk(choice, k=top_k, dim=-1)[1]
    top_weights = scores.gather(1, top_index)
    if normalize:
        top_weights = top_weights / (top_weights.sum(dim=-1, keepdim=True) + 1e-20)
    return torch.zeros_like(scores).scatter(1, top_index, top_weights * scaling)


class KimiLinearLM(ExportableLM):
    def __init__(self, hf_model: nn.Module, dtype: torch.dtype) -> None:
        super().__init__(hf_model)
        config = hf_model.config
        require_silu_conv(config)  # transformers' KDA conv runs hidden_act
        self.config = config
        self.states = []
        for i, kind in enumerate(config.layer_types):
            if kind == "linear_attention":
                self.states += kda_states(i, config, dtype)
            else:
                # per-head keys [k_nope | k_rot] and values after kv_b_proj: decode then needs no re-expansion
                # of the latent cache (transformers caches the latents and re-expands them every step)
                self.states += attention_states(i, config.num_attention_heads, config.qk_nope_head_dim +
                                                config.qk_rope_head_dim, dtype, value_dim=config.v_head_dim)

    def kda(self, module: nn.Module, x: torch.Tensor, conv_state: torch.Tensor, recurrent_state: torch.Tensor):
        batch, seq = x.shape[:2]
        # the checkpoint's separate q/k/v convs are one depthwise conv over [q|k|v] in transformers
        mixed = torch.cat([module.q_proj(x), module.k_proj(x), module.v_proj(x)], dim=-1)
        g = module.forget_gate(x)  # [B, S, H, K] f32, transformers' own softplus spelling
        beta = module.b_proj(x).sigmoid()
        core, conv_state, recurrent_state = blocks.gated_delta_mixer(
            mixed, module.conv1d.weight.squeeze(1), conv_state, recurrent_state, g, beta,
            key_heads=module.num_heads, heads=module.num_heads, width_k=module.head_dim, width_v=module.head_dim)
        gate = module.g_b_proj(module.g_a_proj(x)).view(batch, seq, -1, module.head_dim)
        out = module.o_norm(core, gate).reshape(batch, seq, -1)  # o_norm is sigmoid-gated and all f32
        return module.o_proj(out), conv_state, recurrent_state

    def attention(self, module: nn.Module, x: torch.Tensor, position_ids: torch.Tensor, past_key: torch.Tensor,
                  past_value: torch.Tensor):
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
        out, key, value = blocks.cached_attention(query, key, value, past_key, past_value, position_ids,
                                                  module.scaling)
        return module.o_proj(out), key, value

    def moe(self, block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        router, experts = block.gate, block.experts
        flat = x.reshape(-1, router.hidden_dim)
        router_logits = F.linear(flat.float(), router.weight.float())  # the router runs in f32 whatever the dtype
        weights = grouped_sigmoid_routing(
            router_logits, router.e_score_correction_bias, top_k=router.top_k, groups=router.num_group,
            top_groups=router.topk_group, normalize=router.norm_topk_prob, scaling=router.routed_scaling_factor)
        routed = blocks.dense_experts(flat, weights, experts.gate_up_proj, experts.down_proj, experts.act_fn)
        return routed.view_as(x) + block.shared_experts(x)

    def forward(self, input_ids: torch.Tensor, *states: torch.Tensor) -> tuple[torch.Tensor, ...]:
        model = self.hf.model
        config = self.config
        x = model.embed_tokens(input_ids)
        by_name = dict(zip((s.name for s in self.states), states))
        caches = [s for spec, s in zip(self.states, states) if spec.kind == "key"]
        # only the attention masks need positions (NoPE), and only attention layers have a past length to read
        position_ids = blocks.positions(input_ids, caches[0]) if caches else None
        new_states = []
        for i, layer in enumerate(model.layers):
            h = layer.input_layernorm(x)
            if config.layer_types[i] == "linear_attention":
                h, *layer_states = self.kda(layer.self_attn, h, by_name[f"conv_{i}"], by_name[f"state_{i}"])
            else:
                h, *layer_states = self.attention(layer.self_attn, h, position_ids, by_name[f"key_{i}"],
                                                  by_name[f"value_{i}"])
            new_states += layer_states
            x = x + h
            h = layer.post_attention_layernorm(x)
            x = x + (self.moe(layer.mlp, h) if config.mlp_layer_types[i] == "sparse" else layer.mlp(h))
        logits = self.hf.lm_head(model.norm(x))
        return (logits, *new_states)


FAMILY = Family(
    name="Kimi Linear", model_types=("kimi_linear",), lm_class=KimiLinearLM,
    config_class="KimiLinearConfig", model_class="KimiLinearForCausalLM",
)
