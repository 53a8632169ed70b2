"""``t2n_extra::causal_conv1d_update`` in NNEF: tract's fused op where the target has it, else plain NNEF.

The fused ``tract_transformers_causal_conv1d_update(x [B, C, S], weight [C, W], state [B, C, W])`` exists
from tract 0.23.5 and runs any S, symbolic too (probed against numpy: it convolves the last W-1 state
columns and x, applies SiLU, and returns the last W inputs as the new state). The portable form (tract
before 0.23.5) is NNEF's depthwise ``conv`` over ``state[:, :, 1:] ++ x``: no symbolic S is baked in.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from nnef_tools.model import Tensor as NTensor

from gdn_export.backends.nnef.builder import NnefBuilder
from gdn_export.backends.nnef.registry import custom_op, output_tensors, positional, require_tract
from gdn_export.ops.causal_conv1d.op import ConvNode, check_conv_operands
from gdn_export.ops.options import policy_of
from gdn_export.ops.protocol import Decision, record

if TYPE_CHECKING:
    from gdn_export.ops.options import LoweringOptions

FUSED_CONV_FIRST_VERSION = (0, 23, 5)
OP_NAME = "tract_transformers_causal_conv1d_update"


def decide(node: ConvNode, options: LoweringOptions) -> Decision:
    """The short conv on the target version (``ops.protocol.Decide``): "native" (the fused op) or "portable"."""
    if options.tract_version >= FUSED_CONV_FIRST_VERSION:
        return Decision(node.name, node.entry, "native", f"{OP_NAME} exists on this tract", None)
    return Decision(node.name, node.entry, "portable", f"{OP_NAME} is not in tract before 0.23.5", None)


def lower(builder: NnefBuilder, x: NTensor, weight: NTensor, state: NTensor, y: NTensor, new_state: NTensor,
          lowering: str) -> list:
    width = int(weight.shape[1])
    if lowering == "native":
        weight = builder.cast(weight, x.dtype)
        state_in = builder.cast(state, x.dtype)
        out = builder.tensor("conv_y", x.shape, x.dtype)
        carried = builder.tensor("conv_state", state.shape, x.dtype)
        builder.multi_op(OP_NAME, (x, weight, state_in), (out, carried))
        builder.cast(out, y.dtype, out=y)  # see fused.py: outputs of a fused op share one name
        builder.cast(carried, new_state.dtype, out=new_state)
        return ["tract_transformers"]

    # state[:, :, 1:] ++ x holds S + W - 1 columns, so a valid depthwise conv of width W gives exactly S: tract
    # proves that length, where W shifted slices of state ++ x had lengths it could not equate with S
    dtype = np.dtype(weight.dtype)
    tail = builder.op("slice", builder.cast(state, x.dtype), shape=(x.shape[0], x.shape[1], width - 1),
                      attribs={"axes": [2], "begin": [1], "end": [width]}, what="conv_tail")
    full_shape = (x.shape[0], x.shape[1], x.shape[2] + width - 1)
    full = builder.op("concat", [tail, x], shape=full_shape, dtype=x.dtype, attribs={"axis": 2}, what="conv_full")
    full = builder.cast(full, dtype)
    kernel = builder.unsqueeze(weight, [1])  # [C, 1, W]: one input channel per group
    total = builder.op("conv", (full, kernel, builder.scalar(0.0, dtype)), shape=x.shape, dtype=dtype, what="conv",
                       attribs={"border": "constant", "padding": [(0, 0)], "stride": [1], "dilation": [1],
                                "groups": 0})
    activated = builder.binary("mul", total, builder.unary("sigmoid", total))
    builder.cast(activated, y.dtype, out=y)
    last = builder.op("dyn_slice_begin", full, shape=(x.shape[0], x.shape[1], width),
                      attribs={"axis": 2, "begin": -width, "stride": 1}, what="conv_last")
    builder.cast(last, new_state.dtype, out=new_state)
    # torch-to-nnef's fragment: a slice whose bound counts from the end of a symbolic axis
    return ["dyn_slice_begin", "within_bound_index"]


@custom_op("causal_conv1d_update")
def handle_causal_conv1d_update(g, node, name_to_tensor, op_helper, inference_target, **kwargs):
    """The GDN short conv: tract's fused conv op where the target has it, else portable slices."""
    require_tract(inference_target, node.kind)
    x, weight, state = positional(op_helper, node)
    check_conv_operands(x.shape, weight.shape, state.shape)
    y, new_state = output_tensors(op_helper, node, name_to_tensor)
    target = policy_of(inference_target)
    decision = record(decide, ConvNode(y.name), target.gdn_options, target.gdn_decisions)
    return lower(NnefBuilder(g, y.name), x, weight, state, y, new_state, decision.lowering)
