"""Portable lowering: a ``tract_core_scan`` over one token per step, elementwise body (steps.py), for every
variant, any length (symbolic too), on every tract version."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gdn_export.ops.gated_delta_rule.nnef.capabilities import F32
from gdn_export.ops.gated_delta_rule.nnef.layout import step_operands, step_state, write_step_outputs
from gdn_export.backends.nnef.builder import NnefBuilder
from gdn_export.ops.gated_delta_rule.nnef.steps import elementwise_step_fragment, step_inputs
from gdn_export.ops.gated_delta_rule.operands import Dims

if TYPE_CHECKING:
    from gdn_export.ops.gated_delta_rule.nnef.node import GdnNode
    from gdn_export.ops.options import LoweringOptions

NAME = "scan"
ALWAYS_EXACT = True


def refusal(node: GdnNode, dims: Dims, options: LoweringOptions) -> str | None:
    return None  # the reference recurrence itself, step by step


def lower(b: NnefBuilder, node: GdnNode, dims: Dims, options: LoweringOptions) -> list:
    ops = step_operands(b, node, dims)
    fragment = elementwise_step_fragment("delta", dims.num_householder, ops.log_decay is not None)
    y = b.tensor("scan_y", (1, dims.batch, dims.heads, dims.seq, dims.width_v), F32)
    state = b.tensor("scan_state", (1, *node.s0.shape), F32)
    b.multi_op(fragment.name, (*step_inputs(b, ops, dims.groups), step_state(b, node.s0)), (state, y))
    write_step_outputs(b, node, y, state)
    return [fragment]
