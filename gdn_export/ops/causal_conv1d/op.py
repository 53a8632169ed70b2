"""``t2n_extra::causal_conv1d_update``: the short depthwise causal conv of GDN layers, with its carried state, + SiLU.

x ``[B, C, S]``, weight ``[C, W]``, state ``[B, C, W]`` (the last W inputs before this call, oldest first;
zeros at the start), bias ``[C]`` or None (Mamba2's conv has one: added before the SiLU). Returns
``silu(conv + bias)`` ``[B, C, S]`` in x's dtype and the new state (the last W inputs).
The layout of transformers' conv cache and of tract's ``tract_transformers_causal_conv1d_update``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gdn_export.errors import OperandError
from gdn_export.ops.registration import define_or_reuse

QUALNAME = "t2n_extra::causal_conv1d_update"
SCHEMA = "(Tensor x, Tensor weight, Tensor state, Tensor? bias=None) -> (Tensor, Tensor)"


@dataclass(frozen=True)
class ConvNode:
    """One short-conv node as ``decide`` sees it (``ops.protocol.Node``): the plan and the dtype it computes in."""

    name: str
    entry: str = QUALNAME
    dtype: str = "float32"  # numpy's name of the conv's arithmetic dtype (the weight's)
    bias: bool = False  # a bias before the SiLU (tract's fused op has none)


def check_conv_operands(x_shape, weight_shape, state_shape, bias_shape=None) -> None:
    x_shape, weight_shape, state_shape = (tuple(int(d) for d in s) for s in (x_shape, weight_shape, state_shape))
    if len(x_shape) != 3:
        raise OperandError("x", "rank 3 [B, C, S]", f"rank {len(x_shape)} {list(x_shape)}")
    if len(weight_shape) != 2 or weight_shape[0] != x_shape[1]:
        raise OperandError("weight", f"[C, W] with C={x_shape[1]}", str(list(weight_shape)))
    expected = (x_shape[0], x_shape[1], weight_shape[1])
    if state_shape != expected:
        raise OperandError("state", f"[B, C, W] = {list(expected)}", str(list(state_shape)))
    if bias_shape is not None and tuple(int(d) for d in bias_shape) != (x_shape[1],):
        raise OperandError("bias", f"[C] with C={x_shape[1]}", str(list(bias_shape)))


def reference(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor,
              bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The conv as W shifted multiply-adds (the same sum transformers' F.conv1d computes), then the bias."""
    check_conv_operands(x.shape, weight.shape, state.shape, None if bias is None else bias.shape)
    width, seq = weight.shape[1], x.shape[2]
    full = torch.cat([state.to(x.dtype), x], dim=-1).to(weight.dtype)
    out = sum(weight[None, :, i, None] * full[:, :, 1 + i : 1 + i + seq] for i in range(width))
    if bias is not None:
        out = out + bias.to(weight.dtype)[None, :, None]
    return torch.nn.functional.silu(out).to(x.dtype), full[:, :, -width:].to(state.dtype).contiguous()


def _fake(x, weight, state, bias=None):
    check_conv_operands(x.shape, weight.shape, state.shape, None if bias is None else bias.shape)
    return torch.empty_like(x), torch.empty_like(state)


define_or_reuse(QUALNAME, SCHEMA, reference, _fake)


def causal_conv1d_update(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor,
                         bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Call ``torch.ops.t2n_extra.causal_conv1d_update``: (silu(conv(state ++ x) + bias), new state)."""
    if bias is None:  # the three-operand node every bias-free conv has always been
        return torch.ops.t2n_extra.causal_conv1d_update(x, weight, state)
    return torch.ops.t2n_extra.causal_conv1d_update(x, weight, state, bias)
