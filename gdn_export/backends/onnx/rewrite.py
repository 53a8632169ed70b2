"""Replaces the ``gdn_export::*`` placeholders of an exported ONNX graph by the form each node's decision picked:
each placeholder op type's rewriter (registered by its op, ``registry.placeholder``) decides and writes it with
the ``Builder`` here (ops/gated_delta_rule/onnx.py, ops/causal_conv1d/onnx.py, ops/moe_ffn/onnx.py).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from gdn_export.backends.onnx.registry import PLACEHOLDERS, Context, OnnxOptions
from gdn_export.backends.onnx.symbolics import DOMAIN
from gdn_export.errors import GdnExportError

MS_DOMAIN = "com.microsoft"
DTYPES = {"Float": TensorProto.FLOAT, "Half": TensorProto.FLOAT16, "Double": TensorProto.DOUBLE,
           "BFloat16": TensorProto.BFLOAT16}
INT64_MAX = np.iinfo(np.int64).max


class Builder:
    """Appends nodes (to ``nodes``) with names under ``prefix``; constants are ``Constant`` nodes (a Scan body must
    not read the outer graph's initializers in tract)."""

    def __init__(self, prefix: str, nodes: list | None = None) -> None:
        self.prefix, self.nodes, self.count = prefix, [] if nodes is None else nodes, 0

    def name(self, hint: str) -> str:
        self.count += 1
        return f"{self.prefix}/{hint}_{self.count}"

    def op(self, op_type: str, inputs: list[str], outputs: int | list[str] = 1, domain: str = "", **attrs):
        names = [self.name(op_type.lower()) for _ in range(outputs)] if isinstance(outputs, int) else outputs
        self.nodes.append(helper.make_node(op_type, inputs, names, name=self.name(op_type), domain=domain, **attrs))
        return names[0] if len(names) == 1 else names

    def const(self, value, dtype=np.int64) -> str:
        return self.op("Constant", [], value=numpy_helper.from_array(np.asarray(value, dtype=dtype)))

    def cast(self, x: str, to: int) -> str:
        return self.op("Cast", [x], to=to)

    def unsqueeze(self, x: str, axes) -> str:
        return self.op("Unsqueeze", [x, self.const(list(axes))])

    def squeeze(self, x: str, axes) -> str:
        return self.op("Squeeze", [x, self.const(list(axes))])

    def transpose(self, x: str, perm) -> str:
        return self.op("Transpose", [x], perm=list(perm))

    def reshape(self, x: str, shape) -> str:
        return self.op("Reshape", [x, self.const(list(shape))])

    def slice(self, x: str, start: int, end: int, axis: int) -> str:
        return self.op("Slice", [x, self.const([start]), self.const([end]), self.const([axis])])


def _attrs(node) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def operand_info(attrs: dict) -> tuple[list[list[int]], list[str]]:
    shapes, flat = [], list(attrs.get("shapes", []))
    for rank in attrs.get("ranks", []):
        shapes.append([int(d) for d in flat[:rank]])
        flat = flat[rank:]
    dtypes = attrs["dtypes"].decode().split(",") if isinstance(attrs["dtypes"], bytes) else attrs["dtypes"].split(",")
    return shapes, dtypes


def rewrite(model: onnx.ModelProto, runtime: str, lowering: str, traced: dict | None = None) -> list:
    """Replace every placeholder in ``model`` (in place); return the Decisions, in graph order. ``traced``: op type
    -> the tensor operands' shapes of each call, in the order the example ran them (the graph's order)."""
    nodes = []
    context = Context(OnnxOptions(runtime, lowering), {op: list(shapes) for op, shapes in (traced or {}).items()})
    for node in model.graph.node:
        if node.domain != DOMAIN:
            nodes.append(node)
            continue
        rewriter = PLACEHOLDERS.get(node.op_type)
        if rewriter is None:
            raise GdnExportError(f"unknown placeholder {node.domain}::{node.op_type} (no op registered its ONNX "
                                 "lowering: gdn_export/ops/onnx_handlers.py)")
        recorded = len(context.decisions)
        rewriter(Builder(node.name or node.output[0], nodes), node, _attrs(node), context)
        if len(context.decisions) != recorded + 1:
            raise GdnExportError(f"the rewriter of {node.domain}::{node.op_type} recorded "
                                 f"{len(context.decisions) - recorded} decisions for one node (ops.protocol.record)")
    decisions = context.decisions
    used_ms = any(d.lowering == "contrib" for d in decisions)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    opsets = [o for o in model.opset_import if o.domain not in (DOMAIN, MS_DOMAIN)]
    if used_ms:
        opsets.append(helper.make_opsetid(MS_DOMAIN, 1))
    del model.opset_import[:]
    model.opset_import.extend(opsets)
    # the placeholders' outputs had made-up types; shape inference gives them again where it can
    kept = {o.name for o in model.graph.output}
    value_info = [v for v in model.graph.value_info if v.name in kept]
    del model.graph.value_info[:]
    model.graph.value_info.extend(value_info)
    return decisions
