"""The one writer of NNEF operations into torch-to-nnef's graph (``nnef_tools.model.Graph``): what the ops' lowerings
write (new operations, tensors named ``<prefix>_<n>_<what>`` with their traced shapes) and what the weight formats'
graph passes write (``weights/int8``, ``weights/f16``: operations under names they choose, put in place of one
operation with ``replace``), and the graph queries those passes share."""

from __future__ import annotations

import itertools
from typing import Any, Sequence

import numpy as np
from nnef_tools.model import Graph as NGraph
from nnef_tools.model import Operation as NOperation
from nnef_tools.model import Tensor as NTensor

from gdn_export.errors import GdnExportError
from gdn_export.targets import NNEF_DATUM

# tract's datum type of each numpy type a cast writes (the float types', and the integer codes' of int8 weights)
DATUM = {**NNEF_DATUM, "int8": "i8", "int32": "i32"}


class NnefBuilder:
    """Adds operations to an NNEF graph. With a ``prefix`` (a lowering's), intermediate tensors are named
    ``<prefix>_<n>_<what>``; an operation given a ``name`` (a graph pass's) gets exactly that name, never one the
    graph holds already.

    Shapes are the traced extents; they only document the graph (tract infers its own), so a symbolic
    axis traced at some length stays symbolic in the written file as long as no attribute bakes it in (a named
    tensor's shape is left unknown unless given: the written graph does not show it).

    Operations are appended to the graph; ``replace(op)`` moves those created since the last replace to where
    ``op`` stood (the graph stays topologically sorted: they read what it read, and what read its outputs comes
    later), in the order they were created.
    """

    def __init__(self, graph: NGraph, prefix: str = "") -> None:
        self.graph = graph
        self.prefix = prefix
        self._counter = itertools.count()
        self._names: set[str] | None = None  # the graph's tensor names, read on the first named tensor
        self.pending: list = []

    def tensor(self, what: str, shape: Sequence[int], dtype: Any) -> NTensor:
        name = f"{self.prefix}_{next(self._counter)}_{what}"
        return NTensor(self.graph, name=name, shape=tuple(shape), dtype=np.dtype(dtype).type)

    def named(self, name: str, dtype: Any, shape: Sequence[int] | None = None) -> NTensor:
        """A tensor of exactly this name (a graph pass's); GdnExportError where the graph holds one already."""
        if self._names is None:
            self._names = {tensor.name for tensor in self.graph.tensors}
        if name in self._names:
            raise GdnExportError(f"a weight pass would name two tensors {name!r} in the graph")
        self._names.add(name)
        return NTensor(self.graph, name=name, shape=shape, dtype=dtype)

    def op(
        self,
        op_type: str,
        inputs: NTensor | tuple[NTensor, ...] | list[NTensor],
        name: str | None = None,
        dtype: Any = None,
        *,
        shape: Sequence[int] | None = None,
        attribs: dict[str, Any] | None = None,
        what: str | None = None,
        out: NTensor | None = None,
        **more: Any,
    ) -> NTensor:
        """One operation of ``inputs`` into ``out``, or a new tensor (``name``, else ``<prefix>_<n>_<what>``; of
        ``dtype``, the first input's by default), with ``attribs`` then ``more`` (``shape`` is the new tensor's: an
        attribute named shape, as reshape's, goes in ``attribs``)."""
        # a tuple is separate arguments; a list is one list argument (NNEF's concat)
        inputs = (inputs,) if isinstance(inputs, NTensor) else inputs
        if out is None:
            dtype = dtype if dtype is not None else inputs[0].dtype
            out = self.named(name, dtype, shape) if name is not None else self.tensor(what or op_type, shape, dtype)
        self._add(op_type, inputs, (out,), {**(attribs or {}), **more})
        return out

    def multi_op(
        self, op_type: str, inputs: Sequence[NTensor], outputs: Sequence[NTensor], attribs: dict | None = None
    ) -> None:
        self._add(op_type, tuple(inputs), tuple(outputs), attribs or {})

    def _add(self, op_type: str, inputs: tuple | list, outputs: tuple, attribs: dict) -> None:
        # inputs as given: a list is one list argument, not several
        self.pending.append(NOperation(self.graph, type=op_type, attribs=attribs, inputs=inputs, outputs=outputs))

    # --- a graph pass's edits ------------------------------------------------------------------------
    def literal(self, value: Any, dtype: Any = None) -> NTensor:
        """A scalar written inline; a float32 constant as its shortest decimal, which reads back to the same float32."""
        if isinstance(value, np.float32):
            return NTensor(self.graph, name=None, shape=(), dtype=np.float32, data=np.array(float(_literal(value))))
        data = np.array(value, dtype=dtype)
        return NTensor(self.graph, name=None, shape=(), dtype=data.dtype.type, data=data)

    def variable(self, name: str, label: str, shape: tuple[int, ...]) -> NTensor:
        """A float32 variable whose file the caller writes (torch-to-nnef's writer does not know it)."""
        out = self.named(name, np.float32, tuple(shape))
        self.multi_op("variable", (), (out,), {"label": label, "shape": list(shape), "dtype": np.float32})
        return out

    @staticmethod
    def take_output(op: NOperation) -> NTensor:
        """``op``'s one output, detached from it: an operation created next produces it instead."""
        (out,) = op.outputs
        op.outputs = ()
        return out

    def replace(self, op: NOperation, feeding: NOperation | None = None) -> None:
        """``op`` gives way to the operations created since the last replace; ``feeding`` (an operation feeding it),
        left without readers, goes too."""
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

    # --- shape and dtype helpers -------------------------------------------------------------------
    def cast(self, x: NTensor, dtype: Any, out: NTensor | None = None, name: str | None = None) -> NTensor:
        """``x`` in ``dtype`` (itself where it is already, unless ``out`` or ``name`` asks for a new tensor)."""
        dtype = np.dtype(dtype)
        if np.dtype(x.dtype) == dtype and out is None and name is None:
            return x
        if np.dtype(x.dtype) == dtype:
            return self.op("copy", x, name, shape=x.shape, out=out)
        return self.op("tract_core_cast", x, name, dtype.type, shape=x.shape, attribs={"to": DATUM[dtype.name]},
                       what=f"as_{DATUM[dtype.name]}", out=out)

    def transpose(self, x: NTensor, axes: Sequence[int], out: NTensor | None = None) -> NTensor:
        shape = [x.shape[a] for a in axes]
        return self.op("transpose", x, shape=shape, attribs={"axes": list(axes)}, out=out)

    def unsqueeze(self, x: NTensor, axes: Sequence[int]) -> NTensor:
        shape = list(x.shape)
        for axis in sorted(axes):
            shape.insert(axis, 1)
        return self.op("unsqueeze", x, shape=shape, attribs={"axes": list(axes)})

    def squeeze(self, x: NTensor, axes: Sequence[int]) -> NTensor:
        shape = [d for i, d in enumerate(x.shape) if i not in set(axes)]
        return self.op("squeeze", x, shape=shape, attribs={"axes": list(axes)})

    def split_axis(self, x: NTensor, axis: int, sizes: Sequence[int]) -> NTensor:
        """Reshape one static axis into several; the other axes (symbolic ones too) are left alone."""
        shape = list(x.shape[:axis]) + list(sizes) + list(x.shape[axis + 1 :])
        attribs = {"shape": list(sizes), "axis_start": axis, "axis_count": 1}
        return self.op("reshape", x, shape=shape, attribs=attribs)

    def merge_axes(self, x: NTensor, axis: int, count: int, out: NTensor | None = None) -> NTensor:
        """Reshape ``count`` static axes starting at ``axis`` into one."""
        merged = int(np.prod(x.shape[axis : axis + count]))
        shape = list(x.shape[:axis]) + [merged] + list(x.shape[axis + count :])
        attribs = {"shape": [merged], "axis_start": axis, "axis_count": count}
        return self.op("reshape", x, shape=shape, attribs=attribs, out=out)

    # --- arithmetic ---------------------------------------------------------------------------------
    def binary(self, op_type: str, a: NTensor, b: NTensor) -> NTensor:
        if not b.shape:
            return self.op(op_type, (a, b), shape=a.shape)
        shape = [max(x, y) if 1 in (x, y) else x for x, y in zip(a.shape, b.shape)]
        return self.op(op_type, (a, b), shape=shape)

    def unary(self, op_type: str, x: NTensor) -> NTensor:
        return self.op(op_type, x, shape=x.shape)

    def sum_reduce(self, x: NTensor, axes: Sequence[int]) -> NTensor:
        shape = [1 if i in set(axes) else d for i, d in enumerate(x.shape)]
        return self.op("sum_reduce", x, shape=shape, attribs={"axes": list(axes)})

    def scalar(self, value: float, dtype: Any) -> NTensor:
        """A literal: written inline in the operation that uses it."""
        data = np.array(value, dtype=np.dtype(dtype))
        return NTensor(self.graph, name=None, shape=(), dtype=data.dtype.type, data=data)

    # --- constants and matmuls (the chunked lowering) ---------------------------------------------
    def constant(self, what: str, value: np.ndarray) -> NTensor:
        """A constant tensor stored as an NNEF variable (a .dat file), for masks too big to write inline."""
        data = np.ascontiguousarray(value)
        out = self.tensor(what, data.shape, data.dtype)
        out.data = data
        self.multi_op("variable", (), (out,), {"label": out.name, "shape": list(data.shape), "dtype": data.dtype.type})
        return out

    def matmul(self, a: NTensor, b: NTensor, transpose_a: bool = False, transpose_b: bool = False) -> NTensor:
        """Batched matmul over the last two axes; leading axes broadcast (size 1 against size n)."""
        rows = a.shape[-1] if transpose_a else a.shape[-2]
        cols = b.shape[-2] if transpose_b else b.shape[-1]
        batch = [max(x, y) if 1 in (x, y) else x for x, y in zip(a.shape[:-2], b.shape[:-2])]
        return self.op("matmul", (a, b), shape=[*batch, rows, cols],
                       attribs={"transposeA": transpose_a, "transposeB": transpose_b})

    def reshape(self, x: NTensor, axis: int, count: int, sizes: Sequence[int], shape: Sequence[int]) -> NTensor:
        """Reshape ``count`` axes from ``axis`` into ``sizes`` (one may be -1, resolved by tract, so a
        symbolic extent stays symbolic); ``shape`` is the traced result, for the record only."""
        attribs = {"shape": list(sizes), "axis_start": axis, "axis_count": count}
        return self.op("reshape", x, shape=shape, attribs=attribs)


# --- what the weight formats' graph passes read of the graph -------------------------------------------
def variables(graph: NGraph, labels: frozenset) -> dict:
    """label -> the variable operations declaring it, for the labels of ``labels`` the graph declares. (A weight it
    does not declare at all, e.g. a checkpoint weight a family re-lays into others, is never written.)"""
    out: dict = {}
    for op in graph.operations:
        if op.type == "variable" and op.attribs["label"] in labels:
            out.setdefault(op.attribs["label"], []).append(op)
    return out


def table_gathers(graph: NGraph, labels: frozenset) -> list:
    """The ``tract_core_gather`` operations of the graph whose table is a variable of ``labels``."""
    return [op for op in graph.operations if op.type == "tract_core_gather" and op.inputs
            and op.inputs[0].producer is not None and op.inputs[0].producer.type == "variable"
            and op.inputs[0].producer.attribs["label"] in labels]


def readers_left(graph: NGraph, declared: dict, lowered: tuple[str, ...]) -> set[str]:
    """The labels of ``declared`` read by an operation other than the lowered ones (``lowered`` types), or by none:
    a weight read otherwise would need its float values."""
    left = set()
    for label, declaring in declared.items():
        readers = [op for variable in declaring for op in variable.outputs[0].consumers]
        if not readers or any(op.type not in lowered for op in readers) or any(
                variable.outputs[0] in graph.outputs for variable in declaring):
            left.add(label)
    return left


def is_zero_literal(tensor: NTensor) -> bool:
    """torch-to-nnef's "no bias": a scalar literal 0."""
    return tensor.producer is None and tensor.data is not None and np.ndim(tensor.data) == 0 and \
        float(np.asarray(tensor.data)) == 0.0


def _literal(value: np.float32) -> str:
    return np.format_float_scientific(value, unique=True) if value < 1e-4 else \
        np.format_float_positional(value, unique=True)
