"""Export-friendly versions of transformers submodules that several Hugging Face families share.

Each reads the weights of a transformers submodule (never its forward, whose loops or caches a trace would
freeze) and computes with ``gdn_export.models.blocks``; explicit state tensors come in and go out.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gdn_export.models import blocks
from gdn_export.models.derived import part_of
from gdn_export.ops.moe_ffn.op import widening


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


class ExpertStacks(nn.Module):
    """A transformers ``*Experts`` module's weights in ``moe_ffn``'s layout (``gdn_export/ops/moe_ffn/op.py``) for
    routing ``gate``: ``gate_proj`` and ``up_proj`` ``[E, I, D + W]`` the halves of its fused ``gate_up_proj``,
    ``down_proj`` ``[E, D + W, I]`` (``W`` zero columns / rows for a given routing), each a derived parameter
    (``gdn_export.models.derived``) that a streamed export writes straight from the checkpoint's stack, in Q4_0 if
    asked: the archive holds the stacks as tract's ``tract_moe_ffn`` reads them, with nothing to slice or pad in the
    graph (which a Q4_0 constant cannot be).

    Built once, with the exportable model (``stacks_by_layer``), from the model being exported."""

    def __init__(self, experts: nn.Module, gate: str) -> None:
        super().__init__()
        self.gate = gate
        count, rows, width = experts.gate_up_proj.shape
        extra = widening(gate, count)
        pad_columns = (2, extra) if extra else None
        self.gate_proj = part_of(experts.gate_up_proj, (0, rows // 2), pad_columns)
        self.up_proj = part_of(experts.gate_up_proj, (rows // 2, rows), pad_columns)
        # the module borrowed without registering: torch_to_nnef names each weight by one module path (the hf one)
        object.__setattr__(self, "experts", experts)
        if extra:
            self.widened_down_proj = part_of(experts.down_proj, None, (1, extra))

    @property
    def down_proj(self) -> torch.Tensor:
        # read through the module at each use, not kept: torch_to_nnef swaps the module's parameters for named
        # tensors while it traces (a tensor kept here would be exported as an anonymous constant)
        return self.widened_down_proj if hasattr(self, "widened_down_proj") else self.experts.down_proj


def stacks_by_layer(layers, gate_of) -> nn.ModuleDict:
    """``ExpertStacks`` of each decoder layer whose ``mlp`` is a routed MoE (``gate_of(index, layer)``: its
    ``moe_ffn`` gate, None for a dense feed-forward) with SiLU experts (the ones ``moe_ffn`` computes), keyed by
    the layer index."""
    stacks = {}
    for i, layer in enumerate(layers):
        gate = gate_of(i, layer)
        if gate is not None and is_silu(layer.mlp.experts.act_fn):
            stacks[str(i)] = ExpertStacks(layer.mlp.experts, gate)
    return nn.ModuleDict(stacks)


def routed_experts(experts: nn.Module, stacks: ExpertStacks | None, flat: torch.Tensor, weights: torch.Tensor,
                   router_weight: torch.Tensor, top_k: int) -> torch.Tensor:
    """A transformers ``*Experts`` module on ``flat`` ``[N, D]``, mixed by the routing ``weights`` ``[N, E]``: one
    ``t2n_extra::moe_ffn`` node over its ``stacks``, which the export makes sparse where tract's ``tract_moe_ffn``
    computes the stacks' gate exactly (``gdn_export/ops/moe_ffn/op.py``).

    Experts with another activation than SiLU (no ``stacks``) stay plain dense torch code (no MoE decision is
    reported for them).
    """
    if stacks is None:
        gate, up = experts.gate_up_proj.chunk(2, dim=1)
        return blocks.dense_experts(flat, weights, gate, up, experts.down_proj, experts.act_fn)
    return blocks.routed_moe(flat, weights, router_weight, stacks.gate_proj, stacks.up_proj, stacks.down_proj, top_k,
                             stacks.gate)


def sparse_moe(block: nn.Module, stacks: ExpertStacks | None, x: torch.Tensor, normalize_topk: bool) -> torch.Tensor:
    """transformers' Qwen ``*SparseMoeBlock``: top-k softmax experts plus a shared expert scaled by a sigmoid gate.

    Reads only the block's weights: its own forward loops over the experts a batch happens to hit, which a
    trace would freeze. The routed experts are one ``moe_ffn`` node (sparse in tract where exact); the shared expert
    and its gate stay ordinary graph ops.
    """
    router = block.gate
    flat = x.reshape(-1, router.hidden_dim)
    weights = blocks.top_k_routing(F.linear(flat, router.weight), router.top_k, normalize_topk)
    routed = routed_experts(block.experts, stacks, flat, weights, router.weight, router.top_k)
    shared = torch.sigmoid(block.shared_expert_gate(flat)) * block.shared_expert(flat)
    return (routed + shared).view_as(x)
