"""Handler of ``t2n_extra::moe_ffn`` nodes (``gdn_export/ops/moe_ffn/op.py``): tract's sparse ``tract_moe_ffn`` where
it computes exactly the node's function (``decide``), else the dense form; the decision and its reason are recorded
on the target beside the gated delta rules' (the export report and ``gdn_export.json`` list them).
"""

from __future__ import annotations

import numpy as np
from torch_to_nnef import torch_graph as tg

from gdn_export.backends.nnef.builder import NnefBuilder
from gdn_export.backends.nnef.registry import custom_op, output_tensors, require_tract
from gdn_export.ops.moe_ffn.op import (BIASED_EXPERTS, FIRST_VERSION, GIVEN_ROUTING_GATES, OP_NAME, TRACT_GATES,
                                       UNSUPPORTED_GATES, MoeNode, check_moe_operands)
from gdn_export.ops.options import NnefOptions, policy_of
from gdn_export.ops.protocol import Decision, record


def decide(node: MoeNode, options: NnefOptions) -> Decision:
    """``"tract_moe_ffn"`` where tract's fused op computes exactly this node, else ``"dense"``
    (``ops.protocol.Decide``); the reason ends with the experts the node runs where they are known."""
    lowering, reason = _rule(node.gate, options, node.biased)
    if node.top_k is not None and node.experts is not None:
        reason = f"{reason} (top {node.top_k} of {node.experts} experts)"
    return Decision(node.name, node.entry, lowering, reason, None)


def _rule(gate: str, options: NnefOptions, biased: bool = False) -> tuple[str, str]:
    if biased:
        return "dense", f"{BIASED_EXPERTS}; every expert runs on every token"
    if gate not in TRACT_GATES and gate not in GIVEN_ROUTING_GATES:
        why = UNSUPPORTED_GATES.get(gate, f"routing {gate!r} is none of tract_moe_ffn's gate modes")
        return "dense", f"{why}; every expert runs on every token"
    if options.tract_version < FIRST_VERSION:
        return "dense", (f"{OP_NAME} was checked on tract >= {'.'.join(map(str, FIRST_VERSION))} only "
                         "(every expert runs on every token)")
    if options.runtime != "cpu":
        where = "no runtime given" if options.runtime == "any" else f"runtime {options.runtime}"
        return "dense", (f"{where}: {OP_NAME} is verified on tract's CPU runtime only (--runtime cpu); "
                         "every expert runs on every token")
    if gate in GIVEN_ROUTING_GATES:
        return OP_NAME, (f"{GIVEN_ROUTING_GATES[gate]} computed in the graph: {OP_NAME} gate=raw over [x | routing] "
                         "runs only the experts it chose (stacks widened by E zero columns)")
    return OP_NAME, f"{OP_NAME} gate={TRACT_GATES[gate]} computes this routing exactly: only the top-k experts run"


@custom_op("moe_ffn")
def handle(g, node, name_to_tensor, op_helper, inference_target, **kwargs):
    """torch-to-nnef handler of ``t2n_extra::moe_ffn``: the fused op or the dense form, the decision recorded."""
    require_tract(inference_target, node.kind)
    constants = [i.data for i in node.inputs if isinstance(i, tg.PythonConstant)]
    tensors = [i for i in node.inputs if not isinstance(i, tg.PythonConstant)]
    top_k, gate = int(constants[0]), str(constants[1])
    target = policy_of(inference_target)
    experts = int(tensors[3].shape[0])  # gate_proj [E, I, D]
    # the experts' biases follow the six operands, all three or none (check_moe_operands)
    node_facts = MoeNode(node.outputs[0].export_name, gate, top_k, experts, biased=len(tensors) > 6)
    lowering = record(decide, node_facts, target.gdn_options, target.gdn_decisions).lowering
    given = gate in GIVEN_ROUTING_GATES
    x, routing, router, gate_proj, up_proj, down, *biases = (
        op_helper.get_or_add_tensor_variable_in_nnef(t) if i != 1 or given or lowering == "dense" else None
        for i, t in enumerate(tensors))
    check_moe_operands(x.shape, tensors[1].shape, router.shape, gate_proj.shape, up_proj.shape, down.shape, top_k,
                       gate, tuple(b.shape for b in biases) if biases else None)
    (y,) = output_tensors(op_helper, node, name_to_tensor)
    builder = NnefBuilder(g, y.name)
    if lowering == OP_NAME and given:
        return lower_given_routing(builder, x, routing, gate_proj, up_proj, down, y, top_k)
    if lowering == OP_NAME:
        return lower_fused(builder, x, router, gate_proj, up_proj, down, y, top_k, TRACT_GATES[gate])
    return lower_dense(builder, x, routing, gate_proj, up_proj, down, y, biases or None)


def lower_fused(builder, x, router, gate_proj, up_proj, down, y, top_k: int, gate: str) -> list:
    """``tract_moe_ffn`` in the linear layout over the stacks as the archive stores them (w1 = gate_proj,
    w3 = up_proj, w2 = down_proj; f32, f16 or Q4_0): nothing of a stack is sliced, copied or transposed."""
    builder.op(OP_NAME, (x, router, gate_proj, down, up_proj), shape=y.shape, out=y,
               attribs={"k": top_k, "activation": "silu", "gate": gate, "expert_layout": "linear"})
    return ["tract_transformers"]


def lower_given_routing(builder, x, routing, gate_proj, up_proj, down, y, top_k: int) -> list:
    """``tract_moe_ffn`` with ``gate = 'raw'`` choosing and weighing the experts by ``routing`` itself
    (ops/moe_ffn.py): the token widened to ``[x | routing]`` ``[N, D+E]``, the router ``[0 | I]`` (a small f32
    constant ``[E, D+E]``), the stacks as stored (they come widened: E zero columns in w1/w3, E zero output rows in
    w2), and the first D outputs kept."""
    experts, width, tokens = int(gate_proj.shape[0]), int(x.shape[1]), x.shape[0]
    widened = builder.op("concat", [x, builder.cast(routing, x.dtype)], shape=(tokens, width + experts),
                         attribs={"axis": 1}, what="token_and_routing")
    router = np.concatenate([np.zeros((experts, width), np.float32), np.eye(experts, dtype=np.float32)], axis=1)
    router = builder.constant("routing_router", router)
    wide = builder.op(OP_NAME, (widened, router, gate_proj, down, up_proj), shape=(tokens, width + experts),
                      attribs={"k": top_k, "activation": "silu", "gate": "raw", "expert_layout": "linear"})
    builder.op("slice", wide, shape=y.shape, attribs={"axes": [1], "begin": [0], "end": [width]}, out=y)
    return ["tract_transformers"]


def lower_dense(builder, x, routing, gate_proj, up_proj, down, y, biases=None) -> list:
    """Every expert on every token (``dense_experts``): ``x @ gate^T`` and ``x @ up^T`` over the whole stacks
    ``[N, E*I]``, SwiGLU, a batched matmul with ``down_proj`` ``[E, N, D]``, mixed by ``routing`` (cast to x's dtype)
    and summed over E. Widened stacks (a given routing) are read through slices of their first D columns / rows.
    ``biases`` (gate_bias, up_bias ``[E, I]``, down_bias ``[E, D]``), cast to x's dtype, are added to the gate and
    up products ``[N, E, I]`` and to the experts' outputs ``[E, N, D]`` before the mix, as ``dense_experts`` adds
    them."""
    experts, inner, wide = (int(d) for d in gate_proj.shape)
    width, tokens = int(x.shape[1]), x.shape[0]
    if wide != width:
        gate_proj, up_proj = (builder.op("slice", stack, shape=(experts, inner, width), what=what,
                                         attribs={"axes": [2], "begin": [0], "end": [width]})
                              for stack, what in ((gate_proj, "gate_columns"), (up_proj, "up_columns")))
        down = builder.op("slice", down, shape=(experts, width, inner), what="down_rows",
                          attribs={"axes": [1], "begin": [0], "end": [width]})
    gate, up = (builder.split_axis(builder.matmul(x, builder.merge_axes(stack, 0, 2), transpose_b=True), 1,
                                   (experts, inner)) for stack in (gate_proj, up_proj))  # [N, E, I]
    if biases is not None:
        gate, up = (builder.op("add", (product, builder.unsqueeze(builder.cast(bias, x.dtype), [0])),
                               shape=product.shape) for product, bias in ((gate, biases[0]), (up, biases[1])))
    hidden = builder.binary("mul", builder.binary("mul", gate, builder.unary("sigmoid", gate)), up)
    out = builder.matmul(builder.transpose(hidden, (1, 0, 2)), down, transpose_b=True)  # [E, N, D]
    if biases is not None:
        out = builder.op("add", (out, builder.unsqueeze(builder.cast(biases[2], x.dtype), [1])), shape=out.shape)
    weights = builder.unsqueeze(builder.transpose(builder.cast(routing, x.dtype), (1, 0)), [2])  # [E, N, 1]
    total = builder.sum_reduce(builder.binary("mul", out, weights), [0])  # [1, N, D]
    builder.op("squeeze", total, shape=y.shape, attribs={"axes": [0]}, out=y)
    return []
