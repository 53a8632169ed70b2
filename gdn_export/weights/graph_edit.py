"""Edits of torch-to-nnef's NNEF graph (``nnef_tools.model.Graph``) before it is written: what the weight passes
(``int8.lower_linears`` / ``lower_gathers``, ``f16.lower_gathers``) share. Each pass runs as a graph pass of the
export's target (``backends.nnef.target.OfflineTractTarget``)."""

from __future__ import annotations

import numpy as np
from nnef_tools.model import Operation as NOperation
from nnef_tools.model import Tensor as NTensor

from gdn_export.errors import GdnExportError


def variables(graph, labels: frozenset) -> dict:
    """label -> the variable operations declaring it, for the labels of ``labels`` the graph declares. (A weight it
    does not declare at all, e.g. a checkpoint weight a family re-lays into others, is never written.)"""
    out: dict = {}
    for op in graph.operations:
        if op.type == "variable" and op.attribs["label"] in labels:
            out.setdefault(op.attribs["label"], []).append(op)
    return out


def table_gathers(graph, labels: frozenset) -> list:
    """The ``tract_core_gather`` operations of the graph whose table is a variable of ``labels``."""
    return [op for op in graph.operations if op.type == "tract_core_gather" and op.inputs
            and op.inputs[0].producer is not None and op.inputs[0].producer.type == "variable"
            and op.inputs[0].producer.attribs["label"] in labels]


def readers_left(graph, declared: dict, lowered: tuple[str, ...]) -> set[str]:
    """The labels of ``declared`` read by an operation other than the lowered ones (``lowered`` types), or by none:
    a weight read otherwise would need its float values."""
    left = set()
    for label, variables in declared.items():
        readers = [op for variable in variables for op in variable.outputs[0].consumers]
        if not readers or any(op.type not in lowered for op in readers) or any(
                variable.outputs[0] in graph.outputs for variable in variables):
            left.add(label)
    return left


def is_zero_literal(tensor) -> bool:
    """torch-to-nnef's "no bias": a scalar literal 0."""
    return tensor.producer is None and tensor.data is not None and np.ndim(tensor.data) == 0 and \
        float(np.asarray(tensor.data)) == 0.0


class GraphEdit:
    """Operations added to an NNEF graph (``nnef_tools.model.Graph``) in place of one: each ``replace`` puts the
    operations created since the last one where the replaced operation stood (the graph stays topologically sorted:
    they read what it read, and what read its outputs comes later), in the order they were created."""

    def __init__(self, graph) -> None:
        self.graph = graph
        self.names = {tensor.name for tensor in graph.tensors}
        self.pending: list = []

    def tensor(self, name: str, dtype, shape=None):
        """A named tensor (shapes are left unknown: tract infers them, and the written graph does not show them)."""
        if name in self.names:
            raise GdnExportError(f"a weight pass would name two tensors {name!r} in the graph")
        self.names.add(name)
        return NTensor(self.graph, name=name, shape=shape, dtype=dtype)

    def literal(self, value, dtype=None):
        """A scalar written inline; a float32 constant as its shortest decimal, which reads back to the same float32."""
        if isinstance(value, np.float32):
            return NTensor(self.graph, name=None, shape=(), dtype=np.float32, data=np.array(float(_literal(value))))
        data = np.array(value, dtype=dtype)
        return NTensor(self.graph, name=None, shape=(), dtype=data.dtype.type, data=data)

    def op(self, op_type: str, inputs, name: str | None = None, dtype=None, *, out=None, attribs=None, **more):
        """One operation of ``inputs`` (a tensor, a tuple of arguments, or a list: one list argument) into ``out`` or
        a new tensor ``name`` (``dtype``: the first input's by default), with ``attribs`` then ``more``."""
        inputs = (inputs,) if isinstance(inputs, NTensor) else inputs
        if out is None:
            out = self.tensor(name, dtype if dtype is not None else inputs[0].dtype)
        self.pending.append(NOperation(self.graph, type=op_type, attribs={**(attribs or {}), **more}, inputs=inputs,
                                       outputs=(out,)))
        return out

    def cast(self, x, name: str, to: str):
        return self.op("tract_core_cast", x, name, TYPES[to], to=to)

    def variable(self, name: str, label: str, shape: tuple[int, ...]):
        """A float32 variable (its file written by ``scale_writers``, not by torch-to-nnef's writer)."""
        out = self.tensor(name, np.float32, tuple(shape))
        self.pending.append(NOperation(self.graph, type="variable", inputs=(), outputs=(out,),
                                       attribs={"label": label, "shape": list(shape), "dtype": np.float32}))
        return out

    @staticmethod
    def take_output(op):
        """``op``'s one output, detached from it: a pending operation produces it instead."""
        (out,) = op.outputs
        op.outputs = ()
        return out

    def replace(self, op, feeding=None) -> None:
        """``op`` gives way to the pending operations; ``feeding`` (an operation feeding it), left without readers,
        goes too."""
        operations = self.graph.operations
        at = operations.index(op)
        end = len(operations)
        for k in range(len(self.pending)):  # created last, in order: at the end of the list
            self.graph.move_operation(end - len(self.pending) + k, at + k)
        self.pending = []
        self.graph.remove_operation(op, unlink=True)
        if feeding is not None and not any(t.consumers or t in self.graph.outputs for t in feeding.outputs):
            tensors = list(feeding.outputs)
            self.graph.remove_operation(feeding, unlink=True)
            self.graph.remove_tensors(tensors)


TYPES = {"f32": np.float32, "f16": np.float16, "i8": np.int8, "i32": np.int32}


def _literal(value: np.float32) -> str:
    return np.format_float_scientific(value, unique=True) if value < 1e-4 else \
        np.format_float_positional(value, unique=True)
