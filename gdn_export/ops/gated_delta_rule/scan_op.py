"""``t2n_extra::gated_delta_scan``: the head-major gated delta rule as one torch custom op.

Contract (shared with torch-to-nnef-llm, which defines the same op name):
q, k ``[B, Hk, T, K]`` pre-normalized (q = l2norm(q)/sqrt(K), k = l2norm(k)); v ``[B, H, T, V]``;
g, beta ``[B, H, T]``; s0 ``[B, H, K, V]``. Returns y ``[B, H, T, V]`` in ``promote_types(q.dtype, s0.dtype)``
and the final state like s0. The op itself computes the plain recurrence (no normalization): the emitter
keeps that meaning whatever lowering it picks.
"""

from __future__ import annotations

import torch

from gdn_export.ops.gated_delta_rule.operands import validate_operands
from gdn_export.ops.gated_delta_rule.naive import gated_delta_recurrence
from gdn_export.ops.registration import define_or_reuse

QUALNAME = "t2n_extra::gated_delta_scan"
SCHEMA = "(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor s0) -> (Tensor, Tensor)"


def _check(q, k, v, g, beta, s0) -> None:
    shapes = {"q": q.shape, "k": k.shape, "v": v.shape, "g": g.shape, "beta": beta.shape, "s0": s0.shape}
    validate_operands(shapes, head_major=True)


def _reference(q, k, v, g, beta, s0):
    _check(q, k, v, g, beta, s0)
    y, state = gated_delta_recurrence(q, k, v, g, beta, s0)
    return y.contiguous(), state.contiguous()


def _fake(q, k, v, g, beta, s0):
    _check(q, k, v, g, beta, s0)
    batch, _, seq, _ = q.shape
    heads, width_v = v.shape[1], v.shape[3]
    y = q.new_empty((batch, heads, seq, width_v), dtype=torch.promote_types(q.dtype, s0.dtype))
    return y, torch.empty_like(s0)


def gated_delta_scan(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, s0: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Call ``torch.ops.t2n_extra.gated_delta_scan``."""
    return torch.ops.t2n_extra.gated_delta_scan(q, k, v, g, beta, s0)


define_or_reuse(QUALNAME, SCHEMA, _reference, _fake)
