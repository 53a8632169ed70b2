"""Export-friendly versions of transformers submodules that several Hugging Face families share.

Each reads the weights of a transformers submodule (never its forward, whose loops or caches a trace would
freeze) and computes with ``gdn_export.models.blocks``; explicit state tensors come in and go out.
"""

from __future__ import annotations

import torch
from torch import nn

from gdn_export.models import blocks
from gdn_export.models.blocks import gated_attention, routed_experts, sparse_moe  # noqa: F401  (the families' names)
from gdn_export.models.derived import part_of
from gdn_export.ops.moe_ffn.op import widening


def rope_tables(rotary_emb: nn.Module, positions: torch.Tensor, dtype: torch.dtype):
    """transformers' default rope (a ``*RotaryEmbedding``) at ``positions``: cos/sin ``[1, S, R]`` in ``dtype``."""
    return blocks.rope_cos_sin(rotary_emb.inv_freq, positions, rotary_emb.attention_scaling, dtype)


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
