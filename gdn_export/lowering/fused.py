"""Fused lowering: tract's ``tract_transformers_gdn_recurrent`` (tract >= 0.23.5).

The operator takes ``[B, S, Hk, K]`` q/k, ``[B, S, H, V]`` v, ``[B, S, H]`` log-decay (f32) and beta,
an ``[B, H, K, V]`` state; it L2-normalizes q and k (eps 1e-6), scales q by 1/sqrt(K) and repeats key
heads itself, so grouped heads are never materialized here. The emitter only sends nodes whose
semantics are exactly these.
"""

from __future__ import annotations

import numpy as np

from gdn_export.lowering.capabilities import F32
from gdn_export.lowering.nnef_builder import NnefBuilder
from gdn_export.lowering.operands import Dims

OP_NAME = "tract_transformers_gdn_recurrent"
HEAD_MAJOR_TO_SEQ_MAJOR = {4: [0, 2, 1, 3], 3: [0, 2, 1]}


def lower(builder: NnefBuilder, node, dims: Dims, operand_dtype: np.dtype) -> list:
    def seq_major(x):
        return builder.transpose(x, HEAD_MAJOR_TO_SEQ_MAJOR[len(x.shape)]) if node.head_major else x

    q, k, v, beta = (seq_major(builder.cast(t, operand_dtype)) for t in (node.q, node.k, node.v, node.beta))
    log_decay = seq_major(builder.cast(node.g, F32))
    s0 = builder.cast(node.s0, F32)
    y = builder.tensor("fused_y", (dims.batch, dims.seq, dims.heads, dims.width_v), operand_dtype)
    state = builder.tensor("fused_state", s0.shape, F32)
    builder.multi_op(OP_NAME, (q, k, v, log_decay, beta, s0), (y, state))
    # Every output leaves through one more op: tract renames tensors that a fused op writes directly.
    if node.head_major:
        y = builder.transpose(y, HEAD_MAJOR_TO_SEQ_MAJOR[4])
    _write(builder, y, node.y)
    _write(builder, state, node.s_final)
    return ["tract_transformers"]


def _write(builder: NnefBuilder, value, out) -> None:
    builder.cast(value, out.dtype, out=out)
