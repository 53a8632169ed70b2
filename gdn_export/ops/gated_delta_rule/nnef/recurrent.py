"""Decode-friendly lowering: a ``tract_core_scan`` whose step is batched matmuls on the state, any variant.

Where the portable scan broadcasts elementwise over the ``[K, V]`` state and reduces, this step reads it
through matmuls tract runs on its packed kernels: ``r = e S`` (row times state), the rank-1 update
``S += k (u - r)`` as a ``[K, 1] x [1, V]`` product, and the readout ``y = q S``. The state keeps its
size-1 scan axis (rank 6): tract 0.23.9 never finishes loading a scan body of that kind that squeezes
(tract_quirks.py; a rank-5 variant loaded in a probe and may be worth measuring). Measured slower than the scan on tract's CPU kernels (benchmarks/RESULTS.md):
no runtime's policy picks it, it is an explicit choice.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gdn_export.ops.gated_delta_rule.nnef.capabilities import F32
from gdn_export.ops.gated_delta_rule.nnef.layout import StepOperands, step_operands, write_outputs
from gdn_export.backends.nnef.builder import NnefBuilder
from gdn_export.ops.gated_delta_rule.nnef.steps import scan_fragment
from gdn_export.ops.gated_delta_rule.operands import Dims

if TYPE_CHECKING:
    from gdn_export.ops.gated_delta_rule.nnef.node import GdnNode
    from gdn_export.ops.options import LoweringOptions

NAME = "recurrent"
ALWAYS_EXACT = True


def refusal(node: GdnNode, dims: Dims, options: LoweringOptions) -> str | None:
    return None  # the reference recurrence itself, step by step


def matmul_step_fragment(num_householder: int, has_decay: bool):
    return scan_fragment(
        "recurrent", num_householder, has_decay, prologue=[],
        update=lambda s, j: f"{s} + matmul(k{j}_t, u{j}_t - matmul(e{j}_t, {s}))",
        readout="matmul(q_t, s_t)", y_axis=0, decay="decay_t",
    )


def lower_steps(b: NnefBuilder, ops: StepOperands, dims: Dims, state):
    """Run the matmul step over every token of ``ops``; return (y ``[T, B, Hk, G, V]``, final state)."""
    n, has_decay = dims.num_householder, ops.log_decay is not None
    fragment = matmul_step_fragment(n, has_decay)
    row = lambda x: b.unsqueeze(x, [4])  # noqa: E731  [T, B, Hk, G|1, K|V] -> [.., 1, K|V]
    column = lambda x: b.unsqueeze(x, [5])  # noqa: E731  -> [.., K, 1]
    operands = [row(ops.q)]
    for key, erase, write in zip(ops.keys, ops.erases, ops.writes):
        operands += [column(key), row(erase), row(write)]
    if has_decay:
        operands.append(column(b.unary("exp", ops.log_decay)))
    state = b.unsqueeze(state, [0])  # [1, B, Hk, G, K, V]
    y = b.tensor("recurrent_y", (dims.seq, dims.batch, dims.key_heads, dims.groups, 1, dims.width_v), F32)
    final = b.tensor("recurrent_state", state.shape, F32)
    b.multi_op(fragment.name, (*operands, state), (final, y))
    return b.squeeze(y, [4]), b.squeeze(final, [0]), fragment


def lower(b: NnefBuilder, node: GdnNode, dims: Dims, options: LoweringOptions) -> list:
    ops = step_operands(b, node, dims)
    s0 = b.split_axis(b.cast(node.s0, F32), 1, [dims.key_heads, dims.groups])  # [B, Hk, G, K, V]
    y, state, fragment = lower_steps(b, ops, dims, s0)
    write_outputs(b, node, dims, y, state)
    return [fragment]
