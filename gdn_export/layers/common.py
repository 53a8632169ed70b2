"""Building blocks shared by the FLA-compatible layers: short conv, norms, gates, MLP.

Each class keeps the parameter names and shapes of its flash-linear-attention (FLA) counterpart
(``fla/modules``) so checkpoints load unchanged, and computes the same math in plain torch ops that export.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from gdn_export.models.blocks import layer_normalize, rms_normalize, short_conv, swiglu
from gdn_export.models.row_lengths import RowLengths


class ShortConvolution(nn.Module):
    """FLA's ``ShortConvolution`` (a depthwise causal ``nn.Conv1d`` + SiLU) with its cache passed explicitly.

    ``weight [C, 1, W]`` as in ``nn.Conv1d(C, C, W, groups=C)``. The state ``[B, C, W]`` holds the last W
    inputs (oldest first), FLA's conv cache layout. Only the SiLU activation and no bias can be exported:
    the conv is one ``causal_conv1d_update`` node, which has neither a bias nor another activation.
    """

    def __init__(self, hidden_size: int, kernel_size: int, bias: bool = False, activation: str | None = "silu") -> None:
        super().__init__()
        if bias:
            raise NotImplementedError("ShortConvolution with bias=True (conv_bias) is not supported: the exported "
                                      "causal_conv1d_update has no bias")
        if activation not in ("silu", "swish"):
            raise NotImplementedError(f"ShortConvolution activation {activation!r} is not supported: the exported "
                                      "causal_conv1d_update always applies SiLU")
        self.hidden_size, self.kernel_size = hidden_size, kernel_size
        self.weight = nn.Parameter(torch.randn(hidden_size, 1, kernel_size) / math.sqrt(kernel_size))

    def forward(self, x: torch.Tensor, state: torch.Tensor,
                rows: RowLengths | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x ``[B, S, C]`` -> (silu(conv) ``[B, S, C]``, new state ``[B, C, W]``; with ``rows``, each row's at its
        own last real token)."""
        y, state = short_conv(x.transpose(1, 2), self.weight.squeeze(1), state, rows)
        return y.transpose(1, 2), state


class RMSNorm(nn.Module):
    """FLA's ``RMSNorm`` (and ``nn.RMSNorm``): plain ``weight`` (init ones), optional ``bias``, f32 math."""

    def __init__(self, hidden_size: int, elementwise_affine: bool = True, bias: bool = False,
                 eps: float = 1e-5) -> None:
        super().__init__()
        self.hidden_size, self.eps = hidden_size, eps
        self.weight = nn.Parameter(torch.ones(hidden_size)) if elementwise_affine else None
        self.bias = nn.Parameter(torch.zeros(hidden_size)) if elementwise_affine and bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = rms_normalize(x, self.eps)
        if self.weight is not None:
            y = y * self.weight.float()
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(x.dtype)


class LayerNorm(nn.Module):
    """``torch.nn.LayerNorm`` over the last axis with its ``weight`` (init ones) and ``bias`` (init zeros), f32 math
    (``models.blocks.layer_normalize``), one cast back; Megatron's ``normalization: LayerNorm``."""

    def __init__(self, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.hidden_size, self.eps = hidden_size, eps
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.bias = nn.Parameter(torch.zeros(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (layer_normalize(x, self.eps) * self.weight.float() + self.bias.float()).to(x.dtype)


class FusedRMSNormGated(nn.Module):
    """FLA's ``FusedRMSNormGated``: ``weight ⊙ rmsnorm(x) ⊙ act(g)``, all in f32, one cast at the end.

    activation ``swish``/``silu`` (``g·σ(g)``) or ``sigmoid`` (``σ(g)``); the norm runs before the gate.
    """

    def __init__(self, hidden_size: int, elementwise_affine: bool = True, eps: float = 1e-5,
                 activation: str = "swish") -> None:
        super().__init__()
        if activation not in ("swish", "silu", "sigmoid"):
            raise ValueError(f"Unsupported activation: {activation}")
        self.hidden_size, self.eps, self.activation = hidden_size, eps, activation
        self.weight = nn.Parameter(torch.ones(hidden_size)) if elementwise_affine else None

    def forward(self, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        y = rms_normalize(x, self.eps)
        if self.weight is not None:
            y = y * self.weight.float()
        gate = g.float()
        y = y * (F.silu(gate) if self.activation in ("swish", "silu") else torch.sigmoid(gate))
        return y.to(x.dtype)


class GatedMLP(nn.Module):
    """FLA's ``GatedMLP`` (swiglu): ``down_proj(silu(gate_proj(x)) ⊙ up_proj(x))``, no biases.

    Without ``intermediate_size`` it is ``hidden·hidden_ratio·2/3`` rounded up to a multiple of 256, as FLA.
    """

    def __init__(self, hidden_size: int, hidden_ratio: int | None = None, intermediate_size: int | None = None,
                 hidden_act: str = "swish") -> None:
        super().__init__()
        if hidden_act != "swish":
            raise NotImplementedError(f"GatedMLP hidden_act {hidden_act!r} is not supported (only 'swish')")
        self.intermediate_size = mlp_width(hidden_size, hidden_ratio, intermediate_size)
        self.gate_proj = nn.Linear(hidden_size, self.intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, self.intermediate_size, bias=False)
        self.down_proj = nn.Linear(self.intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return swiglu(x, self.gate_proj, self.up_proj, self.down_proj)


def mlp_width(hidden_size: int, hidden_ratio: int | None, intermediate_size: int | None) -> int:
    if intermediate_size is not None:
        return int(intermediate_size)
    width = int(hidden_size * (4 if hidden_ratio is None else hidden_ratio) * 2 / 3)
    return 256 * ((width + 255) // 256)


def decay_parameters(a_count: int, dt_count: int, a_low: float, a_high: float) -> tuple[nn.Parameter, nn.Parameter]:
    """``A_log [a_count]`` and ``dt_bias [dt_count]`` with FLA's gate init: ``A_log = log U(a_low, a_high)``;
    ``dt_bias`` = inv-softplus of dt log-uniform in [1e-3, 0.1] (floor 1e-4). Checkpoints overwrite both."""
    with torch.no_grad():
        a_log = torch.empty(a_count).uniform_(a_low, a_high).log()
        dt = torch.exp(torch.rand(dt_count) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3)).clamp(min=1e-4)
        return nn.Parameter(a_log), nn.Parameter(dt + torch.log(-torch.expm1(-dt)))


def split_heads(x: torch.Tensor, width: int) -> torch.Tensor:
    """``[B, S, H·d] -> [B, S, H, d]`` (einops ``'... (h d) -> ... h d'``)."""
    return x.reshape(*x.shape[:-1], -1, width)
