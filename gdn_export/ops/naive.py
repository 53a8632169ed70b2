"""The reference math of the gated delta rule: the one implementation every other form is checked against.

Head-major layout (time on axis 2), as in ``../shared/docs/FAMILY.md`` section 1:

    S_t = (I - beta_t k_t k_t^T) exp(g_t) S_{t-1} + beta_t k_t v_t^T
    y_t = S_t^T q_t

Value head ``h`` reads key head ``h // (H / Hk)`` (repeat_interleave, never tile). q and k are used as
given: normalization and scaling belong to the caller (``gated_delta_rule`` does both).
"""

from __future__ import annotations

import torch


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last axis, in x's dtype.

    eps is added, not clamped (``l2norm(0) == 0``): the same function as transformers' ``l2norm`` and
    tract's fused operator.
    """
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """The recurrence runs in at least float32, in float64 when any operand is float64."""
    dtype = torch.float32
    for tensor in tensors:
        dtype = torch.promote_types(dtype, tensor.dtype)
    return dtype


def gated_delta_recurrence(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    s0: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token gated delta rule.

    q, k ``[B, Hk, T, K]``; v ``[B, H, T, V]``; g, beta ``[B, H, T]``; s0 ``[B, H, K, V]``.
    Returns y ``[B, H, T, V]`` in ``promote_types(q.dtype, s0.dtype)`` and the final state in s0's dtype.
    """
    out_dtype = torch.promote_types(q.dtype, s0.dtype)
    dtype = compute_dtype(q, k, v, g, beta, s0)
    groups = v.shape[1] // k.shape[1]
    q, k = (x.to(dtype).repeat_interleave(groups, dim=1) for x in (q, k))
    v, g, beta = (x.to(dtype) for x in (v, g, beta))
    state = s0.to(dtype)
    outputs = []
    for t in range(q.shape[2]):
        k_t = k[:, :, t]
        state = state * g[:, :, t].exp()[..., None, None]
        recalled = torch.einsum("bhkv,bhk->bhv", state, k_t)
        delta = (v[:, :, t] - recalled) * beta[:, :, t, None]
        state = state + k_t[..., None] * delta[..., None, :]
        outputs.append(torch.einsum("bhkv,bhk->bhv", state, q[:, :, t]))
    y = torch.stack(outputs, dim=2) if outputs else v.new_zeros(v.shape, dtype=dtype)
    return y.to(out_dtype), state.to(s0.dtype)
