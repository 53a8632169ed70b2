"""Portable lowering: a ``tract_core_scan`` over one token per step, for every variant, any S, heads and widths.

Every operand is brought to f32 and to the layout ``[T, B, Hk, G, K|1, V|1]`` outside the scan (where
it is vectorized over T): the erase key ``e = b*k`` and the written value ``u = w*v`` of each sub-step and
the decay ``exp(g)`` are computed there. The body squeezes the scan axis and works on a rank-5 state
``[B, Hk, G, K, V]`` (keeping the size-1 scan axis on the state measured 4x slower in tract 0.23.9). The
body is elementwise arithmetic and reductions only: tract 0.23.9 never finishes loading a scan body that
mixes squeeze/unsqueeze with a matmul on the state. Key heads are broadcast over their G value heads,
never repeated. The state stays f32 inside the scan.

Per token (FAMILY.md section 6), for each of the n sub-steps j:
    S = S * exp(g)                      (once, before the first sub-step; per channel or per head)
    S = S + k_j * (u_j - sum_K(S * e_j))
    y = sum_K(S * q)                    (after the last sub-step)
which is the recurrence of ``gdn_export.ops.naive.delta_rule_recurrence``.
"""

from __future__ import annotations

from torch_to_nnef.op.fragment import Fragment

from gdn_export.lowering.capabilities import F32
from gdn_export.lowering.nnef_builder import NnefBuilder
from gdn_export.lowering.operands import Dims

L2NORM_EPS = 1e-6


def scan_fragment(num_householder: int, has_decay: bool) -> Fragment:
    """The body and scan fragments for one variant (n sub-steps, with or without decay)."""
    suffix = f"n{num_householder}{'_decay' if has_decay else ''}"
    step, scan = f"gdn_export_delta_step_{suffix}", f"gdn_export_delta_scan_{suffix}"
    steps = range(num_householder)
    per_step = [f"{kind}{j}" for j in steps for kind in ("k", "e", "u")]
    inputs = ["q"] + per_step + (["decay"] if has_decay else [])
    body = [f"    {name} = squeeze({name}_t, axes = [0]);" for name in inputs]
    state = "s_prev"
    if has_decay:
        body.append("    s_decayed = s_prev * decay;")
        state = "s_decayed"
    for j in steps:
        nxt = "s_t" if j == num_householder - 1 else f"s_{j}"
        body.append(f"    {nxt} = {state} + k{j} * (u{j} - sum_reduce({state} * e{j}, axes = [3]));")
        state = nxt
    body.append("    y_t = sum_reduce(s_t * q, axes = [3]);")
    signature = ", ".join(f"{name}_t: tensor<scalar>" for name in inputs)
    scan_args = ", ".join(f"{name}: tensor<scalar>" for name in inputs)
    scanned = ", ".join(f'("{name}_t", {name}, 0, 1)' for name in inputs)
    definition = f"""fragment {step}(
    s_prev: tensor<scalar>, {signature}
) -> ( s_t: tensor<scalar>, y_t: tensor<scalar> ) {{
{chr(10).join(body)}
}}

fragment {scan}(
    {scan_args}, s_init: tensor<scalar>
) -> ( y: tensor<scalar>, s_final: tensor<scalar> ) {{
    (y, s_final) = tract_core_scan(
        body = "{step}",
        scan = [{scanned}],
        full = [],
        state = [("s_prev", s_init, "s_t")],
        output = [("y_t", "full", 3, 1), ("s_t", "last", 0, 1)],
        skip = 0
    );
}}

"""
    return Fragment(name=scan, extensions=("tract_registry tract_core",), definition=definition)


def lower(b: NnefBuilder, node, dims: Dims) -> list:
    seq_axis = 2 if node.head_major else 1
    n = dims.num_householder

    def time_first(x):
        """[B, T|H, H|T, ...] -> [T, B, H, ...] in f32."""
        x = b.cast(x, F32)
        axes = [seq_axis, 0, 3 - seq_axis] + list(range(3, len(x.shape)))
        return b.transpose(x, axes)

    def per_value_head(x, unsqueeze):
        """[T, B, H, ...] -> [T, B, Hk, G, ...] plus size-1 axes so every operand has rank 6."""
        return b.unsqueeze(b.split_axis(x, 2, [dims.key_heads, dims.groups]), unsqueeze)

    def substeps(x):
        """[T*n, B, ...] -> n tensors [T, B, ...] (sub-step j of token t sits at t*n + j)."""
        if n == 1:
            return [x]
        split = b.split_axis(x, 0, [-1, n])  # [T, n, B, ...]
        return [b.squeeze(b.op("slice", split, shape=[split.shape[0], 1, *split.shape[2:]],
                                attribs={"axes": [1], "begin": [j], "end": [j + 1]}), [1]) for j in range(n)]

    q, k = b.cast(node.q, F32), b.cast(node.k, F32)
    if node.use_qk_l2norm:
        q, k = _l2norm(b, q), _l2norm(b, k)
    if node.scale is not None:
        q = b.binary("mul", q, b.scalar(node.scale, F32))
    q = b.unsqueeze(time_first(q), [3, 5])  # [T, B, Hk, 1, K, 1]
    keys = [b.unsqueeze(x, [3, 5]) for x in substeps(time_first(k))]  # [T, B, Hk, 1, K, 1]
    values = [per_value_head(x, [4]) for x in substeps(time_first(node.v))]  # [T, B, Hk, G, 1, V]
    if node.beta is not None:
        betas = [per_value_head(x, [4, 5]) for x in substeps(time_first(node.beta))]  # [.., 1, 1]
        erases = [b.binary("mul", beta, key) for beta, key in zip(betas, keys)]
        writes = [b.binary("mul", beta, value) for beta, value in zip(betas, values)]
    else:
        erases = [b.binary("mul", per_value_head(time_first(node.erase), [5]), keys[0])]  # [.., K, 1]
        writes = [b.binary("mul", per_value_head(time_first(node.write), [4]), values[0])]  # [.., 1, V]
    operands = [q] + [t for j in range(n) for t in (keys[j], erases[j], writes[j])]
    if node.g is not None:
        decay = time_first(node.g)
        operands.append(b.unary("exp", per_value_head(decay, [5] if dims.channel_decay else [4, 5])))
    s0 = b.split_axis(b.cast(node.s0, F32), 1, [dims.key_heads, dims.groups])  # [B, Hk, G, K, V]

    fragment = scan_fragment(n, node.g is not None)
    y = b.tensor("scan_y", (dims.batch, dims.key_heads, dims.groups, dims.seq, dims.width_v), F32)
    state = b.tensor("scan_state", s0.shape, F32)
    b.multi_op(fragment.name, (*operands, s0), (y, state))

    # [B, Hk, G, T, V] -> head-major [B, H, T, V] or seq-major [B, T, H, V]
    y = b.merge_axes(y, 1, 2)
    if not node.head_major:
        y = b.transpose(y, [0, 2, 1, 3])
    b.cast(y, node.y.dtype, out=node.y)
    b.cast(b.merge_axes(state, 1, 2), node.s_final.dtype, out=node.s_final)
    return [fragment]


def _l2norm(b: NnefBuilder, x):
    """``x / sqrt(sum(x^2) + 1e-6)`` over the last axis, as the reference and tract's fused op."""
    squares = b.sum_reduce(b.binary("mul", x, x), [len(x.shape) - 1])
    inverse_norm = b.unary("rsqrt", b.binary("add", squares, b.scalar(L2NORM_EPS, F32)))
    return b.binary("mul", x, inverse_norm)
