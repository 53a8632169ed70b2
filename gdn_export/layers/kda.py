"""FLA's ``KimiDeltaAttention`` layer (``fla/layers/kda.py``) in plain torch, state passed explicitly."""

from __future__ import annotations

import torch
from torch import nn

from gdn_export.layers.base import ConvStates, DeltaLayer, LayerOutput
from gdn_export.layers.common import decay_parameters, split_heads
from gdn_export.models.blocks import delta_beta, identity_steps, per_head_decay
from gdn_export.models.row_lengths import RowLengths
from gdn_export.ops.gated_delta_rule.op import gated_delta_rule


class KimiDeltaAttention(DeltaLayer):
    """Per-key-channel decay ``g [B, S, Hv, K]`` from the low-rank ``f_proj``; ``β = σ(b)`` per value head.

    FLA defaults: head_dim 128, expand_v 1, num_heads 16, GVA via num_v_heads; ``A_log [Hv]``,
    ``dt_bias [Hv·K]``; output gate low-rank ``g_proj`` whose second Linear has a bias, sigmoid
    FusedRMSNormGated. With ``lower_bound`` the gate is ``lower_bound · σ(exp(A_log) · (f + dt_bias))``
    (``safe_gate`` only picks a faster kernel and needs lower_bound).
    """

    def __init__(self, hidden_size: int = 2048, expand_v: float = 1, head_dim: int = 128, num_heads: int = 16,
                 num_v_heads: int | None = None, mode: str = "chunk", use_short_conv: bool = True,
                 allow_neg_eigval: bool = False, safe_gate: bool = False, lower_bound: float | None = None,
                 conv_size: int = 4, conv_bias: bool = False, layer_idx: int | None = None, norm_eps: float = 1e-5,
                 **kwargs) -> None:
        super().__init__()
        if safe_gate and lower_bound is None:
            raise ValueError("`lower_bound` must be specified when `safe_gate=True`")
        key_dim, value_dim = self._init_heads(num_heads, num_v_heads, head_dim, expand_v, allow_neg_eigval, layer_idx)
        self.lower_bound = lower_bound
        self._init_io(hidden_size, key_dim, key_dim, value_dim, use_short_conv=use_short_conv, conv_size=conv_size,
                      conv_bias=conv_bias, output_gate="lowrank", norm_eps=norm_eps, value_dim=value_dim)
        gate_dim = self.num_v_heads * head_dim
        self.f_proj = nn.Sequential(nn.Linear(hidden_size, self.head_v_dim, bias=False),
                                    nn.Linear(self.head_v_dim, gate_dim, bias=False))
        self.b_proj = nn.Linear(hidden_size, self.num_v_heads, bias=False)
        self.A_log, self.dt_bias = decay_parameters(self.num_v_heads, gate_dim, 1.0, 16.0)
        if safe_gate:
            nn.init.zeros_(self.A_log)

    def decay(self, x: torch.Tensor) -> torch.Tensor:
        f = split_heads(self.f_proj(x), self.head_k_dim)
        if self.lower_bound is None:
            return per_head_decay(f, self.A_log, self.dt_bias)
        f = f.float() + self.dt_bias.float().view(self.num_v_heads, -1)
        return self.lower_bound * torch.sigmoid(self.A_log.float().exp()[:, None] * f)

    def forward(self, x: torch.Tensor, conv_states: ConvStates, recurrent_state: torch.Tensor,
                rows: RowLengths | None = None) -> LayerOutput:
        q, k, v, conv_states = self.project_qkv(x, conv_states, rows)
        g, beta = identity_steps(rows, self.decay(x), delta_beta(self.b_proj(x), self.allow_neg_eigval))
        o, recurrent_state = gated_delta_rule(split_heads(q, self.head_k_dim), split_heads(k, self.head_k_dim),
                                              split_heads(v, self.head_v_dim), g, beta, recurrent_state,
                                              use_qk_l2norm=True)
        return self.project_out(o, x), conv_states, recurrent_state
