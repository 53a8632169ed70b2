"""The reference math of the delta-rule family: the one implementation every other form is checked against.

Head-major layout (time on axis 2). One recurrence covers the family (``docs/MATH.md``):

    S_t = (I - k_t (b_t * k_t)^T) Diag(exp g_t) S_{t-1} + k_t (w_t * v_t)^T,    y_t = S_t^T q_t

GDN: scalar g and b = w = beta; KDA: per-channel g; GDN2: erase b and write w gates; DeltaNet: no g;
Gated DeltaProduct: n sub-steps per token (g before the first, the readout after the last). Value head
``h`` reads key head ``h // (H / Hk)`` (repeat_interleave, never tile). q and k are used as given:
normalization and scaling belong to the caller (``gated_delta_rule`` does both).
"""

from __future__ import annotations

import torch


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last axis, in x's dtype.

    eps is added, not clamped (``l2norm(0) == 0``): the same function as transformers' ``l2norm`` and
    tract's fused operator.
    """
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def compute_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """The recurrence runs in at least float32, in float64 when any operand is float64."""
    dtype = torch.float32
    for tensor in tensors:
        if tensor is not None:
            dtype = torch.promote_types(dtype, tensor.dtype)
    return dtype


def delta_rule_recurrence(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    s0: torch.Tensor,
    *,
    g: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
    erase: torch.Tensor | None = None,
    write: torch.Tensor | None = None,
    num_householder: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token generalized delta rule.

    q ``[B, Hk, T, K]``; k ``[B, Hk, T*n, K]``; v ``[B, H, T*n, V]``; s0 ``[B, H, K, V]``;
    g None, ``[B, H, T]`` or ``[B, H, T, K]``; either beta ``[B, H, T*n]`` or erase ``[B, H, T, K]`` and
    write ``[B, H, T, V]`` (n = 1). Returns y ``[B, H, T, V]`` in ``promote_types(q.dtype, s0.dtype)`` and
    the final state in s0's dtype.
    """
    out_dtype = torch.promote_types(q.dtype, s0.dtype)
    dtype = compute_dtype(q, k, v, s0, g, beta, erase, write)
    groups = v.shape[1] // k.shape[1]
    q, k = (x.to(dtype).repeat_interleave(groups, dim=1) for x in (q, k))
    v = v.to(dtype)
    g, beta, erase, write = (None if x is None else x.to(dtype) for x in (g, beta, erase, write))
    state = s0.to(dtype)
    outputs = []
    for t in range(q.shape[2]):
        if g is not None:
            decay = g[:, :, t].exp()
            state = state * (decay[..., None, None] if decay.dim() == 2 else decay[..., :, None])
        for j in range(num_householder):
            step = t * num_householder + j
            k_t, v_t = k[:, :, step], v[:, :, step]
            erase_key = k_t * (beta[:, :, step, None] if beta is not None else erase[:, :, t])
            written = v_t * (beta[:, :, step, None] if beta is not None else write[:, :, t])
            update = written - torch.einsum("bhkv,bhk->bhv", state, erase_key)
            state = state + k_t[..., None] * update[..., None, :]
        outputs.append(torch.einsum("bhkv,bhk->bhv", state, q[:, :, t]))
    y = torch.stack(outputs, dim=2) if outputs else v.new_zeros((*v.shape[:2], 0, v.shape[3]), dtype=dtype)
    return y.to(out_dtype), state.to(s0.dtype)


def gated_delta_recurrence(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, s0: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated DeltaNet: the scalar-gated case, ``y_t = S_t^T q_t`` with
    ``S_t = (I - beta_t k_t k_t^T) exp(g_t) S_{t-1} + beta_t k_t v_t^T``.

    q, k ``[B, Hk, T, K]``; v ``[B, H, T, V]``; g, beta ``[B, H, T]``; s0 ``[B, H, K, V]``.
    """
    return delta_rule_recurrence(q, k, v, s0, g=g, beta=beta)
