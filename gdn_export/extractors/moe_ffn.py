"""Handler of ``t2n_extra::moe_ffn`` nodes (``gdn_export/ops/moe_ffn.py``): tract's sparse ``tract_moe_ffn`` where
it computes exactly the node's function (``decide``), else the dense form; the decision and its reason are recorded
on the target beside the gated delta rules' (the export report and ``gdn_export.json`` list them).
"""

from __future__ import annotations

import numpy as np
from torch_to_nnef import torch_graph as tg

from gdn_export.extractors.custom_ops import _require_tract, output_tensors
from gdn_export.lowering.emitter import Decision
from gdn_export.lowering.nnef_builder import NnefBuilder
from gdn_export.lowering.options import LoweringOptions
from gdn_export.ops.moe_ffn import (FIRST_VERSION, GIVEN_ROUTING_GATES, OP_NAME, QUALNAME, TRACT_GATES,
                                    UNSUPPORTED_GATES, check_moe_operands)
from gdn_export.target import policy_of


def decide(gate: str, options: LoweringOptions) -> tuple[str, str]:
    """(lowering, reason): ``"tract_moe_ffn"`` where tract's fused op computes exactly this node, else ``"dense"``."""
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


def handle(g, node, name_to_tensor, op_helper, inference_target, **kwargs):
    """torch-to-nnef handler of ``t2n_extra::moe_ffn``: the fused op or the dense form, the decision recorded."""
    _require_tract(inference_target, node.kind)
    constants = [i.data for i in node.inputs if isinstance(i, tg.PythonConstant)]
    tensors = [i for i in node.inputs if not isinstance(i, tg.PythonConstant)]
    top_k, gate = int(constants[0]), str(constants[1])
    target = policy_of(inference_target)
    lowering, reason = decide(gate, target.gdn_options)
    given = gate in GIVEN_ROUTING_GATES
    x, routing, router, gate_up, down = (op_helper.get_or_add_tensor_variable_in_nnef(t) if i != 1 or given or
                                         lowering == "dense" else None for i, t in enumerate(tensors))
    check_moe_operands(x.shape, tensors[1].shape, router.shape, gate_up.shape, down.shape, top_k)
    (y,) = output_tensors(op_helper, node, name_to_tensor)
    target.gdn_decisions.append(Decision(y.name, QUALNAME, lowering, f"{reason} (top {top_k} of "
                                         f"{int(gate_up.shape[0])} experts)", None))
    builder = NnefBuilder(g, y.name)
    if lowering == OP_NAME and given:
        return lower_given_routing(builder, x, routing, gate_up, down, y, top_k)
    if lowering == OP_NAME:
        return lower_fused(builder, x, router, gate_up, down, y, top_k, TRACT_GATES[gate])
    return lower_dense(builder, x, routing, gate_up, down, y)


def lower_fused(builder, x, router, gate_up, down, y, top_k: int, gate: str) -> list:
    """``tract_moe_ffn`` in the linear layout: w1/w3 are row slices of gate_up_proj (tract folds them at load), w2 is
    down_proj as stored; nothing of a stack is copied or transposed in the archive."""
    w1, w3 = gate_up_halves(builder, gate_up)
    builder.op(OP_NAME, (x, router, w1, down, w3), shape=y.shape, out=y,
               attribs={"k": top_k, "activation": "silu", "gate": gate, "expert_layout": "linear"})
    return ["tract_transformers"]


def lower_given_routing(builder, x, routing, gate_up, down, y, top_k: int) -> list:
    """``tract_moe_ffn`` with ``gate = 'raw'`` choosing and weighing the experts by ``routing`` itself
    (ops/moe_ffn.py): the token widened to ``[x | routing]`` ``[N, D+E]``, the router ``[0 | I]`` (a small f32
    constant ``[E, D+E]``), w1/w3 with E zero columns and w2 with E zero output rows, and the first D outputs kept.

    The widened stacks are NNEF ``pad``s of slices of the checkpoint's stacks (the archive holds the stacks as
    stored), which tract must fold at load, or ``tract_moe_ffn`` is left unplanned and ~400x slower: tract folds a
    constant only where it is no larger than what it is computed from (``tract_quirks.CONST_FOLD_NO_GROWTH``), so
    each stack is padded in pieces of experts small enough for that, and the pieces are concatenated."""
    experts, width, tokens = int(gate_up.shape[0]), int(gate_up.shape[2]), x.shape[0]
    inner = int(gate_up.shape[1]) // 2
    widened = builder.op("concat", [x, builder.cast(routing, x.dtype)], shape=(tokens, width + experts),
                         attribs={"axis": 1}, what="token_and_routing")
    router = np.concatenate([np.zeros((experts, width), np.float32), np.eye(experts, dtype=np.float32)], axis=1)
    router = builder.constant("routing_router", router)
    w1, w3 = (widened_stack(builder, gate_up, rows, 2, experts, what)
              for rows, what in (((0, inner), "w1"), ((inner, 2 * inner), "w3")))
    w2 = widened_stack(builder, down, None, 1, experts, "w2")
    wide = builder.op(OP_NAME, (widened, router, w1, w2, w3), shape=(tokens, width + experts),
                      attribs={"k": top_k, "activation": "silu", "gate": "raw", "expert_layout": "linear"})
    builder.op("slice", wide, shape=y.shape, attribs={"axes": [1], "begin": [0], "end": [width]}, out=y)
    return ["tract_transformers"]


def widened_stack(builder, stack, rows: tuple[int, int] | None, axis: int, extra: int, what: str):
    """``stack`` ``[E, ., .]`` (only rows ``rows`` of axis 1, if given) with ``extra`` zeros appended on ``axis``:
    ``pad(slice(stack))`` per piece of experts, each piece no larger than ``stack`` itself (so tract folds it),
    concatenated over the experts."""
    shape = [int(d) for d in stack.shape]
    experts = shape[0]
    if rows is not None:
        shape[1] = rows[1] - rows[0]
    sliced = list(shape)
    shape[axis] += extra
    per_piece = min(experts, int(np.prod(stack.shape)) // int(np.prod(shape[1:])))
    assert per_piece >= 1, "one expert's widened rows outgrow the whole stack (E * D < D + E: one expert)"
    padding = [(0, 0)] * 3
    padding[axis] = (0, extra)
    pieces = []
    for first in range(0, experts, per_piece):
        last = min(experts, first + per_piece)
        axes, begin, end = ([0, 1], [first, rows[0]], [last, rows[1]]) if rows else ([0], [first], [last])
        piece = builder.op("slice", stack, shape=(last - first, *sliced[1:]), what=f"{what}_experts",
                           attribs={"axes": axes, "begin": begin, "end": end})
        pieces.append(builder.op("pad", piece, shape=(last - first, *shape[1:]), what=f"{what}_widened",
                                 attribs={"padding": padding, "border": "constant", "value": 0.0}))
    if len(pieces) == 1:
        return pieces[0]
    return builder.op("concat", pieces, shape=shape, attribs={"axis": 0}, what=what)


def gate_up_halves(builder, gate_up):
    """w1 and w3 ``[E, I, D]``: the gate and up row halves of transformers' fused ``gate_up_proj [E, 2I, D]``."""
    experts, rows, width = (int(d) for d in gate_up.shape)
    inner = rows // 2
    return tuple(builder.op("slice", gate_up, shape=(experts, inner, width),
                            attribs={"axes": [1], "begin": [begin], "end": [begin + inner]}, what=what)
                 for begin, what in ((0, "w1"), (inner, "w3")))


def lower_dense(builder, x, routing, gate_up, down, y) -> list:
    """Every expert on every token (``dense_experts``): ``x @ gate_up^T`` over the whole stack ``[N, E*2I]``, SwiGLU,
    a batched matmul with ``down_proj`` ``[E, N, D]``, mixed by ``routing`` (cast to x's dtype) and summed over E."""
    experts, rows, width = (int(d) for d in gate_up.shape)
    inner, tokens = rows // 2, x.shape[0]
    stacked = builder.merge_axes(gate_up, 0, 2)  # [E*2I, D]
    both = builder.split_axis(builder.matmul(x, stacked, transpose_b=True), 1, (experts, rows))  # [N, E, 2I]
    gate = builder.op("slice", both, shape=(tokens, experts, inner),
                      attribs={"axes": [2], "begin": [0], "end": [inner]}, what="gate")
    up = builder.op("slice", both, shape=(tokens, experts, inner),
                    attribs={"axes": [2], "begin": [inner], "end": [rows]}, what="up")
    hidden = builder.binary("mul", builder.binary("mul", gate, builder.unary("sigmoid", gate)), up)
    out = builder.matmul(builder.transpose(hidden, (1, 0, 2)), down, transpose_b=True)  # [E, N, D]
    weights = builder.unsqueeze(builder.transpose(builder.cast(routing, x.dtype), (1, 0)), [2])  # [E, N, 1]
    total = builder.sum_reduce(builder.binary("mul", out, weights), [0])  # [1, N, D]
    builder.op("squeeze", total, shape=y.shape, attribs={"axes": [0]}, out=y)
    return []
