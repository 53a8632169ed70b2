"""float16 weights for a float32 graph (``quantize="f16"``): half the bytes of every matrix, float32 arithmetic.

The math: each linear layer's weight ``W`` is stored rounded to float16 (``round_trip``: round half to even, what
``torch.Tensor.half`` does) and the graph stays float32: tract 0.23.9 plans ``linear(x f32, W f16)`` on its f32
matmul kernels with an f16-reading packing, done once at load, so a matrix-vector product reads 2 bytes a weight and
everything around the matmuls (norms, gates, the recurrent states, the scans) computes in float32 as in a float32
archive. The check's reference is transformers' model computing with the same rounded weights (``round_trip``), so
the float32 rule still judges the graph.

Why not ``--dtype float16``: on x86 tract 0.23.9 multiplies f16 matrices with 256-bit kernels only, and runs f16
elementwise operations unfused over a symbolic sequence axis (no x86 f16 binary kernels); measured on an AVX-512
Xeon, 4 layers of the 0.8B Qwen3.5 shape, one thread: prefill 2.37x faster than the float16 graph, decode 1.17x,
logits 1.1e-5 from float32 against 1.0e-2 (``benchmarks/bench_f16_matmul.py``, docs/QUANTIZATION.md). A float16
graph stays what a GPU runtime wants (tract's CUDA runtime computes f16 natively).

Embedding tables (read by gathers only) are stored in float16 too, their values **negated**, and each gather of one
becomes gather, cast to float32, negate (``lower_gathers``: exact). Why negated: a tied head gets a copy of the table
of its own (``weight_writers.separate_tied_head``), and tract 0.23.9 keeps one constant for equal values; read by a
gather as well, the head's weight would be packed on every call instead of once
(``tract_quirks.EQUAL_CONSTANTS_MERGED``).
"""

from __future__ import annotations

import functools
import sys
from typing import BinaryIO, Callable

import numpy as np
import torch

from gdn_export.errors import GdnExportError
from gdn_export.weights.encoding import Encoding, write_array
from gdn_export.backends.nnef.builder import NnefBuilder, readers_left, table_gathers, variables
from gdn_export.weights.int8.codec import write_header

NAME = "f16"
SLICE_BYTES = 64 << 20  # a weight is written a slice of rows of about this many float32 bytes at a time


def quantizable(shape: tuple[int, ...]) -> bool:
    """Any matrix."""
    return len(shape) == 2 and shape[0] > 0 and shape[1] > 0


def nbytes(shape: tuple[int, ...]) -> int:
    return 2 * int(np.prod(shape, dtype=np.int64))


def round_trip(x: torch.Tensor) -> torch.Tensor:
    """``x`` as tract computes with it once stored in float16 (same dtype as ``x``)."""
    return x.detach().to(torch.float16).to(x.dtype)


EXPONENT, SIGN = np.uint16(0x7C00), np.uint16(0x8000)  # float16's exponent and sign bits
LARGEST = float(np.finfo(np.float16).max)  # 65504: a weight beyond it would be stored as infinity


def write_nnef(file: BinaryIO, shape: tuple[int, ...], read_rows: Callable[[int, int], np.ndarray],
               negated: bool = False, name: str = "a weight") -> None:
    """The float16 ``.dat`` of weight ``name`` of ``shape`` read a slice of rows at a time (``read_rows(start,
    stop)``: float32 values); ``negated`` (a table, see the module docstring): their negations (exact in float16).
    A value beyond float16's range (``LARGEST``, rounding included) is refused rather than stored as infinity."""
    shape = tuple(shape)
    write_header(file, shape, np.dtype(np.float16))
    step = max(1, SLICE_BYTES // max(1, int(np.prod(shape[1:], dtype=np.int64)) * 4))
    for start in range(0, shape[0], step):
        values = np.asarray(read_rows(start, min(shape[0], start + step)), dtype=np.float32)
        with np.errstate(over="ignore"):
            rows = values.astype(np.float16)
        bits = rows.view(np.uint16)  # float16 arithmetic is emulated in numpy: its bits are tested and flipped instead
        if ((bits & EXPONENT) == EXPONENT).any():  # an all-ones exponent: infinity or nan
            if not np.isfinite(values).all():
                raise GdnExportError(f"{name} holds a non-finite value (inf or nan) in the checkpoint")
            worst = float(np.abs(values[~np.isfinite(rows)]).max())
            raise GdnExportError(f"{name} has a value of magnitude {worst:g}, beyond float16's range (largest "
                                 f"{LARGEST:g}): --quantize f16 cannot store it; convert it in float32")
        write_array(file, bits ^ SIGN if negated else bits)  # negation: the sign bit flipped, as -rows flips it


def lower_gathers(graph, labels: frozenset) -> None:
    """Rewrite every ``tract_core_gather`` of rows of a float16 table (a variable of ``labels``, stored negated) of
    torch-to-nnef's NNEF graph (before it is written: a graph pass of the export's target) into the gather, a cast
    to float32 and a negation. Refused: a table read otherwise than by a gather (its values are negated)."""
    edit = NnefBuilder(graph)
    declared = variables(graph, labels)
    for op in table_gathers(graph, labels):
        y = edit.take_output(op)
        rows = edit.op("tract_core_gather", tuple(op.inputs), f"{y.name}__f16_negated_rows", np.float16,
                       attribs=op.attribs)
        edit.op("neg", edit.cast(rows, np.float32, name=f"{y.name}__f16_negated_rows_f32"), out=y)
        edit.replace(op)
    read = readers_left(graph, declared, ("tract_core_gather",))
    if read:
        raise GdnExportError(f"{len(read)} float16 tables are read by the graph otherwise than by a gather "
                             f"(e.g. {min(read)}): their stored values are negated")


# -- the codec protocol (gdn_export.weights.encoding): what the conversion asks of the f16 format ---------------------


def expert_stacks_kept(shapes: list, fused: bool) -> str:
    return "expert stacks (f16 stacks in a float32 tract_moe_ffn not measured)"


class F16Encoding(Encoding):
    """float16 values; ``negated`` for the embedding tables (each gather then cast and negated back, the module
    docstring says why)."""

    def __init__(self, labels: frozenset, negated: bool = False) -> None:
        passes = (functools.partial(lower_gathers, labels=labels),) if negated else ()
        super().__init__(sys.modules[__name__], labels, graph_passes=passes, float_type="f16")
        self.negated = negated
        self.table_words = "F16 (negated, the gathered rows negated back"

    def write(self, file: BinaryIO, shape: tuple[int, ...], read_rows, label: str, aliases: tuple,
              source: str) -> None:
        write_nnef(file, shape, read_rows, negated=self.negated, name=f"weight {label}")


def weights_encoding(labels: frozenset, report) -> F16Encoding:
    return F16Encoding(labels)


def tables_encoding(dtype: str, pick) -> F16Encoding:
    return F16Encoding(pick(sys.modules[__name__]), negated=True)
