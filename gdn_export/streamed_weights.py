"""Weights written from their source, not from the traced module: how a model bigger than memory is exported.

The module is traced with its large parameters as placeholders (``torch.empty``: pages never written take no
memory) and its small ones (up to ``REAL_BYTES``) with their real values, and torch-to-nnef writes the graph as
usual; each variable it would write from a parameter is instead written by a ``StreamedWeights`` writer (e.g.
straight from a memory-mapped safetensors file, cast tensor by tensor). torch-to-nnef's ``write_nnef_tensor`` is
that seam: while ``streamed_writes`` is active, a variable whose label has a writer goes to that writer, any other
variable (constants of the graph, buffers such as rotary tables) is written as usual.

Why small parameters are real: torch-to-nnef reads some values while it translates. It drops a ``mul``/``div`` by
a constant that is all ones (``remap_if_neutral_op``: a ``(1 + w)`` norm whose ``w`` is zero) and folds a product
of two constants. Real small tensors (norm weights, biases, gates, where such values occur) make the same graph as
an in-memory export. A large placeholder must never take part: ``streamed_writes`` refuses the export if a neutral
op is dropped on a constant of ``REAL_BYTES`` or more, or if a constant of that size is written that is no
streamed weight (it could only come from a placeholder).
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable, Iterator, Mapping

import torch

from gdn_export.errors import GdnExportError

@dataclass(frozen=True)
class StreamedWeights:
    """``writers``: label (a parameter's name in the traced module) -> writes its whole NNEF tensor file (header and
    values); ``placeholders``: the labels of each parameter traced as a placeholder (its names, several when tied):
    each must be written under one of them."""

    writers: Mapping[str, Callable[[BinaryIO], None]]
    placeholders: tuple[frozenset, ...] = ()

REAL_BYTES = 1 << 20  # parameters up to this size are traced with their values

_ACTIVE = threading.local()
_INSTALLED = threading.Lock()


@contextmanager
def streamed_writes(weights: StreamedWeights | None) -> Iterator[dict]:
    """Route torch-to-nnef's writes of the variables labelled in ``weights.writers`` to them, in this thread; yields
    a dict that collects ``{"written": set of labels, "seconds": time spent in the writers}``."""
    from torch_to_nnef.nnef_io import writer
    from torch_to_nnef.op.aten import math

    with _INSTALLED:
        if not getattr(writer.write_nnef_tensor, "gdn_export_dispatch", False):
            writer.write_nnef_tensor = _dispatching(writer.write_nnef_tensor)
            math.remap_if_neutral_op = _guarded_neutral(math.remap_if_neutral_op)
    record = {"written": set(), "seconds": 0.0}
    _ACTIVE.state = (weights.writers, record) if weights is not None else None
    try:
        yield record
    finally:
        _ACTIVE.state = None


def _dispatching(original):
    def write_nnef_tensor(array, filename, quantized):
        state = getattr(_ACTIVE, "state", None)
        label = Path(filename).name.removesuffix(".dat")
        if state is not None and label not in state[0] and state[0] and array.nbytes >= REAL_BYTES:
            raise GdnExportError(f"torch-to-nnef wrote a constant {label!r} of {array.nbytes} bytes that is no "
                                 "weight of the model: computed from weight placeholders, it would be wrong; export "
                                 "this model in memory instead (streamed=False)")
        if state is None or label not in state[0]:
            return original(array, filename, quantized)
        writers, record = state
        start = time.perf_counter()
        Path(filename).parent.mkdir(parents=True, exist_ok=True)
        with open(filename, "wb") as file:
            writers[label](file)
        record["written"].add(label)
        record["seconds"] += time.perf_counter() - start

    write_nnef_tensor.gdn_export_dispatch = True
    return write_nnef_tensor


def _guarded_neutral(original):
    def remap_if_neutral_op(torch_graph, node, a, b):
        state = getattr(_ACTIVE, "state", None)
        if state is None or not state[0] or a.data is None:
            return original(torch_graph, node, a, b)
        data = a.into_tensor_variable().data
        if isinstance(data, torch.Tensor) and data.numel() * data.element_size() >= REAL_BYTES \
                and bool((data == 1.0).all()):
            raise GdnExportError(f"torch-to-nnef would drop an op by a large all-ones constant (in {getattr(node, 'kind', '?')}), a value "
                                 "of weight placeholders; export this model in memory instead (streamed=False)")
        return original(torch_graph, node, a, b)

    return remap_if_neutral_op


def check_all_written(weights: StreamedWeights, record: dict) -> None:
    """Every placeholder weight must have been written: one that was not means torch-to-nnef dropped or folded it
    on its placeholder value: a wrong model, refused. (A small weight, traced with its real value, may be dropped
    as an in-memory export drops it: a multiplication by ones.)"""
    missing = sorted(min(group) for group in weights.placeholders if not group & record["written"])
    if missing:
        raise GdnExportError(f"{len(missing)} streamed weights were not written as variables of their own name "
                             f"(e.g. {missing[0]}): the export would carry placeholder values; export this model "
                             "in memory instead")
