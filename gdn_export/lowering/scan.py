"""Portable lowering: a ``tract_core_scan`` over one token per step, elementwise body (steps.py), for every
variant, any length (symbolic too), on every tract version."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gdn_export.lowering.capabilities import F32
from gdn_export.lowering.layout import step_operands, write_outputs
from gdn_export.lowering.nnef_builder import NnefBuilder
from gdn_export.lowering.steps import elementwise_step_fragment, step_inputs
from gdn_export.ops.operands import Dims

if TYPE_CHECKING:
    from gdn_export.lowering.node import GdnNode
    from gdn_export.lowering.options import LoweringOptions

NAME = "scan"
ALWAYS_EXACT = True


def refusal(node: GdnNode, dims: Dims, options: LoweringOptions) -> str | None:
    return None  # the reference recurrence itself, step by step


def lower(b: NnefBuilder, node: GdnNode, dims: Dims, options: LoweringOptions) -> list:
    ops = step_operands(b, node, dims)
    fragment = elementwise_step_fragment("delta", dims.num_householder, ops.log_decay is not None)
    y = b.tensor("scan_y", (dims.batch, dims.key_heads, dims.groups, dims.seq, dims.width_v), F32)
    state = b.tensor("scan_state", ops.s0.shape, F32)
    b.multi_op(fragment.name, (*step_inputs(b, ops), ops.s0), (y, state))
    write_outputs(b, node, dims, b.transpose(y, [3, 0, 1, 2, 4]), state)
    return [fragment]
