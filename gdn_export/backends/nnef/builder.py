"""A small writer of NNEF operations into torch-to-nnef's graph, with unique names and tracked shapes."""

from __future__ import annotations

import itertools
from typing import Any, Sequence

import numpy as np
from nnef_tools.model import Graph as NGraph
from nnef_tools.model import Operation as NOperation
from nnef_tools.model import Tensor as NTensor

from gdn_export.targets import NNEF_DATUM



class NnefBuilder:
    """Adds operations whose intermediate tensors are named ``<prefix>_<n>_<what>``.

    Shapes are the traced extents; they only document the graph (tract infers its own), so a symbolic
    axis traced at some length stays symbolic in the written file as long as no attribute bakes it in.
    """

    def __init__(self, graph: NGraph, prefix: str) -> None:
        self.graph = graph
        self.prefix = prefix
        self._counter = itertools.count()

    def tensor(self, what: str, shape: Sequence[int], dtype: Any) -> NTensor:
        name = f"{self.prefix}_{next(self._counter)}_{what}"
        return NTensor(self.graph, name=name, shape=tuple(shape), dtype=np.dtype(dtype).type)

    def op(
        self,
        op_type: str,
        inputs: NTensor | tuple[NTensor, ...] | list[NTensor],
        *,
        shape: Sequence[int],
        dtype: Any = None,
        attribs: dict[str, Any] | None = None,
        what: str | None = None,
        out: NTensor | None = None,
    ) -> NTensor:
        # a tuple is separate arguments; a list is one list argument (NNEF's concat)
        inputs = (inputs,) if isinstance(inputs, NTensor) else inputs
        if out is None:
            out = self.tensor(what or op_type, shape, dtype if dtype is not None else inputs[0].dtype)
        NOperation(self.graph, type=op_type, attribs=attribs or {}, inputs=inputs, outputs=(out,))
        return out

    def multi_op(
        self, op_type: str, inputs: Sequence[NTensor], outputs: Sequence[NTensor], attribs: dict | None = None
    ) -> None:
        NOperation(self.graph, type=op_type, attribs=attribs or {}, inputs=tuple(inputs), outputs=tuple(outputs))

    # --- shape and dtype helpers -------------------------------------------------------------------
    def cast(self, x: NTensor, dtype: Any, out: NTensor | None = None) -> NTensor:
        dtype = np.dtype(dtype)
        if np.dtype(x.dtype) == dtype and out is None:
            return x
        if np.dtype(x.dtype) == dtype:
            return self.op("copy", x, shape=x.shape, out=out)
        return self.op(
            "tract_core_cast", x, shape=x.shape, dtype=dtype, attribs={"to": NNEF_DATUM[np.dtype(dtype).name]},
            what=f"as_{NNEF_DATUM[np.dtype(dtype).name]}", out=out,
        )

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
        attribs = {"label": out.name, "shape": list(data.shape), "dtype": data.dtype.type}
        NOperation(self.graph, type="variable", attribs=attribs, inputs=(), outputs=(out,))
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
