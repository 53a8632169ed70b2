"""How one set of tensors is stored in an archive: the weights a format chose, or the embedding tables it stores
beside them. A format's codec (``weights/<format>/codec.py``) makes them; ``hf.weight_writers.plan_writes`` asks it
and never tests a format's name.

The codec protocol (what ``plan_writes`` reads of ``weight_format(name).codec_module()``):

* required: ``quantizable(shape) -> bool`` (the tensors it can store), ``nbytes(shape) -> int``, ``round_trip(x)`` (a
  tensor as tract computes with it once stored: the check's reference) and ``write_nnef(file, shape, read_rows)``;
* optional: ``select(chosen, candidates, reference_is_linear) -> (chosen, {reason: count})`` (narrow the choice:
  a weight its check cannot emulate), ``expert_stacks_kept(shapes, fused) -> reason | None`` (whether the MoE expert
  stacks of a ``moe_ffn`` node take the format: ``shapes`` is each stack's shape and its checkpoint source's, ``fused``
  whether tract's fused op runs it; default: kept), ``weights_encoding(labels, report) -> Encoding`` (default:
  ``Encoding(codec, labels)``), ``tables_encoding(dtype, pick) -> Encoding | None`` (the embedding tables only a
  gather reads, stored beside the weights: ``pick(table_codec)`` gives the labels of those ``table_codec`` can store;
  default: none), ``describe(report) -> str`` (the report's words), ``report_fields(**options) -> dict`` (the
  format's own values in the report, ``QuantizationReport.own``, given the weight options: only its codec reads
  them), ``note_calibrated(own, source, calibration, matrix, columns_kept)`` (record what a calibration measured of
  a stored weight: Q4_0's weighting) and ``ROUNDS_INPUTS`` (the check's reference rounds the inputs of the stored
  layers as the graph does: int8).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import BinaryIO, Callable

import numpy as np


@dataclass
class Encoding:
    """``labels``: the traced module's names of the tensors stored so; ``codec``: the module that writes them."""

    codec: object
    labels: frozenset = frozenset()
    graph_passes: tuple = ()  # passes over torch-to-nnef's graph these tensors need (StreamedWeights.graph_passes)
    extra: dict = field(default_factory=dict)  # label -> writer of a tensor the passes added (e.g. int8 scales)
    table_words: str = ""  # the report's words for embedding tables stored so
    # tract's float type of the stored values ("f16"), where tract reads them as they are: such a tensor's file may
    # then be written after the trace (``StreamedWeights.deferrable``), as a float matrix of the export dtype is;
    # None for codes (int8, Q4_0 blocks), which the graph's load for its output names reads
    float_type: str | None = None

    def write(self, file: BinaryIO, shape: tuple[int, ...], read_rows: Callable, label: str, aliases: tuple,
              source: str) -> None:
        """Write the tensor ``label`` (also named ``aliases``; from checkpoint tensor ``source``)."""
        self.codec.write_nnef(file, shape, read_rows)

    def round_trip(self, source: str) -> Callable:
        """The reference's reading of checkpoint tensor ``source`` once stored so."""
        return self.codec.round_trip

    def nbytes(self, shape: tuple[int, ...]) -> int:
        return self.codec.nbytes(shape)


def write_array(file: BinaryIO, value: np.ndarray) -> None:
    """``value``'s bytes in C order, written from the array itself (``tobytes`` copied every weight once more)."""
    file.write(memoryview(np.ascontiguousarray(value).reshape(-1)).cast("B"))
