"""FLA's ``GatedDeltaProduct`` layer (``fla/layers/gated_deltaproduct.py``) in plain torch, state passed explicitly."""

from __future__ import annotations

import torch
from torch import nn

from gdn_export.layers.base import ConvStates, DeltaLayer, LayerOutput
from gdn_export.layers.common import decay_parameters, split_heads
from gdn_export.models.blocks import delta_beta, gdn_decay, identity_steps
from gdn_export.models.row_lengths import RowLengths
from gdn_export.ops.gated_delta_rule.op import gated_delta_rule


class GatedDeltaProduct(DeltaLayer):
    """``num_householder`` delta steps per token: k, v, β carry n sub-steps, decay and readout once per token.

    Features are ordered ``(n h d)`` (Householder index outermost), sub-step j of token t goes to index
    t·n + j. The short convs run over the real time axis with the n sub-keys as channels. Layer defaults
    (FLA): head_dim 256, num_heads 6, expand_v 2, num_householder 2, allow_neg_eigval True,
    use_forget_gate True; the *model config* defaults differ (1, False, False) and win for checkpoints.
    """

    def __init__(self, hidden_size: int = 2048, expand_v: float = 2, head_dim: int = 256, num_heads: int = 6,
                 num_v_heads: int | None = None, mode: str = "chunk", use_output_gate: bool = True,
                 use_short_conv: bool = True, conv_size: int = 4, conv_bias: bool = False,
                 layer_idx: int | None = None, norm_eps: float = 1e-5, use_forget_gate: bool = True,
                 allow_neg_eigval: bool = True, num_householder: int = 2, **kwargs) -> None:
        super().__init__()
        if int(num_householder) < 1:
            raise ValueError(f"num_householder must be >= 1, got {num_householder}")
        key_dim, value_dim = self._init_heads(num_heads, num_v_heads, head_dim, expand_v, allow_neg_eigval, layer_idx)
        self.num_householder, self.use_forget_gate = int(num_householder), use_forget_gate
        n = self.num_householder
        self._init_io(hidden_size, key_dim, key_dim * n, value_dim * n, use_short_conv=use_short_conv,
                      conv_size=conv_size, conv_bias=conv_bias, output_gate="linear" if use_output_gate else None,
                      norm_eps=norm_eps, value_dim=value_dim)
        self.b_proj = nn.Linear(hidden_size, self.num_v_heads * n, bias=False)
        if use_forget_gate:
            self.a_proj = nn.Linear(hidden_size, self.num_v_heads, bias=False)
            self.A_log, self.dt_bias = decay_parameters(self.num_v_heads, self.num_v_heads, 0.0, 16.0)

    def forward(self, x: torch.Tensor, conv_states: ConvStates, recurrent_state: torch.Tensor,
                rows: RowLengths | None = None) -> LayerOutput:
        q, k, v, conv_states = self.project_qkv(x, conv_states, rows)
        batch = x.shape[0]
        # '... t (n h d) -> ... (t n) h d': a row-major reshape, sub-steps of a token stay adjacent
        k = k.reshape(batch, -1, self.num_heads, self.head_k_dim)
        v = v.reshape(batch, -1, self.num_v_heads, self.head_v_dim)
        beta = delta_beta(self.b_proj(x), self.allow_neg_eigval)  # [B, T, n*H]: padding tokens masked before the split
        g = gdn_decay(self.a_proj(x), self.A_log, self.dt_bias) if self.use_forget_gate else None
        g, beta = identity_steps(rows, g, beta)
        beta = beta.reshape(batch, -1, self.num_v_heads)
        o, recurrent_state = gated_delta_rule(split_heads(q, self.head_k_dim), k, v, g, beta, recurrent_state,
                                              num_householder=self.num_householder, use_qk_l2norm=True)
        return self.project_out(o, x), conv_states, recurrent_state
