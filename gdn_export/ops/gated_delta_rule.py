"""``gated_delta_rule``: the gated delta rule in the layout of transformers and flash-linear-attention.

q, k ``[B, T, Hk, K]``; v ``[B, T, H, V]``; g, beta ``[B, T, H]``; initial_state ``[B, H, K, V]``.
Returns o ``[B, T, H, V]`` in q's dtype and the final state in float32.

Two spellings reach the exporter as one node each: the function (a ``t2n_extra::gated_delta_rule``
custom op while traced) and the :class:`GatedDeltaRule` module (a module the extractor reifies).
Both keep q/k normalization and scale inside the node, so ``use_qk_l2norm=True`` with the default
scale is exactly tract's fused operator.
"""

from __future__ import annotations

import math
import warnings

import torch
from torch import nn

from gdn_export.errors import OperandError
from gdn_export.lowering.operands import validate_operands
from gdn_export.ops.naive import gated_delta_recurrence, l2norm
from gdn_export.ops.registration import define_or_reuse

QUALNAME = "t2n_extra::gated_delta_rule"
SCHEMA = (
    "(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor initial_state, float scale, "
    "bool use_qk_l2norm) -> (Tensor, Tensor)"
)


def _at_least_f32(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float32))


def reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor,
    scale: float,
    use_qk_l2norm: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager math of the node: normalize, scale, run the recurrence head-major, return seq-major."""
    shapes = {"q": q.shape, "k": k.shape, "v": v.shape, "g": g.shape, "beta": beta.shape, "s0": initial_state.shape}
    validate_operands(shapes, head_major=False)
    out_dtype = q.dtype
    if use_qk_l2norm:
        q, k = l2norm(_at_least_f32(q)), l2norm(_at_least_f32(k))
    o, state = gated_delta_recurrence(
        (_at_least_f32(q) * scale).transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        g.transpose(1, 2),
        beta.transpose(1, 2),
        _at_least_f32(initial_state),
    )
    return o.transpose(1, 2).to(out_dtype).contiguous(), state.contiguous()


def _fake(q, k, v, g, beta, initial_state, scale, use_qk_l2norm):
    shapes = {"q": q.shape, "k": k.shape, "v": v.shape, "g": g.shape, "beta": beta.shape, "s0": initial_state.shape}
    validate_operands(shapes, head_major=False)
    batch, seq = q.shape[:2]
    o = q.new_empty((batch, seq, v.shape[2], v.shape[3]))
    return o, initial_state.new_empty(initial_state.shape, dtype=torch.float32)


define_or_reuse(QUALNAME, SCHEMA, reference, _fake)


def default_scale(width_k: int) -> float:
    """1/sqrt(K). K is a static width, so reading it while traced is safe."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        return 1.0 / math.sqrt(int(width_k))


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated delta rule on ``[B, T, H, *]`` operands; returns ``(o, final_state)``.

    ``scale`` defaults to ``1/sqrt(K)``; ``use_qk_l2norm`` normalizes q and k over K first (eps 1e-6,
    as transformers' ``use_qk_l2norm_in_kernel``). A missing initial_state is a zero state.
    """
    if initial_state is None:
        if v.dim() != 4 or k.dim() != 4:
            raise OperandError("v" if v.dim() != 4 else "k", "rank 4 [B, T, H, *]", f"rank {v.dim() if v.dim() != 4 else k.dim()}")
        initial_state = v.new_zeros((v.shape[0], v.shape[2], k.shape[3], v.shape[3]), dtype=torch.float32)
    scale = default_scale(k.shape[-1]) if scale is None else float(scale)
    return torch.ops.t2n_extra.gated_delta_rule(q, k, v, g, beta, initial_state, scale, bool(use_qk_l2norm))


class GatedDeltaRule(nn.Module):
    """The gated delta rule as a module: exported as one node by its module extractor.

    Its forward is ``gated_delta_rule`` with the options fixed at construction.
    """

    def __init__(self, *, scale: float | None = None, use_qk_l2norm: bool = False) -> None:
        super().__init__()
        self.scale = scale
        self.use_qk_l2norm = use_qk_l2norm

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        initial_state: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The tracer orders a module's inputs by first use, and the extractor reads them in signature
        # order: touch them in that order before anything else.
        q, k, v, g, beta, initial_state = (x.clone() for x in (q, k, v, g, beta, initial_state))
        scale = default_scale(k.shape[-1]) if self.scale is None else float(self.scale)
        return reference(q, k, v, g, beta, initial_state, scale, self.use_qk_l2norm)
