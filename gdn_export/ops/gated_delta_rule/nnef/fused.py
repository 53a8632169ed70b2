"""Fused lowering: tract's ``tract_transformers_gdn_recurrent`` (tract >= 0.23.5).

The operator takes ``[B, S, Hk, K]`` q/k, ``[B, S, H, V]`` v, ``[B, S, H]`` log-decay (f32) and beta,
an ``[B, H, K, V]`` state; it L2-normalizes q and k (eps 1e-6), scales q by 1/sqrt(K) and repeats key
heads itself, so grouped heads are never materialized here. ``refusal`` lets through only nodes whose
semantics are exactly these, on a tract version that runs them (capabilities.py).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from gdn_export.ops.gated_delta_rule.nnef.capabilities import F16, F32, fused_capability
from gdn_export.backends.nnef.builder import NnefBuilder
from gdn_export.ops.gated_delta_rule.operands import Dims

if TYPE_CHECKING:
    from gdn_export.ops.gated_delta_rule.nnef.node import GdnNode
    from gdn_export.ops.options import LoweringOptions

NAME = "native"
LABEL = "fused op"
OP_NAME = "tract_transformers_gdn_recurrent"
HEAD_MAJOR_TO_SEQ_MAJOR = {4: [0, 2, 1, 3], 3: [0, 2, 1]}


def refusal(node: GdnNode, dims: Dims, options: LoweringOptions) -> str | None:
    """Why the fused operator would not compute exactly this node on this tract version (None: it would)."""
    version = options.tract_version
    capability = fused_capability(version)
    version_name = ".".join(map(str, version))
    if not dims.is_plain_gdn:
        variant = ("no decay gate (DeltaNet)" if not dims.has_decay else "channel-wise decay" if dims.channel_decay
                   else "erase/write gates" if dims.gated_writes else f"{dims.num_householder} Householder sub-steps")
        return f"the fused op computes scalar-gated GDN only; this node has {variant}"
    if capability is None:
        return f"tract {version_name} has no tract_transformers_gdn_recurrent (first in 0.23.5)"
    if not node.use_qk_l2norm or node.scale is None:
        return ("q/k arrive already normalized; the fused op normalizes them again (eps 1e-6), "
                "which is not the same function")
    if not math.isclose(node.scale, 1.0 / math.sqrt(dims.width_k), rel_tol=1e-12):
        return f"scale {node.scale:g} is not 1/sqrt(K) = {1.0 / math.sqrt(dims.width_k):g}, the fused op's"
    if dims.width_k != dims.width_v:
        return f"K={dims.width_k} != V={dims.width_v} (the fused op needs K = V on every version)"
    rule = f"tract {version_name} runs the fused op only for {capability.describe()}"
    if not capability.any_width and dims.width_k != 128:
        return f"{rule}; this node has K = V = {dims.width_k}"
    if not capability.grouped_heads and dims.key_heads != dims.heads:
        return f"{rule}; this node has Hk={dims.key_heads} < H={dims.heads}"
    if not capability.any_sequence_length and (dims.seq != 1 or options.seq_may_vary):
        return f"{rule}; this node's sequence axis is {'symbolic' if options.seq_may_vary else dims.seq}"
    if operand_dtype(node, capability.operand_dtypes, options.core_f16) is None:
        found = sorted({np.dtype(t.dtype).name for t in (node.q, node.k, node.v, node.beta)})
        return f"{rule}; this node has {'/'.join(found)} q/k/v/beta"
    if F32 not in capability.state_dtypes:
        return f"{rule}; the state must be f32"
    return None


def note(node: GdnNode, dims: Dims, options: LoweringOptions) -> str:
    return "; q/k/v/beta rounded to float16 (core_dtype='float16' requested: not exact)" if options.core_f16 else ""


def operand_dtype(node: GdnNode, allowed: frozenset, core_f16: bool = False) -> np.dtype | None:
    """The one dtype q, k, v and beta go to the fused op in: their own one, f32 (widening every operand
    is exact), or f16 when the caller asked for an f16 core (rounding: never chosen otherwise)."""
    if core_f16:
        return F16 if F16 in allowed else None
    found = {np.dtype(t.dtype) for t in (node.q, node.k, node.v, node.beta)}
    if len(found) == 1 and next(iter(found)) in allowed:
        return next(iter(found))
    return F32 if F32 in allowed else None


def lower(builder: NnefBuilder, node: GdnNode, dims: Dims, options: LoweringOptions) -> list:
    dtype = operand_dtype(node, fused_capability(options.tract_version).operand_dtypes, options.core_f16)

    def seq_major(x):
        return builder.transpose(x, HEAD_MAJOR_TO_SEQ_MAJOR[len(x.shape)]) if node.head_major else x

    q, k, v, beta = (seq_major(builder.cast(t, dtype)) for t in (node.q, node.k, node.v, node.beta))
    log_decay = seq_major(builder.cast(node.g, F32))
    s0 = builder.cast(node.s0, F32)
    y = builder.tensor("fused_y", (dims.batch, dims.seq, dims.heads, dims.width_v), dtype)
    state = builder.tensor("fused_state", s0.shape, F32)
    builder.multi_op(OP_NAME, (q, k, v, log_decay, beta, s0), (y, state))
    # Every output leaves through one more op (a cast where dtypes differ; a same-dtype copy, which tract removes):
    # tract reports both outputs of a fused op under its first name, and export's output_names.py re-declares
    # any output tract still renames (tract_quirks.py).
    if node.head_major:
        y = builder.transpose(y, HEAD_MAJOR_TO_SEQ_MAJOR[4])
    builder.cast(y, node.y.dtype, out=node.y)
    builder.cast(state, node.s_final.dtype, out=node.s_final)
    return ["tract_transformers"]
