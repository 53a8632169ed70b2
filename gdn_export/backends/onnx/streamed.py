"""ONNX weights written from their source into ``OUT.onnx.data``, not from the traced module: an export whose
memory does not grow with the model.

The module is traced with its large parameters as placeholders (``torch.empty``, as for NNEF:
``gdn_export/weights/streamed.py``) and ``torch.onnx.export`` runs with ``export_params=False``: the exporter
serializes no tensor, every parameter is left a graph input. ``capture`` records, from inside the exporter,
what each of those inputs holds; ``plan`` turns each into an initializer with a known recipe, and ``write``
stores them (the real ones from their values, the placeholders from their ``Source``, a slice of rows at a time,
in the export dtype) in the layout ``onnx.save_model(..., save_as_external_data=True, size_threshold=1024)``
gives an in-memory export: the same ``.onnx`` and ``.data`` bytes (tests/test_onnx_streamed.py).

What the exporter does to parameters before it serializes them (its constant folding): a Linear's
``Transpose(W)`` becomes a transposed ``W`` under a new name (a view of W's storage), a squeezed conv weight a
reshaped view, and a node whose inputs are all constants is computed (``1 + w`` of a norm weight). So the
placeholders are swapped for *sentinels* before the fold: NaN-filled views of a small storage whose axes have
distinct strides. After it, an initializer is
- a view of a sentinel: its sizes and strides say which axes of the source it permutes (axes of size 1 dropped
  or added): written as ``source.permute(...)``, the only recipe besides identity;
- a real tensor (a small parameter traced with its value, a buffer, a fold of those): written as it is;
- anything else is refused (``StreamingRefused``): a fold that computed from a placeholder, found in the graph
  before the fold (a non-view node whose inputs are all constants, one from a placeholder, gone after it) and,
  for floats, by NaN in a computed initializer.
Why sentinels and not the placeholders: the exporter deduplicates initializers by value, and zero-filled
placeholders of one shape would all become one. Sentinels (NaN) are never equal, so two weights with equal
values stay two initializers here (an in-memory export would merge them; the values are right either way).
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import BinaryIO, Iterator, Mapping, Protocol

import numpy as np
import torch
from onnx import TensorProto

from gdn_export.errors import GdnExportError

SLICE_BYTES = 64 << 20  # a weight is read and written in slices of rows of about this size
SIZE_THRESHOLD = 1024  # onnx.save_model's default: initializers below it stay in the .onnx
# fold results that are views of their input, as the exporter computes them (at::permute, at::reshape, ...)
_VIEW_OPS = {"onnx::Transpose", "onnx::Squeeze", "onnx::Unsqueeze", "onnx::Reshape", "onnx::Identity",
             "onnx::Flatten"}
_SHAPE_OPS = {"onnx::Shape", "onnx::Size"}  # read the placeholder's shape only, which is right
_ONNX_TYPES = {torch.float32: TensorProto.FLOAT, torch.float16: TensorProto.FLOAT16,
               torch.float64: TensorProto.DOUBLE, torch.bfloat16: TensorProto.BFLOAT16,
               torch.int64: TensorProto.INT64, torch.int32: TensorProto.INT32, torch.int16: TensorProto.INT16,
               torch.int8: TensorProto.INT8, torch.uint8: TensorProto.UINT8, torch.bool: TensorProto.BOOL}
_NUMPY = {torch.float32: np.float32, torch.float16: np.float16}


class StreamingRefused(GdnExportError):
    """The exporter made an initializer from a placeholder that no known recipe writes: export in memory."""


class Source(Protocol):
    """Where a placeholder's values come from (``gdn_export.hf.tensors.TensorEntry`` is one)."""

    name: str
    shape: tuple[int, ...]

    def rows(self, start: int, stop: int, target: np.dtype) -> np.ndarray: ...


@dataclass(frozen=True)
class Weight:
    """An initializer written from ``source``: its non-unit axes permuted by ``perm``, reshaped to ``shape``."""

    source: Source
    perm: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class Initializer:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    value: torch.Tensor | None = None  # a real tensor, written as it is
    weight: Weight | None = None

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


@dataclass
class Capture:
    sources: Mapping[int, Source]  # placeholder storage data_ptr -> its source
    sentinels: dict[int, tuple[Source, torch.Tensor]] = field(default_factory=dict)  # sentinel storage -> both
    params: dict[str, torch.Tensor] | None = None  # the final initializers, by name, in the exporter's order
    folded_from_placeholders: list[str] = field(default_factory=list)  # refused folds: node kinds
    real_storages: set[int] = field(default_factory=set)


def _sentinel(t: torch.Tensor) -> torch.Tensor:
    """NaN in a storage of 1 + sum((d_i - 1) (i + 1)) items viewed with strides 1, 2, 3...: axis i of any view
    of it is recognized by its stride."""
    strides = tuple(i + 1 for i in range(t.dim()))
    items = 1 + sum((d - 1) * s for d, s in zip(t.shape, strides)) if t.numel() else 0
    return torch.full((items,), float("nan"), dtype=t.dtype).as_strided(t.shape, strides)


def _risky_folds(graph, params: Mapping[str, torch.Tensor], placeholders: set[str]) -> list[tuple[str, list[int]]]:
    """Nodes the fold may compute from a placeholder's values: all inputs constant, one from a placeholder, not a
    view and not a shape read. (kind, output ids)."""
    constant, tainted, risky = set(), set(), []
    for value in graph.inputs():
        if value.debugName() in params:
            constant.add(value.unique())
            if value.debugName() in placeholders:
                tainted.add(value.unique())
    for node in graph.nodes():
        inputs = [v.unique() for v in node.inputs()]
        outputs = [v.unique() for v in node.outputs()]
        if node.kind() == "onnx::Constant":
            constant.update(outputs)
        elif inputs and all(i in constant for i in inputs):
            constant.update(outputs)
            if any(i in tainted for i in inputs) and node.kind() not in _SHAPE_OPS:
                tainted.update(outputs)
                if node.kind() not in _VIEW_OPS:
                    risky.append((node.kind(), outputs))
    return risky


@contextmanager
def capture(sources: Mapping[int, Source], module: torch.nn.Module) -> Iterator[Capture]:
    """Within: a ``torch.onnx.export`` of ``module`` (TorchScript exporter) records its final initializers (with
    sentinels for the placeholders) into the yielded ``Capture``; ``sources``: placeholder storage data_ptr ->
    its source. The ``torch._C`` passes are hooked for the duration (backends/compat/torch_onnx.py: one export at a
    time)."""
    record = Capture(sources)
    record.real_storages = {t.untyped_storage().data_ptr() for t in (*module.parameters(), *module.buffers())
                            if t.untyped_storage().data_ptr() not in sources}
    from gdn_export.backends.compat import patched
    from gdn_export.backends.compat.torch_onnx import onnx_pass_patches

    def eval_peephole(peephole):
        def hooked(graph, params):
            if any(n.kind() == "onnx::BatchNormalization" for n in graph.nodes()):  # fused into Conv from the values
                record.folded_from_placeholders.append("onnx::BatchNormalization")
            return peephole(graph, params)
        return hooked

    def constant_fold(fold):
        def hooked(graph, params, opset):
            placeholders = set()
            for name, t in list(params.items()):
                source = sources.get(t.untyped_storage().data_ptr())
                if source is not None:
                    if tuple(t.shape) != tuple(source.shape) or not t.is_contiguous() or t.storage_offset():
                        record.folded_from_placeholders.append(f"a view of {source.name} as a parameter")
                    sentinel = _sentinel(t)
                    record.sentinels[sentinel.untyped_storage().data_ptr()] = (source, sentinel)
                    params[name] = sentinel
                    placeholders.add(name)
            risky = _risky_folds(graph, params, placeholders)
            result = fold(graph, params, opset)
            left = {v.unique() for n in graph.nodes() for v in n.outputs()}
            record.folded_from_placeholders += [kind for kind, outs in risky if not all(o in left for o in outs)]
            return result
        return hooked

    def deduplicate(dedup):
        def hooked(graph, params, training):
            result = dedup(graph, params, training)
            record.params = dict(result)
            return result
        return hooked

    with patched(*onnx_pass_patches(eval_peephole, constant_fold, deduplicate)):
        yield record


def _view_recipe(name: str, t: torch.Tensor, source: Source, sentinel: torch.Tensor) -> Weight:
    """The permutation of the source's axes that view ``t`` of ``sentinel`` is, or StreamingRefused."""
    axes = {stride: i for i, (d, stride) in enumerate(zip(sentinel.shape, sentinel.stride())) if d > 1}
    perm = []
    for d, stride in zip(t.shape, t.stride()):
        if d > 1:
            i = axes.get(stride)
            if i is None or sentinel.shape[i] != d or i in perm:
                perm = None
                break
            perm.append(i)
    if perm is None or len(perm) != len(axes) or t.storage_offset() != 0 or t.dtype != sentinel.dtype:
        raise StreamingRefused(f"initializer {name} is a view of weight {source.name} (sizes {list(t.shape)}, strides "
                               f"{list(t.stride())}, offset {t.storage_offset()}) that is no permutation of it")
    order = sorted(axes.values())
    return Weight(source, tuple(order.index(i) for i in perm), tuple(t.shape), t.dtype)


def plan(record: Capture, input_names: list[str]) -> list[Initializer]:
    """The initializers of the exported graph (``input_names``: its inputs, in order), each with its recipe."""
    if record.params is None:
        raise GdnExportError("the ONNX exporter did not run its initializer passes: cannot stream the weights")
    if record.folded_from_placeholders:
        raise StreamingRefused(f"the ONNX exporter computed constants from weight placeholders "
                               f"({', '.join(sorted(set(record.folded_from_placeholders)))}): their values would be "
                               f"wrong")
    missing = sorted(set(record.params) - set(input_names))
    if missing:
        raise GdnExportError(f"initializers {missing[:3]} are not inputs of the exported graph")
    out = []
    for name in input_names:
        t = record.params.get(name)
        if t is None:
            continue
        storage = t.untyped_storage().data_ptr()
        if storage in record.sentinels:
            source, sentinel = record.sentinels[storage]
            out.append(Initializer(name, tuple(t.shape), t.dtype, weight=_view_recipe(name, t, source, sentinel)))
            continue
        if storage not in record.real_storages and t.is_floating_point() and bool(torch.isnan(t).any()):
            raise StreamingRefused(f"initializer {name} was computed from weight placeholders (NaN sentinels)")
        if t.dtype not in _ONNX_TYPES:
            raise GdnExportError(f"initializer {name} has dtype {t.dtype}, which this writer does not store")
        out.append(Initializer(name, tuple(t.shape), t.dtype, value=t.detach().contiguous()))
    return out


def _rows_per_slice(shape: tuple[int, ...], itemsize: int) -> int:
    row = int(np.prod(shape[1:], dtype=np.int64)) * itemsize if len(shape) > 1 else itemsize
    return max(1, SLICE_BYTES // max(row, 1))


def write_weight(file: BinaryIO, offset: int, weight: Weight) -> None:
    """``weight``'s values at ``offset`` of ``file``, a slice of the source's rows at a time (memory: one slice
    and its permuted copy): identity as rows, a permutation by contiguous runs of the output (``os.pwrite``).
    A source with ``release`` (one read whole) is released after."""
    try:
        _write_weight(file, offset, weight)
    finally:
        getattr(weight.source, "release", lambda: None)()


def _write_weight(file: BinaryIO, offset: int, weight: Weight) -> None:
    target = np.dtype(_NUMPY[weight.dtype])
    shape = tuple(weight.source.shape)
    kept = [d for d in shape if d > 1]
    identity = list(weight.perm) == sorted(weight.perm)
    rows = shape[0] if shape else 1
    if not identity and (not shape or shape[0] == 1):  # no rows to slice along: the tensor at once
        whole = weight.source.rows(0, rows, target).reshape(kept).transpose(weight.perm)
        _pwrite(file, np.ascontiguousarray(whole), offset)
        return
    step = _rows_per_slice(shape, target.itemsize)
    if identity:  # the same bytes as the source, in row order
        row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * target.itemsize
        for start in range(0, rows, step):
            block = weight.source.rows(start, min(rows, start + step), target)
            _pwrite(file, np.ascontiguousarray(block), offset + start * row_bytes)
        return
    out = [kept[i] for i in weight.perm]  # the output's non-unit axes
    axis = list(weight.perm).index(0)  # where the source's rows go
    inner = int(np.prod(out[axis + 1:], dtype=np.int64))
    outer = int(np.prod(out[:axis], dtype=np.int64))
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        block = weight.source.rows(start, stop, target).reshape([stop - start, *kept[1:]]).transpose(weight.perm)
        runs = np.ascontiguousarray(block).reshape(outer, (stop - start) * inner)
        for j in range(outer):
            position = (j * out[axis] + start) * inner * target.itemsize
            _pwrite(file, runs[j], offset + position)


def _pwrite(file: BinaryIO, values, offset: int) -> None:
    """All of ``values`` (bytes or a contiguous array) at ``offset``: a write may take less (Linux: 2 GiB at most)."""
    view = memoryview(values).cast("B")
    while view:
        written = os.pwrite(file.fileno(), view, offset)
        view, offset = view[written:], offset + written


def _external(tensor: TensorProto, location: str, offset: int, length: int) -> None:
    """As ``onnx.external_data_helper.set_external_data`` records it."""
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", offset), ("length", length)):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, str(value)


def write(model, initializers: list[Initializer], data_path: os.PathLike) -> dict[str, int]:
    """Add ``initializers`` to ``model`` (removing them from its inputs) and write ``data_path``: each in turn, from
    SIZE_THRESHOLD bytes (``sys.getsizeof`` of its raw bytes, as onnx.save_model measures) in the data file at the
    next offset, smaller ones in the model. Returns {"weights": bytes streamed from sources, "data": file size}."""
    names = {i.name for i in initializers}
    declared = {v.name: v for v in model.graph.input if v.name in names}
    inputs = [v for v in model.graph.input if v.name not in names]
    del model.graph.input[:]
    model.graph.input.extend(inputs)
    streamed, position = 0, 0
    location = os.path.basename(os.fspath(data_path))
    with open(data_path, "wb") as file:
        for init in initializers:
            _check_declared(init, declared.get(init.name))
            tensor = model.graph.initializer.add()
            tensor.name = init.name
            tensor.dims.extend(init.shape)
            tensor.data_type = _ONNX_TYPES[init.dtype]
            if init.value is not None:
                raw = init.value.reshape(-1).view(torch.uint8).numpy().tobytes()
                if sys.getsizeof(raw) < SIZE_THRESHOLD:
                    tensor.raw_data = raw
                    continue
                _pwrite(file, raw, position)
                _external(tensor, location, position, len(raw))
                position += len(raw)
                continue
            write_weight(file, position, init.weight)
            _external(tensor, location, position, init.nbytes)
            position += init.nbytes
            streamed += init.nbytes
        file.truncate(position)
    return {"weights": streamed, "data": position}


def _check_declared(init: Initializer, value_info) -> None:
    """The graph input the exporter left for it must have its type and shape."""
    if value_info is None:
        return
    tensor_type = value_info.type.tensor_type
    dims = [d.dim_value if d.HasField("dim_value") else None for d in tensor_type.shape.dim]
    if tensor_type.elem_type != _ONNX_TYPES[init.dtype] or dims != list(init.shape):
        raise GdnExportError(f"initializer {init.name}: the graph declares {dims} of ONNX type {tensor_type.elem_type}, "
                             f"its value is {list(init.shape)} {init.dtype}")
