"""Bringing a node's operands to the per-token scan layout (the scan, the recurrent step, the chunked tail).

Every per-token operand becomes f32 ``[T, B, Hk, G|1, ...]``: time first (the scan axis), value heads
split into (key head, group) so key-head tensors broadcast over their G value heads instead of being
repeated. The erase key ``e = b*k`` and written value ``u = w*v`` of each sub-step are formed here, where
they are vectorized over T.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from nnef_tools.model import Tensor as NTensor

from gdn_export.ops.gated_delta_rule.nnef.capabilities import F32
from gdn_export.backends.nnef.builder import NnefBuilder
from gdn_export.ops.gated_delta_rule.operands import Dims

L2NORM_EPS = 1e-6


@dataclass
class StepOperands:
    """Per-token operands, time first, all f32 and rank 5 ``[T, B, Hk, G|1, K|V]``."""

    q: NTensor  # [T, B, Hk, 1, K], normalized and scaled
    keys: list[NTensor]  # per sub-step [T, B, Hk, 1, K]
    erases: list[NTensor]  # per sub-step e = b*k, [T, B, Hk, G, K]
    writes: list[NTensor]  # per sub-step u = w*v, [T, B, Hk, G, V]
    log_decay: NTensor | None  # [T, B, Hk, G, 1] or per channel [T, B, Hk, G, K]


def step_operands(b: NnefBuilder, node, dims: Dims, substeps_split: bool = False) -> StepOperands:
    """``substeps_split``: the node's k, v and beta come with their sub-steps on an axis of their own, right
    after the time axis (``[B, T, n, H, X]``, head-major ``[B, H, T, n, X]``), as the chunked form cuts them."""
    seq_axis = 2 if node.head_major else 1
    n = dims.num_householder

    def time_first(x):
        """[B, T|H, H|T, ...] -> [T, B, H, ...] in f32."""
        x = b.cast(x, F32)
        return b.transpose(x, [seq_axis, 0, 3 - seq_axis] + list(range(3, len(x.shape))))

    def per_value_head(x):
        """[T, B, H, ...] -> [T, B, Hk, G, ...]."""
        return b.split_axis(x, 2, [dims.key_heads, dims.groups])

    def substeps(x):
        """The node's [B, T*n, ...] -> n tensors [T, B, ...] (sub-step j of token t sits at t*n + j)."""
        if n == 1:
            return [time_first(x)]
        if not substeps_split:
            x = b.split_axis(x, seq_axis, [-1, n])  # [B, T, n, ...]
        axis = seq_axis + 1
        return [time_first(b.squeeze(b.op("slice", x, shape=[*x.shape[:axis], 1, *x.shape[axis + 1:]],
                                          attribs={"axes": [axis], "begin": [j], "end": [j + 1]}), [axis]))
                for j in range(n)]

    q, k = b.cast(node.q, F32), b.cast(node.k, F32)
    if node.use_qk_l2norm:
        q, k = l2norm(b, q), l2norm(b, k)
    if node.scale is not None:
        q = b.binary("mul", q, b.scalar(node.scale, F32))
    q = b.unsqueeze(time_first(q), [3])  # [T, B, Hk, 1, K]
    keys = [b.unsqueeze(x, [3]) for x in substeps(k)]  # [T, B, Hk, 1, K]
    values = [per_value_head(x) for x in substeps(node.v)]  # [T, B, Hk, G, V]
    if node.beta is not None:
        betas = [b.unsqueeze(per_value_head(x), [4]) for x in substeps(node.beta)]  # [.., G, 1]
        erases = [b.binary("mul", beta, key) for beta, key in zip(betas, keys)]
        writes = [b.binary("mul", beta, value) for beta, value in zip(betas, values)]
    else:
        erases = [b.binary("mul", per_value_head(time_first(node.erase)), keys[0])]
        writes = [b.binary("mul", per_value_head(time_first(node.write)), values[0])]
    log_decay = None
    if node.g is not None:
        log_decay = per_value_head(time_first(node.g))
        if not dims.channel_decay:
            log_decay = b.unsqueeze(log_decay, [4])
    return StepOperands(q, keys, erases, writes, log_decay)


def write_outputs(b: NnefBuilder, node, dims: Dims, y_time_first: NTensor, state: NTensor) -> None:
    """y ``[T, B, Hk, G, V]`` and state ``[B, Hk, G, K, V]`` into the node's outputs, in its layout and dtypes."""
    y = b.merge_axes(y_time_first, 2, 2)  # [T, B, H, V]
    y = b.transpose(y, [1, 2, 0, 3] if node.head_major else [1, 0, 2, 3])
    b.cast(y, node.y.dtype, out=node.y)
    write_state(b, dims, state, node.s_final)


def step_state(b: NnefBuilder, state: NTensor) -> NTensor:
    """The node's state ``[B, H, K, V]`` as the elementwise step carries it: f32 ``[1, B, H, K, V]``."""
    return b.unsqueeze(b.cast(state, F32), [0])


def write_step_outputs(b: NnefBuilder, node, y: NTensor, state: NTensor) -> None:
    """The elementwise step's y ``[1, B, H, T, V]`` and state ``[1, B, H, K, V]`` into the node's outputs.

    Each is a squeeze of the leading unit axis written straight into the output: tract names a fragment's
    outputs after the fragment's inner nodes, and a squeeze is a node of its own, free, that keeps the output's
    name (output_names.py would otherwise re-declare it with a select: one copy of the state per call, 0.3 ms
    at H=16, K=V=128)."""
    write_squeezed(b, state, node.s_final)
    if node.head_major:
        write_squeezed(b, y, node.y)
    else:
        b.cast(b.transpose(b.squeeze(y, [0]), [0, 2, 1, 3]), node.y.dtype, out=node.y)


def write_squeezed(b: NnefBuilder, x: NTensor, out: NTensor) -> None:
    """f32 ``x [1, ...]`` without its leading axis into ``out``, cast to ``out``'s dtype."""
    if np.dtype(out.dtype) == np.dtype(F32):
        b.op("squeeze", x, shape=out.shape, attribs={"axes": [0]}, out=out)
    else:
        b.cast(b.squeeze(x, [0]), out.dtype, out=out)


def write_state(b: NnefBuilder, dims: Dims, state: NTensor, out: NTensor) -> None:
    """``[B, Hk, G, K, V]`` f32 (the recurrent lowering's state) into the node's state output. Without grouped heads
    a squeeze written straight into the output: no copy (tract merges it with the recurrent step's own squeeze, so
    output_names.py re-declares the name; the elementwise step's outputs go through ``write_step_outputs``)."""
    if dims.groups == 1 and np.dtype(out.dtype) == np.dtype(F32):
        b.op("squeeze", state, shape=out.shape, attribs={"axes": [2]}, out=out)
    else:
        b.cast(b.merge_axes(state, 1, 2), out.dtype, out=out)


def l2norm(b: NnefBuilder, x: NTensor) -> NTensor:
    """``x / sqrt(sum(x^2) + 1e-6)`` over the last axis, as the reference and tract's fused op."""
    squares = b.sum_reduce(b.binary("mul", x, x), [len(x.shape) - 1])
    inverse_norm = b.unary("rsqrt", b.binary("add", squares, b.scalar(L2NORM_EPS, F32)))
    return b.binary("mul", x, inverse_norm)
