"""FLA's ``GatedDeltaNet2`` layer (``fla/layers/gdn2.py``) in plain torch, state passed explicitly."""

from __future__ import annotations

import torch
from torch import nn

from gdn_export.layers.base import ConvStates, DeltaLayer, LayerOutput
from gdn_export.layers.common import decay_parameters, split_heads
from gdn_export.models.blocks import identity_steps, per_head_decay
from gdn_export.models.row_lengths import RowLengths
from gdn_export.ops.gated_delta_rule.op import gated_delta_rule


class GatedDeltaNet2(DeltaLayer):
    """Channel-wise decay ``g`` and erase gate ``b`` on K (per q/k head), write gate ``w`` on V (per value head).

    FLA defaults: head_dim 128, expand_v 1, num_heads 16; ``A_log [H]`` and ``dt_bias [H·K]`` per q/k head;
    ``f_proj`` low-rank D → V_head → H·K; ``b_proj`` D → H·K and ``w_proj`` D → Hv·V full rank; GVA repeats
    q, k, g, b to the value heads; ``allow_neg_eigval`` doubles b only; sigmoid-gated output as KDA.
    """

    def __init__(self, hidden_size: int = 2048, expand_v: float = 1.0, head_dim: int = 128, num_heads: int = 16,
                 num_v_heads: int | None = None, mode: str = "chunk", use_short_conv: bool = True,
                 allow_neg_eigval: bool = False, conv_size: int = 4, conv_bias: bool = False,
                 layer_idx: int | None = None, norm_eps: float = 1e-5, **kwargs) -> None:
        super().__init__()
        key_dim, value_dim = self._init_heads(num_heads, num_v_heads, head_dim, expand_v, allow_neg_eigval, layer_idx)
        self._init_io(hidden_size, key_dim, key_dim, value_dim, use_short_conv=use_short_conv, conv_size=conv_size,
                      conv_bias=conv_bias, output_gate="lowrank", norm_eps=norm_eps, value_dim=value_dim)
        self.f_proj = nn.Sequential(nn.Linear(hidden_size, self.head_v_dim, bias=False),
                                    nn.Linear(self.head_v_dim, key_dim, bias=False))
        self.b_proj = nn.Linear(hidden_size, key_dim, bias=False)
        self.w_proj = nn.Linear(hidden_size, value_dim, bias=False)
        self.A_log, self.dt_bias = decay_parameters(num_heads, key_dim, 1.0, 16.0)

    def forward(self, x: torch.Tensor, conv_states: ConvStates, recurrent_state: torch.Tensor,
                rows: RowLengths | None = None) -> LayerOutput:
        q, k, v, conv_states = self.project_qkv(x, conv_states, rows)
        g = per_head_decay(split_heads(self.f_proj(x), self.head_k_dim), self.A_log, self.dt_bias)
        erase = split_heads(self.b_proj(x).sigmoid(), self.head_k_dim)
        write = split_heads(self.w_proj(x).sigmoid(), self.head_v_dim)
        groups = self.num_v_heads // self.num_heads
        if groups > 1:  # the op repeats q and k itself; the K-side gates live on the value heads
            g, erase = g.repeat_interleave(groups, dim=2), erase.repeat_interleave(groups, dim=2)
        if self.allow_neg_eigval:
            erase = erase * 2.0
        g, erase, write = identity_steps(rows, g, erase, write)
        o, recurrent_state = gated_delta_rule(split_heads(q, self.head_k_dim), split_heads(k, self.head_k_dim),
                                              split_heads(v, self.head_v_dim), g, None, recurrent_state,
                                              erase=erase, write=write, use_qk_l2norm=True)
        return self.project_out(o, x), conv_states, recurrent_state
