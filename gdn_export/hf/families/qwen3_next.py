"""Qwen3-Next (``qwen3_next``): Qwen3.5's decoder with fused GDN projections and sparse MoE feed-forwards.

Attention, norms, rotary tables and the GDN math are Qwen3.5's, so the decoder reuses ``Qwen3_5LM``; what
differs is the GDN projection layout (``in_proj_qkvz`` / ``in_proj_ba`` grouped per key head) and the MoE
feed-forward, which ``SparseMoeLM`` (shared with Qwen3.5-MoE) runs through ``hf.blocks.sparse_moe``: the routing in
graph ops, the routed experts one ``t2n_extra::moe_ffn`` node (tract's sparse ``tract_moe_ffn`` on the CPU runtime).
"""

from __future__ import annotations

import torch
from torch import nn

from gdn_export.hf.blocks import sparse_moe
from gdn_export.models.blocks import softmax_gate
from gdn_export.models.derived import rows_of
from gdn_export.hf.families.base import Family
from gdn_export.hf.families.qwen3_5 import Qwen3_5LM


class SparseMoeLM(Qwen3_5LM):
    """Qwen3.5's decoder where a layer's ``mlp`` may be a transformers sparse MoE block.

    Which layers are sparse (``decoder_sparse_step``, ``mlp_only_layers``) is read from the modules
    transformers built, not re-derived from the config.
    """

    def __init__(self, hf_model: nn.Module, dtype: torch.dtype, normalize_topk: bool = True) -> None:
        self.normalize_topk = normalize_topk  # before the base, which asks moe_gate
        super().__init__(hf_model, dtype)

    def moe_gate(self, index: int, layer: nn.Module) -> str | None:
        return softmax_gate(self.normalize_topk) if hasattr(layer.mlp, "experts") else None

    def feed_forward(self, index: int, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if hasattr(layer.mlp, "experts"):
            return sparse_moe(layer.mlp, self.stacks(index), x, self.normalize_topk)
        return layer.mlp(x)


def _frozen_linear(weight: torch.Tensor, rows: torch.Tensor) -> nn.Linear:
    """A bias-free linear layer over ``weight[rows]``."""
    linear = nn.Linear(weight.shape[1], len(rows), bias=False, device="meta")  # no throwaway init
    linear.weight = rows_of(weight, rows)
    return linear


class UnfusedGatedDeltaNet(nn.Module):
    """A ``Qwen3NextGatedDeltaNet`` with Qwen3.5's separate projections, the interface ``Qwen3_5LM.gdn`` reads.

    The fused rows are grouped per key head h as ``[q_h | k_h | v_{hG..hG+G-1} | z_{same}]`` and ``[b | a]``
    (transformers' ``fix_query_key_value_ordering``). Un-grouping them is a row permutation of the weights, done once
    here, so the graph holds Qwen3.5's plain splits rather than per-step reshapes of the fused output.
    Everything else (conv, norm, out_proj, A_log, dt_bias) is borrowed from the original module.
    """

    def __init__(self, fused: nn.Module) -> None:
        super().__init__()
        self.num_k_heads, self.num_v_heads = fused.num_k_heads, fused.num_v_heads
        self.head_k_dim, self.head_v_dim = fused.head_k_dim, fused.head_v_dim
        # borrowed without registering: torch_to_nnef names each weight by one module path (the hf one) and
        # fails on a second path to the same tensor
        for name in ("conv1d", "norm", "out_proj", "A_log", "dt_bias"):
            object.__setattr__(self, name, getattr(fused, name))
        group_v = fused.num_v_heads // fused.num_k_heads * fused.head_v_dim
        group_heads = fused.num_v_heads // fused.num_k_heads
        # the permutation as row indices (from the shapes alone), so that a streamed export writes the permuted
        # weights straight from the checkpoint (gdn_export.models.derived)
        qkvz_rows = torch.arange(fused.in_proj_qkvz.weight.shape[0]).view(fused.num_k_heads, -1)
        q, k, v, z = qkvz_rows.split([fused.head_k_dim, fused.head_k_dim, group_v, group_v], dim=1)
        b, a = torch.arange(fused.in_proj_ba.weight.shape[0]).view(fused.num_k_heads, -1).split(
            [group_heads, group_heads], dim=1)
        # flatten: [Hk, rows per head] -> head-major rows, value/gate head h*G+i as repeat_interleave expects
        self.in_proj_qkv = _frozen_linear(fused.in_proj_qkvz.weight, torch.cat([q.flatten(), k.flatten(), v.flatten()]))
        self.in_proj_z = _frozen_linear(fused.in_proj_qkvz.weight, z.flatten())
        self.in_proj_b = _frozen_linear(fused.in_proj_ba.weight, b.flatten())
        self.in_proj_a = _frozen_linear(fused.in_proj_ba.weight, a.flatten())


class Qwen3NextLM(SparseMoeLM):
    def __init__(self, hf_model: nn.Module, dtype: torch.dtype) -> None:
        super().__init__(hf_model, dtype, normalize_topk=hf_model.config.norm_topk_prob)
        # keyed by layer index (ModuleDict keys are strings); built from the weights of the model being exported
        self.unfused = nn.ModuleDict({
            str(i): UnfusedGatedDeltaNet(layer.linear_attn)
            for i, layer in enumerate(hf_model.model.layers) if layer.block_type == "linear_attention"
        })

    def delta_mixer(self, index, layer, x, states, rows):
        return self.gdn(self.unfused[str(index)], x, *states, rows=rows)


FAMILY = Family(
    name="Qwen3-Next", model_types=("qwen3_next",), lm_class=Qwen3NextLM,
    config_class="Qwen3NextConfig", model_class="Qwen3NextForCausalLM",
)
