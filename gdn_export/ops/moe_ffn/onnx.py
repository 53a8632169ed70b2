"""``t2n_extra::moe_ffn`` in ONNX: always ``dense`` (every expert on every token, mixed by the routing weights: the
op's torch kernel), because no routed-expert op of standard ONNX exists, and onnxruntime's ``com.microsoft::MoE``
computes its own routing (softmax top-k) whose semantics were not verified against ours."""

from __future__ import annotations

from gdn_export.backends.onnx.registry import Context, OnnxOptions, placeholder, symbolic
from gdn_export.backends.onnx.symbolics import constant, is_none, placeholder_node, set_like
from gdn_export.backends.onnx.rewrite import Builder, DTYPES, operand_info
from gdn_export.ops.moe_ffn.op import QUALNAME, MoeNode, widening
from gdn_export.ops.protocol import Decision, record


def decide(node: MoeNode, plan: OnnxOptions) -> Decision:
    """Always dense in ONNX (``ops.protocol.Decide``; the module docstring says why), whatever the plan."""
    return Decision(node.name, node.entry, "dense", "every expert on every token, mixed by the routing weights (the "
                    "op's torch kernel" + (", with the experts' biases" if node.biased else "") + "): ONNX has no routed-expert op, and onnxruntime's com.microsoft::MoE computes "
                    f"its own routing, not verified against this node's ({node.gate})", None)


@symbolic(QUALNAME)
def symbolic_moe(g, x, routing, router_weight, gate_proj, up_proj, down_proj, top_k, gate, gate_bias=None,
                 up_bias=None, down_bias=None):
    biases = [b for b in (gate_bias, up_bias, down_bias) if b is not None and not is_none(b)]
    y = placeholder_node(g, "MoeFfn", [x, routing, gate_proj, up_proj, down_proj, *biases], 1,
                         top_k_i=int(constant(top_k, "i")), gate_s=str(constant(gate, "s")))
    set_like(y, x, 2)
    return y


def _lower_moe(b: Builder, node, shapes, dtypes, gate: str) -> None:
    """models.blocks.dense_experts: every expert on every token, mixed by the routing weights (cast to x's dtype);
    widened stacks (a given routing, ops/moe_ffn.py) read through slices of their first D columns / rows; the
    experts' biases (gate_bias, up_bias ``[E, I]``, down_bias ``[E, D]``, where given) added to their products."""
    x, routing, gate_proj, up_proj, down, *biases = node.input
    experts, _, wide = shapes[2]
    width = wide - widening(gate, experts)
    if wide != width:
        gate_proj, up_proj = (b.slice(stack, 0, width, 2) for stack in (gate_proj, up_proj))
        down = b.slice(down, 0, width, 1)
    gate, up = (b.op("MatMul", [b.unsqueeze(x, [0]), b.transpose(stack, [0, 2, 1])])  # [E, N, I]
                for stack in (gate_proj, up_proj))
    dtype = DTYPES[dtypes[0]]
    if biases:  # [E, I] -> [E, 1, I]; down_bias [E, D] -> [E, 1, D]
        gate, up = (b.op("Add", [product, b.unsqueeze(b.cast(bias, dtype), [1])])
                    for product, bias in ((gate, biases[0]), (up, biases[1])))
    act = b.op("Mul", [b.op("Mul", [gate, b.op("Sigmoid", [gate])]), up])
    out = b.op("MatMul", [act, b.transpose(down, [0, 2, 1])])  # [E, N, D]
    if biases:
        out = b.op("Add", [out, b.unsqueeze(b.cast(biases[2], dtype), [1])])
    weights = b.cast(b.unsqueeze(b.transpose(routing, [1, 0]), [2]), dtype)  # [E, N, 1]
    b.op("ReduceSum", [b.op("Mul", [out, weights]), b.const([0])], [node.output[0]], keepdims=0)


@placeholder("MoeFfn")
def rewrite_moe(b: Builder, node, attrs: dict, context: Context) -> None:
    shapes, dtypes = operand_info(attrs)
    gate = attrs.get("gate", b"")
    gate = gate.decode() if isinstance(gate, bytes) else gate
    record(decide, MoeNode(node.output[0], gate, biased=len(node.input) > 5), context.options, context.decisions)
    _lower_moe(b, node, shapes, dtypes, gate)
