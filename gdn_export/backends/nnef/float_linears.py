"""Linear layers over a stored float weight written as one ``tract_core_einsum`` on the weight as it is stored.

torch-to-nnef writes ``nn.Linear`` as ``linear(x, unsqueeze(W, axes = [0]), bias)`` (the weight's rank raised to the
input's), and ``x @ W[a:b].t()`` (the tied head's halves, ``models/decoder.vocab_projection``) as
``matmul(x, unsqueeze(transpose(slice(W))))``. tract 0.23.9 folds each ``unsqueeze`` and ``transpose`` of a constant
into a new constant at load, and moves axes of constants again while decluttering (``PropConst``,
``ChangeAxes``): each is a full copy of the weight (``tract_quirks.WEIGHT_COPIED_BY_AXIS_OPS``). For a float32 0.8B
archive that is several gigabytes copied and freed on every start: 4.5 s of a 10 s load, and 1 GB of its peak
memory (benchmarks/RESULTS.md, 2026-12-05).

``tract_core_einsum([x, W], expr = "abk,nk->abn")`` is the same product over the weight as stored: the matmul
tract builds from ``linear`` (NNEF's fragment ``matmul(x, W, transposeB = true)`` plus the bias) with the
operands' axes named rather than aligned by copies. tract plans it on the same kernels with the same packing; the
logits of the 0.8B shape were identical to the bit in float32 and float16 weights, prefill and decode.

Rewritten: a ``linear`` or ``matmul`` whose weight operand is a float ``variable`` (a float32 or float16 weight;
never a block-quantized one, whose matmul tract plans from the ``linear`` form) read through an ``unsqueeze`` of
leading axes, a ``transpose`` of its two axes (matmul), or a ``slice`` (the tied head's halves). Anything else is
left as torch-to-nnef wrote it.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from gdn_export.backends.nnef.builder import DATUM, NnefBuilder, is_zero_literal

BATCH_AXES = "abcdefgh"


def write_float_linears(graph, is_float_weight: Callable[[str, object], bool]) -> int:
    """Rewrite the linear layers the module docstring describes in torch-to-nnef's NNEF graph (a graph pass of the
    export's target); ``is_float_weight(label, tensor)``: whether the variable of that label (its graph tensor) is
    stored as float32 or float16. Returns how many were rewritten."""
    edit = NnefBuilder(graph)
    rewritten = 0
    for op in list(graph.operations):
        found = _float_product(op, is_float_weight)
        if found is None:
            continue
        x, weight, bias, feeding = found
        y = edit.take_output(op)
        batch = BATCH_AXES[: len(x.shape) - 1]  # x's axes but the last (rank known: _float_product)
        acc = DATUM[np.dtype(x.dtype).name]
        expr = f"{batch}k,nk->{batch}n"
        if bias is None:
            edit.op("tract_core_einsum", [x, weight], out=y, expr=expr, acc=acc)
        else:
            product = edit.op("tract_core_einsum", [x, weight], f"{y.name}__product", expr=expr, acc=acc)
            edit.op("add", (product, bias), out=y)
        edit.replace(op)
        for step in feeding:  # unsqueeze, then transpose: each goes once nothing reads it
            if not any(t.consumers or t in graph.outputs for t in step.outputs):
                tensors = list(step.outputs)
                graph.remove_operation(step, unlink=True)
                graph.remove_tensors(tensors)
        rewritten += 1
    return rewritten


def _float_product(op, is_float_weight) -> tuple | None:
    """(x, the weight as stored, the bias or None, the operations between them: unsqueeze first) of a linear layer
    this pass rewrites, else None."""
    if op.type == "linear" and len(op.inputs) == 3:
        x, operand, bias = op.inputs
        bias = None if is_zero_literal(bias) else bias
        transposed = True  # linear's filter is [N, K]
    elif op.type == "matmul" and len(op.inputs) == 2 and not op.attribs.get("transposeA") \
            and not op.attribs.get("transposeB"):
        x, operand = op.inputs
        bias, transposed = None, False  # the operand must be a transpose of an [N, K] weight
    else:
        return None
    if x.shape is None or not 2 <= len(x.shape) <= len(BATCH_AXES) + 1:
        return None  # the input's rank decides the einsum's batch axes: unknown (or past a-h), left as written
    feeding = []
    rank = len(x.shape)
    if operand.producer is not None and operand.producer.type == "unsqueeze":
        unsqueeze = operand.producer
        if list(unsqueeze.attribs.get("axes", ())) != list(range(len(unsqueeze.attribs.get("axes", ())))):
            return None  # only leading axes: the batch axes of x
        if rank != 2 + len(unsqueeze.attribs["axes"]):
            return None
        feeding.append(unsqueeze)
        operand = unsqueeze.inputs[0]
    elif rank != 2:
        return None
    if not transposed:
        step = operand.producer
        if step is None or step.type != "transpose" or list(step.attribs.get("axes", ())) != [1, 0]:
            return None
        feeding.append(step)
        operand = step.inputs[0]
    source = operand.producer
    if source is not None and source.type == "slice":
        source = source.inputs[0].producer
    if source is None or source.type != "variable" or len(source.attribs.get("shape", ())) != 2:
        return None
    if any(len(t.consumers) != 1 for step in feeding for t in step.outputs):
        return None  # an unsqueeze or transpose read elsewhere too: left as it is
    if x.dtype is None or np.dtype(x.dtype).name not in DATUM or DATUM[np.dtype(x.dtype).name] not in ("f32", "f16"):
        return None
    if not is_float_weight(source.attribs["label"], source.outputs[0]):
        return None
    return x, operand, bias, feeding
