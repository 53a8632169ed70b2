"""FLA's ``GatedDeltaNet`` layer (``fla/layers/gated_deltanet.py``) in plain torch, state passed explicitly."""

from __future__ import annotations

import torch
from torch import nn

from gdn_export.layers.base import ConvStates, DeltaLayer, LayerOutput
from gdn_export.layers.common import decay_parameters, split_heads
from gdn_export.models.blocks import delta_beta, gdn_decay, identity_steps
from gdn_export.models.row_lengths import RowLengths
from gdn_export.ops.gated_delta_rule.op import gated_delta_rule


class GatedDeltaNet(DeltaLayer):
    """Scalar decay per value head, ``β = σ(b)`` (×2 with ``allow_neg_eigval``), GVA when num_v_heads > num_heads.

    FLA defaults: head_dim 256, expand_v 2 (V = 2K), num_heads 6, gated output (``g_proj`` + swish
    FusedRMSNormGated), short convs of 4 without bias, norm_eps 1e-5 (the model passes its ``norm_eps``,
    1e-6 by default). q/k are L2-normalized in the kernel, scale ``K^-1/2``.
    """

    def __init__(self, hidden_size: int = 2048, expand_v: float = 2, head_dim: int = 256, num_heads: int = 6,
                 num_v_heads: int | None = None, mode: str = "chunk", use_gate: bool = True,
                 use_short_conv: bool = True, allow_neg_eigval: bool = False, conv_size: int = 4,
                 conv_bias: bool = False, layer_idx: int | None = None, norm_eps: float = 1e-5, **kwargs) -> None:
        super().__init__()
        key_dim, value_dim = self._init_heads(num_heads, num_v_heads, head_dim, expand_v, allow_neg_eigval, layer_idx)
        self._init_io(hidden_size, key_dim, key_dim, value_dim, use_short_conv=use_short_conv, conv_size=conv_size,
                      conv_bias=conv_bias, output_gate="linear" if use_gate else None, norm_eps=norm_eps,
                      value_dim=value_dim)
        self.a_proj = nn.Linear(hidden_size, self.num_v_heads, bias=False)
        self.b_proj = nn.Linear(hidden_size, self.num_v_heads, bias=False)
        self.A_log, self.dt_bias = decay_parameters(self.num_v_heads, self.num_v_heads, 0.0, 16.0)

    def forward(self, x: torch.Tensor, conv_states: ConvStates, recurrent_state: torch.Tensor,
                rows: RowLengths | None = None) -> LayerOutput:
        q, k, v, conv_states = self.project_qkv(x, conv_states, rows)
        # FLA's kernel applies the gate and the sigmoid itself (use_gate_in_kernel, use_beta_sigmoid_in_kernel)
        beta = delta_beta(self.b_proj(x), self.allow_neg_eigval)
        g, beta = identity_steps(rows, gdn_decay(self.a_proj(x), self.A_log, self.dt_bias), beta)
        o, recurrent_state = gated_delta_rule(split_heads(q, self.head_k_dim), split_heads(k, self.head_k_dim),
                                              split_heads(v, self.head_v_dim), g, beta, recurrent_state,
                                              use_qk_l2norm=True)
        return self.project_out(o, x), conv_states, recurrent_state
