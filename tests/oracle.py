"""Independent oracles for the tests, in float64 numpy, written without gdn_export: the generalized recurrence of
docs/MATH.md token by token, and its chunk form over one chunk."""

from __future__ import annotations

import numpy as np


def l2norm(x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    return x / np.sqrt((x * x).sum(-1, keepdims=True) + eps)


def prepared(q, k, v, s0, g, beta, erase, write, scale, use_qk_l2norm):
    """The operands in float64 (None stays None), q and k normalized if asked, q scaled (default 1/sqrt(K))."""
    f64 = lambda x: None if x is None else np.asarray(x, dtype=np.float64)  # noqa: E731
    q, k, v, s0, g, beta, erase, write = map(f64, (q, k, v, s0, g, beta, erase, write))
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    return q * (1.0 / np.sqrt(q.shape[-1]) if scale is None else scale), k, v, s0, g, beta, erase, write


def delta_rule_seq_major(q, k, v, s0, *, g=None, beta=None, erase=None, write=None, num_householder=1, scale=None,
                         use_qk_l2norm=False):
    """The generalized recurrence (docs/MATH.md), seq-major: q [B, T, Hk, K]; k [B, T*n, Hk, K]; v [B, T*n, H, V];
    s0 [B, H, K, V]; g None / [B, T, H] / [B, T, H, K]; beta [B, T*n, H] or erase [B, T, H, K] + write [B, T, H, V]."""
    q, k, v, s0, g, beta, erase, write = prepared(q, k, v, s0, g, beta, erase, write, scale, use_qk_l2norm)
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


def delta_rule_one_chunk(q, k, v, s0, *, g=None, beta=None, erase=None, write=None, num_householder=1, scale=None,
                         use_qk_l2norm=False):
    """The same recurrence in its WY / UT chunk form, with the whole sequence as ONE chunk; arguments and results
    as ``delta_rule_seq_major``. Float64, dense ``np.linalg.solve``: nothing shared with gdn_export's bodies.

    Every sub-step i (token t = i // n) is one step of the plain delta rule with the erased key ``e_i = b_i * k_i``
    and written value ``u_i = w_i * v_i``; ``G_i`` is the log-decay summed over tokens 0..t (a token's decay
    applies at its first sub-step), per head or per key channel. Unrolling ``S_i = (I - k_i e_i^T) D_i S_{i-1} +
    k_i u_i^T`` gives ``S_i = exp(G_i) S_0 + sum_{j <= i} (exp(G_i - G_j) * k_j) delta_j^T`` with
        (I + A) delta = U - (E * exp(G)) S_0,      A_ij = e_i . (exp(G_i - G_j) * k_j) for j < i, 0 otherwise,
    the readout of token t after its last sub-step i: ``y_t = (exp(G_i) * q_t)^T S_0 + sum_{j <= i}
    (q_t . exp(G_i - G_j) * k_j) delta_j``, and the state after the chunk ``S_c`` the same sum at i = c - 1."""
    q, k, v, s0, g, beta, erase, write = prepared(q, k, v, s0, g, beta, erase, write, scale, use_qk_l2norm)
    n = num_householder
    batch, seq, key_heads, width_k = q.shape
    heads, steps = v.shape[2], seq * n
    token = np.arange(steps) // n  # the token of each sub-step
    last = np.arange(seq) * n + n - 1  # each token's last sub-step
    causal = np.tril(np.ones((steps, steps), dtype=bool))  # j <= i
    out, state = np.zeros((batch, seq, heads, v.shape[3])), np.zeros_like(s0)
    for b in range(batch):
        for h in range(heads):
            keys, queries, start = k[b, :, h // (heads // key_heads)], q[b, :, h // (heads // key_heads)], s0[b, h]
            erase_gate = erase[b, token, h] if erase is not None else beta[b, :, h, None]  # [c, K] or [c, 1]
            write_gate = write[b, token, h] if write is not None else beta[b, :, h, None]
            e, u = erase_gate * keys, write_gate * v[b, :, h]
            per_token = np.zeros((seq, 1)) if g is None else g[b, :, h].reshape(seq, -1)  # [T, 1] or [T, K]
            big_g = np.broadcast_to(np.cumsum(per_token, axis=0)[token], (steps, width_k))  # G_i [c, K]
            difference = np.where(causal[..., None], big_g[:, None, :] - big_g[None, :, :], -np.inf)  # masked: exp 0
            decayed_keys = np.exp(difference) * keys[None, :, :]  # [i, j, K]: exp(G_i - G_j) * k_j
            a = np.tril(np.einsum("ik,ijk->ij", e, decayed_keys), -1)
            delta = np.linalg.solve(np.eye(steps) + a, u - (e * np.exp(big_g)) @ start)
            readout = np.einsum("tk,tjk->tj", queries, decayed_keys[last])
            out[b, :, h] = (queries * np.exp(big_g[last])) @ start + readout @ delta
            state[b, h] = np.exp(big_g[-1])[:, None] * start + decayed_keys[-1].T @ delta
    return out, state


# --- Q4_0 (llama.cpp's and tract's block format), read and rounded here from the format's definition -------------

def nearest_blocks(x: np.ndarray) -> np.ndarray:
    """llama.cpp's quantize_row_q4_0_ref then dequantize, vectorized here on its own (d = extreme / -8 in f16,
    codes floor(x / d + 8.5) clamped to 0..15: a nibble)."""
    blocks = x.reshape(-1, 32).astype(np.float32)
    extreme = np.take_along_axis(blocks, np.abs(blocks).argmax(1)[:, None], 1)[:, 0]
    d = (extreme / np.float32(-8)).astype(np.float16).astype(np.float32)
    inv = np.where(d != 0, 1 / np.where(d != 0, d, 1), 0).astype(np.float32)
    codes = np.clip(np.floor(blocks * inv[:, None] + np.float32(8.5)), 0, 15)
    return (codes - 8) * d[:, None]


def decoded(stored: np.ndarray) -> np.ndarray:
    """Q4_0 bytes [blocks, 18] -> values [blocks, 32], read here from the format (f16 scale, low nibbles first)."""
    d = stored[:, :2].copy().view(np.float16).astype(np.float32)
    codes = np.concatenate([stored[:, 2:] & 15, stored[:, 2:] >> 4], axis=1).astype(np.float32)
    return (codes - 8) * d
