"""``t2n_extra::moe_ffn`` in ONNX: always ``dense`` (every expert on every token, mixed by the routing weights: the
op's torch kernel), because no routed-expert op of standard ONNX exists, and onnxruntime's ``com.microsoft::MoE``
computes its own routing (softmax top-k) whose semantics were not verified against ours."""

from __future__ import annotations

from gdn_export.backends.onnx.registry import Context, placeholder
from gdn_export.backends.onnx.rewrite import Builder, DTYPES, operand_info
from gdn_export.ops.moe_ffn.op import QUALNAME as MOE_QUALNAME
from gdn_export.ops.moe_ffn.op import widening
from gdn_export.ops.protocol import Decision


def decide_moe(name: str, gate: str) -> Decision:
    return Decision(name, MOE_QUALNAME, "dense", "every expert on every token, mixed by the routing weights (the "
                    "op's torch kernel): ONNX has no routed-expert op, and onnxruntime's com.microsoft::MoE computes "
                    f"its own routing, not verified against this node's ({gate})", None)


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
    weights = b.cast(b.unsqueeze(b.transpose(routing, [1, 0]), [2]), DTYPES[dtypes[0]])  # [E, N, 1]
    b.op("ReduceSum", [b.op("Mul", [out, weights]), b.const([0])], [node.output[0]], keepdims=0)


@placeholder("MoeFfn")
def rewrite_moe(b: Builder, node, attrs: dict, context: Context) -> Decision:
    shapes, dtypes = operand_info(attrs)
    gate = attrs.get("gate", b"")
    gate = gate.decode() if isinstance(gate, bytes) else gate
    decision = decide_moe(node.output[0], gate)
    _lower_moe(b, node, shapes, dtypes, gate)
    return decision
