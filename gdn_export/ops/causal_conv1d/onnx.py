"""``t2n_extra::causal_conv1d_update`` in ONNX: ``contrib`` is ``com.microsoft::CausalConvWithState`` with
``activation='silu'``, fed ``state[:, :, 1:]`` (the op keeps W-1 past inputs, our state W: the oldest never
reaches an output), the new state a slice of ``state ++ x`` as in the reference; ``portable`` a depthwise ``Conv``
over ``state[:, :, 1:] ++ x`` then SiLU. A conv bias (Mamba2's) is the bias input of either."""

from __future__ import annotations

from gdn_export.backends.onnx.registry import (CONTRIB_VERIFIED, Context, OnnxOptions, ort_version, placeholder,
                                               symbolic)
from gdn_export.backends.onnx.symbolics import is_none, placeholder_node, set_like
from gdn_export.backends.onnx.rewrite import INT64_MAX, MS_DOMAIN, Builder, DTYPES, operand_info
from gdn_export.errors import GdnExportError
from gdn_export.ops.causal_conv1d.op import QUALNAME, ConvNode
from gdn_export.ops.protocol import Decision, record


def decide(node: ConvNode, plan: OnnxOptions) -> Decision:
    """The short conv in ONNX (``ops.protocol.Decide``): onnxruntime's contrib op where verified, else portable."""
    if plan.runtime == "onnxruntime" and plan.lowering != "scan":
        version = ort_version()
        if version is not None and version >= CONTRIB_VERIFIED:
            return Decision(node.name, node.entry, "contrib", "com.microsoft::CausalConvWithState (activation silu) "
                            "on state[:, :, 1:] (its W-1 past inputs); the new state a slice of state ++ x", None)
    return Decision(node.name, node.entry, "portable", "depthwise ONNX Conv over state[:, :, 1:] ++ x, then SiLU",
                    None)


@symbolic(QUALNAME)
def symbolic_conv(g, x, weight, state, bias=None):
    operands = [x, weight, state] + ([] if bias is None or is_none(bias) else [bias])
    y, new_state = placeholder_node(g, "CausalConv1dUpdate", operands, 2)
    set_like(y, x, 3)
    set_like(new_state, state, 3)
    return y, new_state


def _lower_conv(b: Builder, node, decision, shapes, dtypes) -> None:
    x, weight, state, *rest = node.input
    y_out, state_out = node.output
    width = shapes[1][1] if len(shapes) > 1 and len(shapes[1]) == 2 else None
    if width is None:
        raise GdnExportError(f"{node.name}: the conv weight's traced shape is unknown")
    dtype = DTYPES[dtypes[0]]
    if dtypes[2] != dtypes[0]:
        state = b.cast(state, dtype)
    full = b.op("Concat", [state, x], axis=2)
    b.op("Slice", [full, b.const([-width]), b.const([INT64_MAX]), b.const([2])], [state_out])
    weight3 = b.unsqueeze(weight if dtypes[1] == dtypes[0] else b.cast(weight, dtype), [1])  # [C, 1, W]
    bias = [rest[0] if dtypes[3] == dtypes[0] else b.cast(rest[0], dtype)] if rest else []  # [C]
    if decision.lowering == "contrib":
        past = b.slice(state, 1, INT64_MAX, 2)
        b.op("CausalConvWithState", [x, weight3, *(bias or [""]), past], [y_out, b.name("present")],
             domain=MS_DOMAIN, activation="silu")
    else:
        conv = b.op("Conv", [b.slice(full, 1, INT64_MAX, 2), weight3, *bias], group=shapes[0][1],
                    kernel_shape=[width])
        b.op("Mul", [conv, b.op("Sigmoid", [conv])], [y_out])


@placeholder("CausalConv1dUpdate")
def rewrite_conv(b: Builder, node, attrs: dict, context: Context) -> None:
    shapes, dtypes = operand_info(attrs)
    decision = record(decide, ConvNode(node.output[-1]), context.options, context.decisions)
    _lower_conv(b, node, decision, shapes, dtypes)
