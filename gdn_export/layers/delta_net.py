"""FLA's ``DeltaNet`` layer (``fla/layers/delta_net.py``) in plain torch, state passed explicitly."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gdn_export.layers.base import ConvStates, DeltaLayer, LayerOutput
from gdn_export.layers.common import split_heads
from gdn_export.models.blocks import identity_steps
from gdn_export.models.row_lengths import RowLengths
from gdn_export.ops.gated_delta_rule.op import gated_delta_rule

QK_ACTIVATIONS = {
    "silu": F.silu,
    "relu": F.relu,
    "elu": lambda x: (F.elu(x, 1.0, False) + 1.0).to(x),  # FLA's elu_p1
    "identity": lambda x: x,
}


class DeltaNet(DeltaLayer):
    """The ungated delta rule: ``β = σ(b)`` (or 1 without ``use_beta``; ×2 with ``allow_neg_eigval``), no decay.

    FLA defaults: hidden 1024, expand_k = expand_v = 1, num_heads 4 (head widths ``hidden·expand/num_heads``),
    ungated output (plain f32 RMSNorm; ``use_gate`` adds ``g_proj`` + swish FusedRMSNormGated), qk_activation
    silu, qk_norm l2 (in kernel; ``sum`` divides by the sum instead). With short convs the q/k conv carries the
    activation, so only ``silu`` exports there. FLA's layer ignores the model's ``use_output_norm``.
    """

    def __init__(self, mode: str = "chunk", d_model: int | None = None, hidden_size: int = 1024,
                 expand_k: float = 1.0, expand_v: float = 1.0, num_heads: int = 4, use_beta: bool = True,
                 use_gate: bool = False, use_short_conv: bool = True, conv_size: int = 4, conv_bias: bool = False,
                 allow_neg_eigval: bool = False, layer_idx: int | None = None, qk_activation: str = "silu",
                 qk_norm: str = "l2", norm_eps: float = 1e-5, **kwargs) -> None:
        super().__init__()
        if qk_activation not in QK_ACTIVATIONS:
            raise ValueError(f"qk_activation {qk_activation!r} is not one of {', '.join(QK_ACTIVATIONS)}")
        if qk_norm not in ("l2", "sum"):
            raise ValueError(f"qk_norm {qk_norm!r} is not one of l2, sum")
        if use_short_conv and qk_activation != "silu":
            raise NotImplementedError(f"qk_activation {qk_activation!r} with short convs: FLA's q/k conv then has no "
                                      "activation, and the exported conv always applies SiLU")
        hidden_size = d_model if d_model is not None else hidden_size
        key_dim, value_dim = int(hidden_size * expand_k), int(hidden_size * expand_v)
        if key_dim % num_heads or value_dim % num_heads:
            raise ValueError(f"key dim {key_dim} and value dim {value_dim} must be divisible by num_heads={num_heads}")
        self.num_heads = self.num_v_heads = num_heads
        self.head_k_dim, self.head_v_dim = key_dim // num_heads, value_dim // num_heads
        self.qk_activation, self.qk_norm, self.use_beta = qk_activation, qk_norm, use_beta
        self.allow_neg_eigval, self.layer_idx = allow_neg_eigval, layer_idx
        self._init_io(hidden_size, key_dim, key_dim, value_dim, use_short_conv=use_short_conv, conv_size=conv_size,
                      conv_bias=conv_bias, output_gate="linear" if use_gate else None, norm_eps=norm_eps,
                      value_dim=value_dim)
        if use_beta:
            self.b_proj = nn.Linear(hidden_size, num_heads, bias=False)

    def project_qkv(self, x: torch.Tensor, conv_states: ConvStates,
                    rows: RowLengths | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, ConvStates]:
        if self.use_short_conv or self.qk_activation == "silu":
            return super().project_qkv(x, conv_states, rows)
        act = QK_ACTIVATIONS[self.qk_activation]  # no conv: FLA applies it after the head split (elementwise)
        return act(self.q_proj(x)), act(self.k_proj(x)), F.silu(self.v_proj(x)), ()

    def forward(self, x: torch.Tensor, conv_states: ConvStates, recurrent_state: torch.Tensor,
                rows: RowLengths | None = None) -> LayerOutput:
        q, k, v, conv_states = self.project_qkv(x, conv_states, rows)
        q, k, v = split_heads(q, self.head_k_dim), split_heads(k, self.head_k_dim), split_heads(v, self.head_v_dim)
        if self.qk_norm == "sum":
            q, k = q / q.sum(-1, keepdim=True), k / k.sum(-1, keepdim=True)
        beta = self.b_proj(x).sigmoid() if self.use_beta else torch.ones_like(q[..., 0])
        if self.allow_neg_eigval:
            beta = beta * 2.0
        (beta,) = identity_steps(rows, beta)
        o, recurrent_state = gated_delta_rule(q, k, v, None, beta, recurrent_state,
                                              use_qk_l2norm=self.qk_norm == "l2")
        return self.project_out(o, x), conv_states, recurrent_state
