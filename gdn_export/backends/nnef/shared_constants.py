"""One ``variable`` per distinct constant of the graph: the export's constants (the chunked lowering's masks, torch-to-nnef's
per-layer scalars) written once and read by every operation that uses that value.

Each layer's lowering writes its own masks, and torch-to-nnef its own small constants per layer; tract keeps one
node per distinct value anyway (``TypedModel::add_const`` returns an identical constant's node), but only after its
NNEF reader has read each ``.dat`` and compared its tensor with every node of the model built so far: a cost per
constant that grows with the model (issue 36). A checkpoint's weights (a ``variable`` whose label is not its tensor's
name, or whose values are not in the graph: streamed) are left as they are: their labels are what the weight
formats, the names step and a reader of the archive look for.
"""

from __future__ import annotations

import hashlib

import numpy as np


def share_identical_constants(graph) -> int:
    """Rewire every use of a constant ``variable`` equal (type, shape, bytes) to an earlier one onto the earlier one,
    and drop it; return how many were dropped. ``graph``: torch-to-nnef's NNEF graph, a graph pass of the export's
    target (topologically sorted: the first of equal constants precedes every use of the later ones)."""
    # candidates grouped by type and shape first: only a group of two or more is hashed, so a graph's large constants
    # (an in-memory model's weights, each of its own shape) are not copied or hashed for nothing
    groups: dict[tuple, list] = {}
    for op in graph.operations:
        if op.type != "variable" or len(op.outputs) != 1:
            continue
        tensor = op.outputs[0]
        if op.attribs.get("label") != tensor.name or tensor.data is None or tensor in graph.outputs:
            continue
        data = np.asarray(tensor.data)
        groups.setdefault((data.dtype.str, data.shape), []).append((op, tensor, data))
    dropped = []
    for members in groups.values():
        if len(members) < 2:
            continue
        first: dict[bytes, object] = {}
        for op, tensor, data in members:  # graph order: the first of equal constants precedes the later ones' uses
            kept = first.setdefault(_digest(data), tensor)
            if kept is tensor:
                continue
            for consumer in list(tensor.consumers):
                consumer.inputs = _replaced(consumer.inputs, tensor, kept)
            dropped.append(op)
    if dropped:
        outputs = [op.outputs[0] for op in dropped]
        graph.remove_operations(dropped, unlink=True)
        graph.remove_tensors(outputs)
    return len(dropped)


def _digest(data: np.ndarray) -> bytes:
    """sha256 of ``data``'s bytes in C order, without a copy where it is contiguous already."""
    data = np.ascontiguousarray(data)
    return hashlib.sha256(memoryview(data).cast("B") if data.size else b"").digest()


def _replaced(inputs, old, new):
    """``inputs`` (a tuple of tensors, or a list for one list argument) with ``old`` replaced by ``new``."""
    if isinstance(inputs, list) or type(inputs).__name__ == "_ListView":
        return [new if t is old else t for t in inputs]
    return tuple(new if t is old else t for t in inputs)
