"""Portable lowering: a ``tract_core_scan`` over one token per step, for any S, heads, widths and dtypes.

Every operand is brought to f32 and to the layout ``[T, B, Hk, G, K|1, V|1]`` outside the scan; the body
squeezes the scan axis and works on a rank-5 state ``[B, Hk, G, K, V]`` (keeping the size-1 scan axis on
the state measured 4x slower in tract 0.23.9). The body is elementwise arithmetic and reductions only:
tract 0.23.9 never finishes loading a scan body that mixes squeeze/unsqueeze with a matmul on the state.
Key heads are broadcast over their G value heads, never repeated. The state stays f32 inside the scan.

Per step, with e = beta*k (erase key) and u = beta*v (write value):
    S = S * exp(g);  S = S + k * (u - sum_K(S * e));  y = sum_K(S * q)
which is the recurrence of ``gdn_export.ops.naive.gated_delta_recurrence``.
"""

from __future__ import annotations

from torch_to_nnef.op.fragment import Fragment

from gdn_export.lowering.capabilities import F32
from gdn_export.lowering.nnef_builder import NnefBuilder
from gdn_export.lowering.operands import Dims

STEP = "gdn_export_delta_step"
SCAN = "gdn_export_delta_scan"
L2NORM_EPS = 1e-6

FRAGMENT = Fragment(
    name=SCAN,
    extensions=("tract_registry tract_core",),
    definition=f"""fragment {STEP}(
    s_prev: tensor<scalar>, q_t: tensor<scalar>, k_t: tensor<scalar>, e_t: tensor<scalar>,
    u_t: tensor<scalar>, decay_t: tensor<scalar>
) -> ( s_t: tensor<scalar>, y_t: tensor<scalar> ) {{
    q = squeeze(q_t, axes = [0]);
    k = squeeze(k_t, axes = [0]);
    e = squeeze(e_t, axes = [0]);
    u = squeeze(u_t, axes = [0]);
    decay = squeeze(decay_t, axes = [0]);
    s_decayed = s_prev * decay;
    recalled = sum_reduce(s_decayed * e, axes = [3]);
    s_t = s_decayed + k * (u - recalled);
    y_t = sum_reduce(s_t * q, axes = [3]);
}}

fragment {SCAN}(
    q: tensor<scalar>, k: tensor<scalar>, e: tensor<scalar>, u: tensor<scalar>, decay: tensor<scalar>,
    s_init: tensor<scalar>
) -> ( y: tensor<scalar>, s_final: tensor<scalar> ) {{
    (y, s_final) = tract_core_scan(
        body = "{STEP}",
        scan = [("q_t", q, 0, 1), ("k_t", k, 0, 1), ("e_t", e, 0, 1), ("u_t", u, 0, 1), ("decay_t", decay, 0, 1)],
        full = [],
        state = [("s_prev", s_init, "s_t")],
        output = [("y_t", "full", 3, 1), ("s_t", "last", 0, 1)],
        skip = 0
    );
}}

""",
)


def lower(b: NnefBuilder, node, dims: Dims) -> list:
    time_first = {4: [2, 0, 1, 3], 3: [2, 0, 1]} if node.head_major else {4: [1, 0, 2, 3], 3: [1, 0, 2]}

    def prepare(x, heads_split: bool, unsqueeze: list[int]):
        x = b.transpose(b.cast(x, F32), time_first[len(x.shape)])  # [T, B, heads, ...]
        if heads_split:
            x = b.split_axis(x, 2, [dims.key_heads, dims.groups])
        return b.unsqueeze(x, unsqueeze)

    q, k = b.cast(node.q, F32), b.cast(node.k, F32)
    if node.use_qk_l2norm:
        q, k = _l2norm(b, q), _l2norm(b, k)
    if node.scale is not None:
        q = b.binary("mul", q, b.scalar(node.scale, F32))
    q = prepare(q, False, [3, 5])  # [T, B, Hk, 1, K, 1]
    k = prepare(k, False, [3, 5])
    v = prepare(node.v, True, [4])  # [T, B, Hk, G, 1, V]
    beta = prepare(node.beta, True, [4, 5])  # [T, B, Hk, G, 1, 1]
    decay = b.unary("exp", prepare(node.g, True, [4, 5]))
    erase = b.binary("mul", beta, k)  # [T, B, Hk, G, K, 1]
    write = b.binary("mul", beta, v)
    s0 = b.split_axis(b.cast(node.s0, F32), 1, [dims.key_heads, dims.groups])  # [B, Hk, G, K, V]

    y = b.tensor("scan_y", (dims.batch, dims.key_heads, dims.groups, dims.seq, dims.width_v), F32)
    state = b.tensor("scan_state", s0.shape, F32)
    b.multi_op(SCAN, (q, k, erase, write, decay, s0), (y, state))

    # [B, Hk, G, T, V] -> head-major [B, H, T, V] or seq-major [B, T, H, V]
    y = b.merge_axes(y, 1, 2)
    if not node.head_major:
        y = b.transpose(y, [0, 2, 1, 3])
    b.cast(y, node.y.dtype, out=node.y)
    b.cast(b.merge_axes(state, 1, 2), node.s_final.dtype, out=node.s_final)
    return [FRAGMENT]


def _l2norm(b: NnefBuilder, x):
    """``x / sqrt(sum(x^2) + 1e-6)`` over the last axis, as the reference and tract's fused op."""
    squares = b.sum_reduce(b.binary("mul", x, x), [len(x.shape) - 1])
    inverse_norm = b.unary("rsqrt", b.binary("add", squares, b.scalar(L2NORM_EPS, F32)))
    return b.binary("mul", x, inverse_norm)
