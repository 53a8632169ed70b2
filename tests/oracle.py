"""An independent oracle for the tests: FAMILY.md's recurrence in float64 numpy, written without gdn_export."""

from __future__ import annotations

import numpy as np


def l2norm(x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    return x / np.sqrt((x * x).sum(-1, keepdims=True) + eps)


def delta_rule_seq_major(q, k, v, s0, *, g=None, beta=None, erase=None, write=None, num_householder=1, scale=None,
                         use_qk_l2norm=False):
    """FAMILY.md section 6, seq-major: q [B, T, Hk, K]; k [B, T*n, Hk, K]; v [B, T*n, H, V]; s0 [B, H, K, V];
    g None / [B, T, H] / [B, T, H, K]; beta [B, T*n, H] or erase [B, T, H, K] + write [B, T, H, V]."""
    f64 = lambda x: None if x is None else np.asarray(x, dtype=np.float64)  # noqa: E731
    q, k, v, s0, g, beta, erase, write = map(f64, (q, k, v, s0, g, beta, erase, write))
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q = q * (1.0 / np.sqrt(q.shape[-1]) if scale is None else scale)
    n = num_householder
    batch, seq, heads = q.shape[0], q.shape[1], v.shape[2]
    group = heads // q.shape[2]
    state = s0.copy()
    out = np.zeros((batch, seq, heads, v.shape[3]))
    for b in range(batch):
        for h in range(heads):
            s = state[b, h]
            for t in range(seq):
                if g is not None:
                    decay = np.exp(g[b, t, h])
                    s = s * (decay[:, None] if np.ndim(decay) == 1 else decay)
                for j in range(n):
                    step = t * n + j
                    kk = k[b, step, h // group]
                    b_gate = erase[b, t, h] if erase is not None else beta[b, step, h]
                    w_gate = write[b, t, h] if write is not None else beta[b, step, h]
                    # S = (I - k (b*k)^T) S + k (w*v)^T
                    s = s - np.outer(kk, (b_gate * kk) @ s) + np.outer(kk, w_gate * v[b, step, h])
                out[b, t, h] = s.T @ q[b, t, h // group]
            state[b, h] = s
    return out, state


def gated_delta_seq_major(q, k, v, g, beta, s0, *, scale=None, use_qk_l2norm=False):
    """GDN: q, k [B, T, Hk, K]; v [B, T, H, V]; g, beta [B, T, H]; s0 [B, H, K, V]."""
    return delta_rule_seq_major(q, k, v, s0, g=g, beta=beta, scale=scale, use_qk_l2norm=use_qk_l2norm)


def gated_delta_head_major(q, k, v, g, beta, s0):
    """The custom op's contract: head-major, q/k used as given (no normalization, no scale)."""
    t = lambda x: np.swapaxes(np.asarray(x, dtype=np.float64), 1, 2)  # noqa: E731
    o, state = gated_delta_seq_major(t(q), t(k), t(v), t(g), t(beta), s0, scale=1.0)
    return np.swapaxes(o, 1, 2), state
