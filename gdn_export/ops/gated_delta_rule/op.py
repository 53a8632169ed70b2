"""``gated_delta_rule``: the delta-rule family in the layout of transformers and flash-linear-attention.

q ``[B, T, Hk, K]``; k ``[B, T*n, Hk, K]``; v ``[B, T*n, H, V]``; g None (DeltaNet), ``[B, T, H]`` (GDN) or
``[B, T, H, K]`` (KDA, GDN2); beta ``[B, T*n, H]``, or erase ``[B, T, H, K]`` and write ``[B, T, H, V]``
(GDN2); initial_state ``[B, H, K, V]``; n = num_householder sub-steps per token (Gated DeltaProduct,
sub-step j of token t at index t*n + j). Returns o ``[B, T, H, V]`` in q's dtype and the final state in
float32.

Two spellings reach the exporter as one node each: the function (a ``t2n_extra::gated_delta_rule``
custom op while traced) and the :class:`GatedDeltaRule` module (a module the extractor reifies).
Both keep q/k normalization and scale inside the node, so plain GDN with ``use_qk_l2norm=True`` and the
default scale is exactly tract's fused operator.
"""

from __future__ import annotations

import math
import warnings

import torch
from torch import nn

from gdn_export.ops.gated_delta_rule.operands import validate_operands
from gdn_export.ops.gated_delta_rule.naive import delta_rule_recurrence, l2norm
from gdn_export.ops.registration import define_or_reuse

QUALNAME = "t2n_extra::gated_delta_rule"
SCHEMA = (
    "(Tensor q, Tensor k, Tensor v, Tensor? g, Tensor? beta, Tensor? erase, Tensor? write, Tensor initial_state, "
    "float scale, bool use_qk_l2norm, int num_householder) -> (Tensor, Tensor)"
)


def _at_least_f32(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _check(q, k, v, g, beta, erase, write, initial_state, num_householder):
    shapes = {"q": q.shape, "k": k.shape, "v": v.shape, "s0": initial_state.shape,
              **{name: t.shape for name, t in (("g", g), ("beta", beta), ("erase", erase), ("write", write))
                 if t is not None}}
    return validate_operands(shapes, head_major=False, num_householder=num_householder)


def reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    beta: torch.Tensor | None,
    erase: torch.Tensor | None,
    write: torch.Tensor | None,
    initial_state: torch.Tensor,
    scale: float,
    use_qk_l2norm: bool,
    num_householder: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager math of the node: normalize, scale, run the recurrence head-major, return seq-major."""
    _check(q, k, v, g, beta, erase, write, initial_state, num_householder)
    out_dtype = q.dtype
    q, k = _at_least_f32(q), _at_least_f32(k)
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)

    def head_major(x):
        return None if x is None else x.transpose(1, 2)

    o, state = delta_rule_recurrence(
        head_major(q * scale), head_major(k), head_major(v), _at_least_f32(initial_state),
        g=head_major(g), beta=head_major(beta), erase=head_major(erase), write=head_major(write),
        num_householder=num_householder,
    )
    return o.transpose(1, 2).to(out_dtype).contiguous(), state.contiguous()


def _fake(q, k, v, g, beta, erase, write, initial_state, scale, use_qk_l2norm, num_householder):
    dims = _check(q, k, v, g, beta, erase, write, initial_state, num_householder)
    o = q.new_empty((dims.batch, dims.seq, dims.heads, dims.width_v))
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
    g: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    *,
    erase: torch.Tensor | None = None,
    write: torch.Tensor | None = None,
    num_householder: int = 1,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The generalized gated delta rule on ``[B, T, H, *]`` operands; returns ``(o, final_state)``.

    ``scale`` defaults to ``1/sqrt(K)`` and multiplies q in every variant; ``use_qk_l2norm`` normalizes q
    and every sub-step key over K first (eps 1e-6, as transformers' ``use_qk_l2norm_in_kernel``). A missing
    initial_state is a zero state. See the module docstring for the shapes of each variant.
    """
    if initial_state is None:
        from gdn_export.errors import OperandError

        if v.dim() != 4 or k.dim() != 4:
            bad = "v" if v.dim() != 4 else "k"
            raise OperandError(bad, "rank 4 [B, T, H, *]", f"rank {(v if bad == 'v' else k).dim()}")
        initial_state = v.new_zeros((v.shape[0], v.shape[2], k.shape[3], v.shape[3]), dtype=torch.float32)
    scale = default_scale(k.shape[-1]) if scale is None else float(scale)
    return torch.ops.t2n_extra.gated_delta_rule(q, k, v, g, beta, erase, write, initial_state, scale,
                                                bool(use_qk_l2norm), int(num_householder))


class GatedDeltaRule(nn.Module):
    """The gated delta rule as a module (GDN, KDA, DeltaProduct): exported as one node by its module extractor.

    Its forward is ``gated_delta_rule(q, k, v, g, beta, initial_state)`` with the options fixed at
    construction.
    """

    def __init__(self, *, scale: float | None = None, use_qk_l2norm: bool = False, num_householder: int = 1) -> None:
        super().__init__()
        self.scale = scale
        self.use_qk_l2norm = use_qk_l2norm
        self.num_householder = num_householder

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor | None,
        beta: torch.Tensor,
        initial_state: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The tracer orders a module's inputs by first use, and the extractor reads them in signature
        # order: touch them in that order before anything else (g is None for DeltaNet: no decay).
        q, k, v, g, beta, initial_state = (None if x is None else x.clone() for x in (q, k, v, g, beta, initial_state))
        scale = default_scale(k.shape[-1]) if self.scale is None else float(self.scale)
        return reference(q, k, v, g, beta, None, None, initial_state, scale, self.use_qk_l2norm, self.num_householder)
