"""Replaces the ``gdn_export::*`` placeholders of an exported ONNX graph by the form each node's decision picked.

``GatedDeltaRule`` -> ``com.microsoft::GatedDeltaNet`` or a portable ``Scan`` over the reference recurrence
(``ops/naive.py``: the same steps, in float32); ``CausalConv1dUpdate`` -> ``com.microsoft::CausalConvWithState``
or a depthwise ``Conv``; ``MoeFfn`` -> the dense experts. Decisions: ``gdn_export.ops.gated_delta_rule.onnx``.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from gdn_export.errors import GdnExportError
from gdn_export.ops.gated_delta_rule import onnx as onnx_decisions
from gdn_export.ops.gated_delta_rule.operands import validate_operands
from gdn_export.ops.moe_ffn.op import widening
from gdn_export.backends.onnx.symbolics import DOMAIN

MS_DOMAIN = "com.microsoft"
_DTYPES = {"Float": TensorProto.FLOAT, "Half": TensorProto.FLOAT16, "Double": TensorProto.DOUBLE,
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


def _operand_info(attrs: dict) -> tuple[list[list[int]], list[str]]:
    shapes, flat = [], list(attrs.get("shapes", []))
    for rank in attrs.get("ranks", []):
        shapes.append([int(d) for d in flat[:rank]])
        flat = flat[rank:]
    dtypes = attrs["dtypes"].decode().split(",") if isinstance(attrs["dtypes"], bytes) else attrs["dtypes"].split(",")
    return shapes, dtypes


def _rule_parts(node, attrs, traced: list | None = None):
    """Operand names by role, their traced shapes and dtypes. ``traced``: the operands' shapes seen when the op ran
    on the example inputs (the graph's types can leave a head count symbolic); else the graph's static sizes."""
    shapes, dtypes = _operand_info(attrs)
    if traced is not None:
        if len(traced) != len(shapes) or any(len(t) != len(s) or any(d not in (-1, e) for d, e in zip(s, t))
                                             for s, t in zip(shapes, traced)):
            raise GdnExportError(f"{node.name}: the operands' traced shapes {traced} disagree with the graph's {shapes}")
        shapes = [list(t) for t in traced]
    present = attrs["present"].decode() if isinstance(attrs["present"], bytes) else attrs["present"]
    roles = ["q", "k", "v"] + [r for r, p in zip(("g", "beta", "erase", "write"), present) if p == "1"] + ["s0"]
    if len(roles) != len(node.input) or len(shapes) != len(roles):
        raise GdnExportError(f"{node.name}: placeholder with {len(node.input)} operands, expected {roles}")
    # dynamic axes (-1: batch, time) get one stand-in length (time: 1 token, n sub-steps for k, v, beta) so that the
    # static sizes (heads, widths, sub-steps) are validated as the NNEF emitter validates them
    # a size the trace left symbolic besides B and T (a head count of a reshape to -1) is taken from an operand
    # that has it; validate_operands then checks them all as the NNEF emitter does
    n = int(attrs.get("num_householder", 1))
    head_major = bool(attrs.get("head_major", 0))
    layout = _HEAD_MAJOR if head_major else _SEQ_MAJOR
    known: dict[str, int] = {}
    for role, shape in zip(roles, shapes):
        for letter, d in zip(layout[role] if role != "g" or len(shape) == 4 else layout[role][:3], shape):
            if d != -1 and letter not in ("B", "T"):
                known.setdefault(letter, d)
    for role, shape in zip(roles, shapes):
        letters = layout[role] if role != "g" or len(shape) == 4 else layout[role][:3]
        for axis, (letter, d) in enumerate(zip(letters, shape)):
            if d == -1:
                stand_in = 1 if letter == "B" else (n if role in ("k", "v", "beta") else 1) if letter == "T" else None
                if stand_in is None and letter not in known:
                    raise GdnExportError(f"{node.name}: the size {letter} of operand {role} is not static in the trace")
                shape[axis] = stand_in if stand_in is not None else known[letter]
    return dict(zip(roles, node.input)), dict(zip(roles, shapes)), dict(zip(roles, dtypes))


# the axes of each operand (g: [.., H] or [.., H, K]); T is the time axis (T*n for k, v, beta)
_SEQ_MAJOR = {"q": "BTGK", "k": "BTGK", "v": "BTHV", "g": "BTHK", "beta": "BTH", "erase": "BTHK", "write": "BTHV",
              "s0": "BHKV"}
_HEAD_MAJOR = {"q": "BGTK", "k": "BGTK", "v": "BHTV", "g": "BHT", "beta": "BHT", "s0": "BHKV"}


def _l2norm(b: Builder, x: str) -> str:
    """x * 1/sqrt(sum(x^2) + 1e-6) over the last axis (ops/naive.py's l2norm: eps added)."""
    total = b.op("ReduceSum", [b.op("Mul", [x, x]), b.const([-1])], keepdims=1)
    eps = b.const(1e-6, np.float32)
    return b.op("Mul", [x, b.op("Reciprocal", [b.op("Sqrt", [b.op("Add", [total, eps])])])])


def _readout(b: Builder, state: str, x: str, elementwise: bool) -> str:
    """sum_k state[b, h, k, v] x[b, h, k]: [B, H, V]. ``elementwise``: Mul + ReduceSum (measured 2-4x faster in
    tract's ONNX loader, 1.4-1.7x slower in onnxruntime than the [1, K] x [K, V] MatMul; benchmarks/bench_onnx.py)."""
    if elementwise:
        return b.op("ReduceSum", [b.op("Mul", [state, b.unsqueeze(x, [3])]), b.const([2])], keepdims=0)
    return b.squeeze(b.op("MatMul", [b.unsqueeze(x, [2]), state]), [2])


def _scan_body(dims, roles: list[str], elementwise: bool = False) -> onnx.GraphProto:
    """One token: decay, then n delta sub-steps, then the readout (ops/naive.py's delta_rule_recurrence)."""
    b = Builder("body")
    H, K, V, n = dims.heads, dims.width_k, dims.width_v, dims.num_householder
    f = TensorProto.FLOAT
    shapes = {"q": [None, H, K], "k": [n, None, H, K], "v": [n, None, H, V],
              "g": [None, H, K] if dims.channel_decay else [None, H], "beta": [n, None, H],
              "erase": [None, H, K], "write": [None, H, V]}
    inputs = [helper.make_tensor_value_info("state_in", f, [None, H, K, V])]
    inputs += [helper.make_tensor_value_info(f"{r}_t", f, shapes[r]) for r in roles]
    state = "state_in"
    if "g" in roles:
        decay = b.op("Exp", ["g_t"])
        state = b.op("Mul", [state, b.unsqueeze(decay, [3] if dims.channel_decay else [2, 3])])
    for j in range(n):
        index = b.const(j)
        k_j = b.op("Gather", ["k_t", index], axis=0)
        v_j = b.op("Gather", ["v_t", index], axis=0)
        if "beta" in roles:
            beta_j = b.unsqueeze(b.op("Gather", ["beta_t", index], axis=0), [2])
            erase_key, written = b.op("Mul", [k_j, beta_j]), b.op("Mul", [v_j, beta_j])
        else:
            erase_key, written = b.op("Mul", [k_j, "erase_t"]), b.op("Mul", [v_j, "write_t"])
        retrieved = _readout(b, state, erase_key, elementwise)  # [B, H, V]
        update = b.op("Sub", [written, retrieved])
        state = b.op("Add", [state, b.op("Mul", [b.unsqueeze(k_j, [3]), b.unsqueeze(update, [2])])])
    b.op("Identity", [state], ["state_out"])
    b.op("Identity", [_readout(b, "state_out", "q_t", elementwise)], ["y_t"])
    outputs = [helper.make_tensor_value_info("state_out", f, [None, H, K, V]),
               helper.make_tensor_value_info("y_t", f, [None, H, V])]
    return helper.make_graph(b.nodes, "gated_delta_step", inputs, outputs)


def _lower_rule(b: Builder, node, decision, names, dims, attrs, dtypes, elementwise: bool = False) -> None:
    y_out, state_out = node.output
    head_major = bool(attrs.get("head_major", 0))
    f32 = TensorProto.FLOAT
    x = {role: b.cast(name, f32) for role, name in names.items()}
    if head_major:  # gated_delta_scan: [B, H, T, *] -> [B, T, H, *]
        for role in ("q", "k", "v"):
            x[role] = b.transpose(x[role], [0, 2, 1, 3])
        for role in ("g", "beta"):
            x[role] = b.transpose(x[role], [0, 2, 1])
    if attrs.get("use_qk_l2norm", 0):
        x["q"], x["k"] = _l2norm(b, x["q"]), _l2norm(b, x["k"])
    scale = float(attrs.get("scale", 1.0))
    out_dtype = _DTYPES[dtypes["q"]]
    if head_major:  # y in promote_types(q, s0): at least float32 here
        out_dtype = TensorProto.DOUBLE if "Double" in (dtypes["q"], dtypes["s0"]) else f32
    state_dtype = _DTYPES[dtypes["s0"]] if head_major else f32
    y_seq = b.name("y_seq") if head_major else y_out  # [B, T, H, V]; head-major entry: transposed at the end
    if head_major:
        b.nodes.append(helper.make_node("Transpose", [y_seq], [y_out], name=b.name("Transpose"), perm=[0, 2, 1, 3]))
        tail = b.nodes.pop()
    if decision.lowering == "contrib":
        s0 = b.transpose(x["s0"], [0, 1, 3, 2])  # V-major
        rule = "gated_delta" if "g" in x else "delta"
        y, s = b.op("GatedDeltaNet", [x["q"], x["k"], x["v"], "", x.get("g", ""), x["beta"], s0], 2,
                    domain=MS_DOMAIN, scale=scale, update_rule=rule)
        b.op("Cast", [y], [y_seq], to=out_dtype)
        b.op("Cast", [b.transpose(s, [0, 1, 3, 2])], [state_out], to=state_dtype)
        if head_major:
            b.nodes.append(tail)
        return

    q = b.op("Mul", [x["q"], b.const(scale, np.float32)]) if scale != 1.0 else x["q"]
    k = x["k"]
    if dims.groups > 1:  # value head h reads key head h // G (repeat_interleave)
        def grouped(t):
            expanded = b.op("Expand", [b.unsqueeze(t, [3]), b.const([1, 1, 1, dims.groups, 1])])
            return b.reshape(expanded, [0, 0, dims.heads, dims.width_k])
        q, k = grouped(q), grouped(k)
    n = dims.num_householder
    scanned, roles = [b.transpose(q, [1, 0, 2, 3])], ["q"]  # time-major [T, B, H, K]
    for role, t in (("k", k), ("v", x["v"])):  # [B, T*n, H, D] -> [T, n, B, H, D]
        width = dims.width_k if role == "k" else dims.width_v
        scanned.append(b.transpose(b.reshape(t, [0, -1, n, dims.heads, width]), [1, 2, 0, 3, 4]))
        roles.append(role)
    if "g" in x:
        scanned.append(b.transpose(x["g"], [1, 0, 2, 3] if dims.channel_decay else [1, 0, 2]))
        roles.append("g")
    if "beta" in x:
        scanned.append(b.transpose(b.reshape(x["beta"], [0, -1, n, dims.heads]), [1, 2, 0, 3]))
        roles.append("beta")
    for role in ("erase", "write"):
        if role in x:
            scanned.append(b.transpose(x[role], [1, 0, 2, 3]))
            roles.append(role)
    s_final, y_tm = b.op("Scan", [x["s0"], *scanned], 2, body=_scan_body(dims, roles, elementwise), num_scan_inputs=len(scanned))
    b.op("Cast", [b.transpose(y_tm, [1, 0, 2, 3])], [y_seq], to=out_dtype)
    b.op("Cast", [s_final], [state_out], to=state_dtype)
    if head_major:
        b.nodes.append(tail)


def _lower_conv(b: Builder, node, decision, shapes, dtypes) -> None:
    x, weight, state = node.input
    y_out, state_out = node.output
    width = shapes[1][1] if len(shapes) > 1 and len(shapes[1]) == 2 else None
    if width is None:
        raise GdnExportError(f"{node.name}: the conv weight's traced shape is unknown")
    dtype = _DTYPES[dtypes[0]]
    if dtypes[2] != dtypes[0]:
        state = b.cast(state, dtype)
    full = b.op("Concat", [state, x], axis=2)
    b.op("Slice", [full, b.const([-width]), b.const([INT64_MAX]), b.const([2])], [state_out])
    weight3 = b.unsqueeze(weight if dtypes[1] == dtypes[0] else b.cast(weight, dtype), [1])  # [C, 1, W]
    if decision.lowering == "contrib":
        past = b.slice(state, 1, INT64_MAX, 2)
        b.op("CausalConvWithState", [x, weight3, "", past], [y_out, b.name("present")], domain=MS_DOMAIN,
             activation="silu")
    else:
        conv = b.op("Conv", [b.slice(full, 1, INT64_MAX, 2), weight3], group=shapes[0][1], kernel_shape=[width])
        b.op("Mul", [conv, b.op("Sigmoid", [conv])], [y_out])


def _lower_moe(b: Builder, node, shapes, dtypes, gate: str) -> None:
    """models.blocks.dense_experts: every expert on every token, mixed by the routing weights (cast to x's dtype);
    widened stacks (a given routing, ops/moe_ffn.py) read through slices of their first D columns / rows."""
    x, routing, gate_proj, up_proj, down = node.input
    experts, _, wide = shapes[2]
    width = wide - widening(gate, experts)
    if wide != width:
        gate_proj, up_proj = (b.slice(stack, 0, width, 2) for stack in (gate_proj, up_proj))
        down = b.slice(down, 0, width, 1)
    gate, up = (b.op("MatMul", [b.unsqueeze(x, [0]), b.transpose(stack, [0, 2, 1])])  # [E, N, I]
                for stack in (gate_proj, up_proj))
    act = b.op("Mul", [b.op("Mul", [gate, b.op("Sigmoid", [gate])]), up])
    out = b.op("MatMul", [act, b.transpose(down, [0, 2, 1])])  # [E, N, D]
    weights = b.cast(b.unsqueeze(b.transpose(routing, [1, 0]), [2]), _DTYPES[dtypes[0]])  # [E, N, 1]
    b.op("ReduceSum", [b.op("Mul", [out, weights]), b.const([0])], [node.output[0]], keepdims=0)


def rewrite(model: onnx.ModelProto, runtime: str, lowering: str, traced: dict | None = None) -> list:
    """Replace every placeholder in ``model`` (in place); return the Decisions, in graph order. ``traced``: op type
    -> the tensor operands' shapes of each call, in the order the example ran them (the graph's order)."""
    decisions, nodes, used_ms = [], [], False
    calls = {op: list(shapes) for op, shapes in (traced or {}).items()}
    for node in model.graph.node:
        if node.domain != DOMAIN:
            nodes.append(node)
            continue
        attrs = _attrs(node)
        b = Builder(node.name or node.output[0], nodes)
        label = node.output[-1] if node.op_type != "MoeFfn" else node.output[0]
        if node.op_type == "GatedDeltaRule":
            seen = calls.get("GatedDeltaRule")
            names, shapes, dtypes = _rule_parts(node, attrs, seen.pop(0) if seen else None)
            head_major = bool(attrs.get("head_major", 0))
            dims = validate_operands(shapes, head_major=head_major, num_householder=int(attrs.get("num_householder", 1)))
            entry = onnx_decisions.RULE_QUALNAMES[1 if head_major else 0]
            decision = onnx_decisions.decide_rule(
                label, entry, dims, normalized_keys=head_major or bool(attrs.get("use_qk_l2norm", 0)),
                float64="Double" in dtypes.values(), scale=float(attrs.get("scale", 1.0)), runtime=runtime,
                lowering=lowering)
            _lower_rule(b, node, decision, names, dims, attrs, dtypes, elementwise=runtime == "tract-onnx")
        elif node.op_type == "CausalConv1dUpdate":
            shapes, dtypes = _operand_info(attrs)
            decision = onnx_decisions.decide_conv(label, runtime, lowering)
            _lower_conv(b, node, decision, shapes, dtypes)
        elif node.op_type == "MoeFfn":
            shapes, dtypes = _operand_info(attrs)
            gate = attrs.get("gate", b"")
            gate = gate.decode() if isinstance(gate, bytes) else gate
            decision = onnx_decisions.decide_moe(label, gate)
            _lower_moe(b, node, shapes, dtypes, gate)
        else:
            raise GdnExportError(f"unknown placeholder {node.domain}::{node.op_type}")
        used_ms = used_ms or decision.lowering == "contrib"
        decisions.append(decision)
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
