"""Export-friendly versions of transformers submodules that several Hugging Face families share.

Each reads the weights of a transformers submodule (never its forward, whose loops or caches a trace would
freeze) and computes with ``gdn_export.models.blocks``; explicit state tensors come in and go out.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gdn_export.models import blocks


def rope_tables(rotary_emb: nn.Module, positions: torch.Tensor, dtype: torch.dtype):
    """transformers' default rope (a ``*RotaryEmbedding``) at ``positions``: cos/sin ``[1, S, R]`` in ``dtype``."""
    return blocks.rope_cos_sin(rotary_emb.inv_freq, positions, rotary_emb.attention_scaling, dtype)


def gated_attention(module: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, apply_rotary,
                    past_key: torch.Tensor, past_value: torch.Tensor, mask) -> tuple:
    """Qwen3.5's ``*Attention`` with its output gate: per-head q/k norms, rotary, cache, sigmoid-gated ``o_proj``.

    ``q_proj`` yields ``[q | gate]`` per head; ``mask(key, dtype)`` gives the additive mask over the extended key
    cache (``Context.mask``). Returns (output ``[B, S, D]``, key cache, value cache).
    """
    batch, seq = x.shape[:2]
    hidden_shape = (batch, seq, -1, module.head_dim)
    query, gate = torch.chunk(module.q_proj(x).view(batch, seq, -1, module.head_dim * 2), 2, dim=-1)
    gate = gate.reshape(batch, seq, -1)
    query = module.q_norm(query.reshape(hidden_shape)).transpose(1, 2)
    key = module.k_norm(module.k_proj(x).view(hidden_shape)).transpose(1, 2)
    value = module.v_proj(x).view(hidden_shape).transpose(1, 2)
    query, key = apply_rotary(query, key, cos, sin)
    key, value = blocks.extend_cache(past_key, key), blocks.extend_cache(past_value, value)
    out = blocks.attend(query, key, value, mask(key, query.dtype), module.scaling).reshape(batch, seq, -1)
    return module.o_proj(out * torch.sigmoid(gate)), key, value


def is_silu(act) -> bool:
    """Whether a transformers activation module is SiLU (``ACT2FN["silu"]``), the experts ``moe_ffn`` computes."""
    from transformers.activations import SiLUActivation

    return isinstance(act, (SiLUActivation, nn.SiLU))


def routed_experts(experts: nn.Module, flat: torch.Tensor, weights: torch.Tensor, router_weight: torch.Tensor,
                   top_k: int, gate: str) -> torch.Tensor:
    """A transformers ``*Experts`` module (fused ``gate_up_proj``, ``down_proj``) on ``flat`` ``[N, D]``, mixed by the
    routing ``weights`` ``[N, E]``: one ``t2n_extra::moe_ffn`` node, which the export makes sparse where tract's
    ``tract_moe_ffn`` computes ``gate`` exactly (``gdn_export/ops/moe_ffn.py``).

    Experts with another activation than SiLU stay plain dense torch code (no MoE decision is reported for them).
    """
    if not is_silu(experts.act_fn):
        return blocks.dense_experts(flat, weights, experts.gate_up_proj, experts.down_proj, experts.act_fn)
    return blocks.routed_moe(flat, weights, router_weight, experts.gate_up_proj, experts.down_proj, top_k, gate)


def sparse_moe(block: nn.Module, x: torch.Tensor, normalize_topk: bool) -> torch.Tensor:
    """transformers' Qwen ``*SparseMoeBlock``: top-k softmax experts plus a shared expert scaled by a sigmoid gate.

    Reads only the block's weights: its own forward loops over the experts a batch happens to hit, which a
    trace would freeze. The routed experts are one ``moe_ffn`` node (sparse in tract where exact); the shared expert
    and its gate stay ordinary graph ops.
    """
    router = block.gate
    flat = x.reshape(-1, router.hidden_dim)
    weights = blocks.top_k_routing(F.linear(flat, router.weight), router.top_k, normalize_topk)
    routed = routed_experts(block.experts, flat, weights, router.weight, router.top_k,
                            blocks.softmax_gate(normalize_topk))
    shared = torch.sigmoid(block.shared_expert_gate(flat)) * block.shared_expert(flat)
    return (routed + shared).view_as(x)
