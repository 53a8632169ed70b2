"""An independent oracle for the tests: FAMILY.md's recurrence in float64 numpy, written without gdn_export."""

from __future__ import annotations

import numpy as np


def l2norm(x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    return x / np.sqrt((x * x).sum(-1, keepdims=True) + eps)


def gated_delta_seq_major(q, k, v, g, beta, s0, *, scale=None, use_qk_l2norm=False):
    """q, k [B, T, Hk, K]; v [B, T, H, V]; g, beta [B, T, H]; s0 [B, H, K, V] -> (o [B, T, H, V], state)."""
    q, k, v, g, beta, s0 = (np.asarray(x, dtype=np.float64) for x in (q, k, v, g, beta, s0))
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q = q * (1.0 / np.sqrt(q.shape[-1]) if scale is None else scale)
    groups = v.shape[2] // q.shape[2]
    q, k = np.repeat(q, groups, axis=2), np.repeat(k, groups, axis=2)
    state = s0.copy()
    out = np.zeros(v.shape, dtype=np.float64)
    for t in range(q.shape[1]):
        for b in range(q.shape[0]):
            for h in range(v.shape[2]):
                s = state[b, h] * np.exp(g[b, t, h])
                kt, vt = k[b, t, h], v[b, t, h]
                s = s + np.outer(kt, beta[b, t, h] * (vt - s.T @ kt))
                state[b, h] = s
                out[b, t, h] = s.T @ q[b, t, h]
    return out, state


def gated_delta_head_major(q, k, v, g, beta, s0):
    """The custom op's contract: head-major, q/k used as given (no normalization, no scale)."""
    t = lambda x: np.swapaxes(np.asarray(x, dtype=np.float64), 1, 2)  # noqa: E731
    o, state = gated_delta_seq_major(t(q), t(k), t(v), t(g), t(beta), s0, scale=1.0)
    return np.swapaxes(o, 1, 2), state
