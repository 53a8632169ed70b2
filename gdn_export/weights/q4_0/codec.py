"""tract's Q4_0 weights: blocks of 32 values, one float16 scale and 32 four-bit codes each.

The format (tract's and llama.cpp's Q4_0): each block of 32 consecutive values along the inner axis has a scale
``d`` and stores each value ``x`` as the code ``q = clamp(floor(x / d + 8.5), 0, 15)``, read back as
``(q - 8) * d``. tract runs any scale; which one each block gets is the converter's choice (``RULES``):

- "nearest" (llama.cpp's Q4_0 without an importance matrix, and this project's rule before): ``d = m / -8`` with
  ``m`` the block's value of largest magnitude, sign kept; ``m`` maps to code 0, so it is kept exactly.
- "search" (the default): the scale of least squared error of the block among candidates (``searched_scales``,
  llama.cpp's ``make_qx_quants`` with a wider range), optionally each value's error weighted by the importance of
  its input channel (its mean squared activation on calibration text, llama-imatrix's measure: the expected
  squared error of the layer's output is then what is minimized, cross-channel terms aside). Never worse than the
  nearest rule on any block.

A block is 18 bytes: the scale (f16), then 16 bytes whose byte ``i`` holds code ``i`` in its low nibble and code
``16 + i`` in its high nibble (tract 0.21.11 and later). tract reads a ``.dat`` with this item type as a
block-quantized constant: a matmul over it runs its Q4_0 kernel, any other use dequantizes it. ``write_nnef``
streams a tensor row by row; ``dequantize`` is the reference the check compares the export with.
"""

from __future__ import annotations

import sys
from typing import BinaryIO, Callable

import numpy as np
import torch

from gdn_export.errors import GdnExportError
from gdn_export.weights.encoding import Encoding
# how blocks are chosen (the module docstring); the first is the default
from gdn_export.weights.q4_0.format import RULES  # noqa: F401

BLOCK = 32
BLOCK_BYTES = 18
NAME = "q4_0"


def quantizable(shape: tuple[int, ...]) -> bool:
    """A matrix (rank 2 or more) whose inner axis is whole blocks."""
    return len(shape) >= 2 and shape[-1] % BLOCK == 0 and shape[-1] > 0


# The search's candidate scales, d = m / -(8 + step) for these steps (llama.cpp's make_qx_quants tries 19 steps of
# 0.1 in -0.9..0.9), and how many times the codes nearest for the f16 scale then the scale of least error for those
# codes are recomputed. Measured on 2**20 Gaussian and Student-t(3) values: squared error 0.885x and 0.936x the
# nearest rule's with these 11 steps and one refinement, as with 26 steps of 0.1 in -1.5..1 (7 steps: 0.889x).
STEPS = np.arange(-1.5, 1.01, 0.25).astype(np.float32)
REFINEMENTS = 1
CHUNK = 4096  # blocks the search works on at once (512 KB of values)


def quantize(x: np.ndarray, rule: str = "search", importance: np.ndarray | None = None,
             gram: np.ndarray | None = None) -> np.ndarray:
    """``x`` (float, inner axis a multiple of 32) -> uint8 ``[blocks, 18]``, each block's scale chosen by ``rule``.

    ``importance`` (the search only): a non-negative weight per index of the inner axis (an input channel's mean
    squared activation): the search minimizes the block's error weighted by it; None weighs every value alike.
    ``gram`` (rule "gptq", which needs it): the inputs' second moments ``E[a a^T]`` (inner x inner)."""
    if rule == "gptq":
        if gram is None:
            raise ValueError("Q4_0 rule 'gptq' needs the inputs' second moments (calibration)")
        return gptq(np.asarray(x, np.float32).reshape(-1, x.shape[-1]), gram)
    blocks = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, BLOCK)
    if rule == "nearest":
        scale = nearest_scales(blocks)
    elif rule == "search":  # a chunk at a time: its temporaries stay in the CPU's cache (2x faster than whole)
        weights = _block_weights(importance, x.shape[-1], len(blocks))
        scale = np.concatenate([searched_scales(blocks[i:i + CHUNK], None if weights is None else weights[i:i + CHUNK])
                                for i in range(0, len(blocks), CHUNK)] or [np.zeros(0, np.float16)])
    else:
        raise ValueError(f"Q4_0 rule {rule!r} is not one of {', '.join(RULES)}")
    return pack(scale, codes_for(blocks, scale))


def pack(scale: np.ndarray, codes: np.ndarray) -> np.ndarray:
    """f16 scales ``[blocks]`` and uint8 codes ``[blocks, 32]`` -> the format's bytes ``[blocks, 18]``."""
    out = np.empty((len(scale), BLOCK_BYTES), np.uint8)
    out[:, :2] = scale.view(np.uint8).reshape(-1, 2)
    out[:, 2:] = codes[:, :16] | (codes[:, 16:] << 4)
    return out


DAMPING = 0.01  # GPTQ's: this fraction of the mean diagonal of the second moments is added to it
LAZY = 128  # columns GPTQ quantizes before updating the ones after them (its lazy batch)


def gptq(rows: np.ndarray, gram: np.ndarray) -> np.ndarray:
    """Q4_0 bytes of ``rows`` ``[n, inner]`` by GPTQ's error feedback (Frantar et al. 2022), for inputs whose
    second moments are ``gram`` ``E[a a^T]``: the columns are quantized in order, each block's scale by the search
    weighted by the diagonal of ``gram`` (on the block's values as updated so far), each column's codes the nearest
    for it, and each column's error, scaled by the inverse Cholesky factor of ``gram``, subtracted from the columns
    not yet quantized, so that the layer's expected squared output error ``E|(W - Q) a|^2`` is what is minimized,
    cross-channel terms included. Each row independently of the others (any slice of rows gives the same bytes)."""
    n, inner = rows.shape
    upper = _inverse_cholesky(gram)
    diagonal = np.maximum(np.diag(np.asarray(gram, np.float32)), 0).astype(np.float32)
    wt = np.array(rows.T, np.float32, order="C")  # a column of the weight is a contiguous row here
    wt[np.diag(np.asarray(gram)) <= 0] = 0.0  # inputs that are always zero: their weights cost nothing
    scales = np.empty((n, inner // BLOCK), np.float16)
    codes = np.empty((inner, n), np.uint8)
    for outer in range(0, inner, LAZY):  # GPTQ's lazy batches: the columns after one updated once per LAZY
        end = min(inner, outer + LAZY)
        errors = np.empty((end - outer, n), np.float32)
        for start in range(outer, end, BLOCK):
            stop = start + BLOCK
            block = np.ascontiguousarray(wt[start:stop].T)
            scale = searched_scales(block, np.broadcast_to(diagonal[start:stop], block.shape))
            scales[:, start // BLOCK] = scale
            inverse = np.divide(1.0, scale.astype(np.float32), out=np.zeros(n, np.float32), where=scale != 0)
            wide = scale.astype(np.float32)
            for j in range(start, stop):
                code = np.clip(np.floor(wt[j] * inverse + 8.5), 0, 15)
                codes[j] = code
                error = errors[j - outer] = (wt[j] - (code - 8.0) * wide) / upper[j, j]
                wt[j + 1:end] -= upper[j, j + 1:end, None] * error
        wt[end:] -= upper[outer:end, end:].T @ errors
    return pack(scales.reshape(-1), np.ascontiguousarray(codes.T).reshape(-1, BLOCK))


def _inverse_cholesky(gram: np.ndarray) -> np.ndarray:
    """The upper Cholesky factor ``U`` of the inverse of ``gram`` damped (``H^-1 = U^T U``), float32."""
    key = (id(gram), gram.shape)
    if _CHOLESKY.get("key") != key or _CHOLESKY.get("gram") is not gram:
        h = np.array(gram, np.float64)
        dead = np.diag(h) <= 0
        h[dead, dead] = 1.0
        h += DAMPING * np.mean(np.diag(h)) * np.eye(len(h))
        _CHOLESKY.update(key=key, gram=gram, upper=np.linalg.cholesky(np.linalg.inv(h)).T.astype(np.float32))
    return _CHOLESKY["upper"]


_CHOLESKY: dict = {}  # the last gram's factor: a weight is written a slice of rows at a time, each with the same gram


def nearest_scales(blocks: np.ndarray) -> np.ndarray:
    """f16 ``[blocks]``: llama.cpp's and tract's rule, ``d = m / -8`` with ``m`` the block's extreme value (clamped
    to f16's largest finite value where llama.cpp's would overflow to an infinite scale, whose block reads as nan)."""
    extreme = blocks[np.arange(len(blocks)), np.abs(blocks).argmax(axis=1)]
    return _to_f16(extreme / -8.0)


def codes_for(blocks: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """uint8 codes ``[blocks, 32]`` of each value for its block's f16 scale: the nearest code, clamped to 0..15
    (for any scale the error of each value is smallest so, whatever the weights)."""
    wide = scale.astype(np.float32)
    inverse = np.divide(1.0, wide, out=np.zeros_like(wide), where=wide != 0)
    return np.clip(np.floor(blocks * inverse[:, None] + 8.5), 0, 15).astype(np.uint8)


def block_errors(blocks: np.ndarray, scale: np.ndarray, weights: np.ndarray | None = None) -> np.ndarray:
    """float32 ``[blocks]``: each block's squared error once stored with ``scale`` (weighted by ``weights``)."""
    error = blocks - (codes_for(blocks, scale).astype(np.float32) - 8.0) * scale.astype(np.float32)[:, None]
    return np.einsum("ij,ij->i", error, error) if weights is None else np.einsum("ij,ij,ij->i", weights, error, error)


def _block_weights(importance: np.ndarray | None, inner: int, count: int) -> np.ndarray | None:
    if importance is None:
        return None
    importance = np.asarray(importance, np.float32).reshape(-1)
    if importance.shape != (inner,):
        raise ValueError(f"importance has {importance.size} values for an inner axis of {inner}")
    per_row = importance.reshape(-1, BLOCK)
    return np.broadcast_to(per_row[None], (count * BLOCK // inner, *per_row.shape)).reshape(count, BLOCK)


def searched_scales(blocks: np.ndarray, weights: np.ndarray | None = None) -> np.ndarray:
    """f16 ``[blocks]``: the scale of least (weighted) squared error found among candidates, never worse than the
    nearest rule's.

    For each candidate ``d = m / -(8 + step)`` the codes are the nearest ones (clamped), then the scale of least
    error for those codes is ``sum(w x l) / sum(w l^2)`` (``l`` the code minus 8) with error
    ``sum(w x^2) - sum(w x l)^2 / sum(w l^2)``: the candidate of least error wins (llama.cpp's ``make_qx_quants``,
    with a wider range of steps); then, ``REFINEMENTS`` times, the codes nearest for the f16 scale and the scale
    of least error for them. Last, each block keeps the better of that and the nearest rule's scale, so the
    search is never worse than the nearest rule on any block (measured in the same weights)."""
    w = None if weights is None else np.ascontiguousarray(weights, np.float32)
    wx = blocks if w is None else w * blocks
    extreme = blocks[np.arange(len(blocks)), np.abs(blocks).argmax(axis=1)]
    inverse = np.divide(-1.0, extreme, out=np.zeros_like(extreme), where=extreme != 0)
    best_gain = np.full(len(blocks), -1.0, np.float32)
    best = np.zeros(len(blocks), np.float32)
    levels = np.empty_like(blocks)
    for step in STEPS:
        np.multiply(blocks, ((8.0 + step) * inverse)[:, None], out=levels)
        np.clip(np.rint(levels, out=levels), -8, 7, out=levels)
        sum_xl, sum_l2 = _moments(wx, w, levels)
        gain = np.divide(sum_xl * sum_xl, sum_l2, out=np.zeros_like(sum_xl), where=sum_l2 > 0)
        better = (gain > best_gain) & (sum_l2 > 0)  # an all-zero block keeps the scale 0
        best_gain[better] = gain[better]
        best[better] = sum_xl[better] / sum_l2[better]
    scale = _to_f16(best)
    error = block_errors(blocks, scale, w)
    for _ in range(REFINEMENTS):  # the codes nearest for the f16 scale, the scale of least error for those codes
        levels = codes_for(blocks, scale).astype(np.float32) - 8.0
        sum_xl, sum_l2 = _moments(wx, w, levels)
        refined = _to_f16(np.divide(sum_xl, sum_l2, out=scale.astype(np.float32), where=sum_l2 > 0))
        refined_error = block_errors(blocks, refined, w)
        keep = refined_error < error
        scale[keep], error[keep] = refined[keep], refined_error[keep]
    nearest = nearest_scales(blocks)
    return np.where(block_errors(blocks, nearest, w) <= error, nearest, scale)


def _moments(wx: np.ndarray, w: np.ndarray | None, levels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``sum(w x l)`` and ``sum(w l^2)`` of each block (float32: 32 terms)."""
    sum_xl = np.einsum("ij,ij->i", wx, levels)
    sum_l2 = np.einsum("ij,ij->i", levels, levels) if w is None else np.einsum("ij,ij,ij->i", w, levels, levels)
    return sum_xl, sum_l2


def _to_f16(scale: np.ndarray) -> np.ndarray:
    """f16 of float scales, those beyond f16's range clamped to its largest finite value (never an infinity)."""
    limit = float(np.finfo(np.float16).max)
    return np.clip(scale, -limit, limit).astype(np.float16)


def dequantize(blocks: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """uint8 ``[blocks, 18]`` -> float32 of ``shape``: what tract computes with."""
    scale = blocks[:, :2].copy().view(np.float16).astype(np.float32).reshape(-1)
    codes = np.concatenate([blocks[:, 2:] & 15, blocks[:, 2:] >> 4], axis=1).astype(np.float32)
    return ((codes - 8.0) * scale[:, None]).reshape(shape)


def round_trip(x: torch.Tensor, rule: str = "search", importance: np.ndarray | None = None,
               gram: np.ndarray | None = None) -> torch.Tensor:
    """``x`` as tract will see it once stored in Q4_0 by ``rule`` (same dtype as ``x``)."""
    values = x.detach().float().numpy()
    return torch.from_numpy(dequantize(quantize(values, rule, importance, gram), values.shape)).to(x.dtype)


def nbytes(shape: tuple[int, ...]) -> int:
    return int(np.prod(shape, dtype=np.int64)) // BLOCK * BLOCK_BYTES


def write_header(file: BinaryIO, shape: tuple[int, ...]) -> None:
    """The ``.dat`` header tract reads as Q4_0 (torch-to-nnef's own layout for it)."""
    from torch_to_nnef.nnef_io.tensor import DatBinHeader

    file.write(DatBinHeader.build_tract_qtensor(DatBinHeader.TractCustomTypes.Q40, tuple(shape)).to_bytes())


def write_nnef(file: BinaryIO, shape: tuple[int, ...], read_rows: Callable[[int, int], np.ndarray],
               rule: str = "search", importance: np.ndarray | None = None, gram: np.ndarray | None = None,
               slice_bytes: int = 16 << 20) -> None:
    """A Q4_0 ``.dat`` of a tensor of ``shape`` (scales by ``rule``, weighted by ``importance``), read a slice of its
    first axis at a time (``read_rows(start, stop)`` returns those rows as float32): memory stays at a few slices
    (the search's temporaries)."""
    shape = tuple(shape)
    write_header(file, shape)
    row_bytes = max(1, int(np.prod(shape[1:], dtype=np.int64)) * 4)
    step = max(1, slice_bytes // row_bytes)
    for start in range(0, shape[0], step):
        file.write(quantize(read_rows(start, min(shape[0], start + step)), rule, importance, gram).tobytes())


# -- the codec protocol (gdn_export.weights.encoding): what the conversion asks of the Q4_0 format --------------------


def select(chosen: set, candidates: set, reference_is_linear) -> tuple[set, dict]:
    return chosen, {f"with an inner size not a multiple of {BLOCK}": len(candidates - chosen)}


def expert_stacks_kept(shapes: list, fused: bool) -> str | None:
    """Only stacks tract's fused op reads (its Q4_0 path: all three or none), and only when their blocks are blocks
    of their checkpoint sources too (so that the check's reference, the source read through Q4_0, computes with
    what tract does)."""
    if not fused:
        return "expert stacks of a MoE that runs dense (no tract_moe_ffn: see the MoE lines)"
    if not all(quantizable(shape) and (source is None or quantizable(source)) for shape, source in shapes):
        return f"expert stacks with an inner size not a multiple of {BLOCK}"
    return None


class Q4Encoding(Encoding):
    """Q4_0 weights, each with the rule (and calibration) the report holds for its checkpoint name."""

    def __init__(self, labels: frozenset, report) -> None:
        super().__init__(sys.modules[__name__], labels)
        self.report = report

    def write(self, file: BinaryIO, shape: tuple[int, ...], read_rows, label: str, aliases: tuple,
              source: str) -> None:
        write_nnef(file, shape, read_rows, *rule_of(self.report.own, source))

    def round_trip(self, source: str):
        rule, importance, gram = rule_of(self.report.own, source)
        return lambda x: round_trip(x, rule=rule, importance=importance, gram=gram)


def weights_encoding(labels: frozenset, report) -> Q4Encoding:
    return Q4Encoding(labels, report)


def tables_encoding(dtype: str, pick):
    """A float32 export's embedding tables (read by gathers only) in int8, a scale per row: a quarter of their
    bytes (a float16 export keeps them)."""
    from gdn_export.weights.int8 import codec as int8

    return int8.table_encoding(pick(int8), negated=False) if dtype == "float32" else None


def report_fields(q4_rule: str | None = None, calibration=None, **others) -> dict:
    """The report's values of a Q4_0 export (``QuantizationReport.own``): ``rule``, how each block's scale is chosen
    (``RULES``; None: the first); ``calibration``, the calibration that weighted the search, in words ("" for none);
    ``importance`` and ``grams``, checkpoint name -> the weight of each input channel and E[a a^T] (rule "gptq"),
    filled by ``note_calibrated``."""
    rule = q4_rule or RULES[0]
    if rule not in RULES:
        raise GdnExportError(f"Q4_0 rule {rule!r} is not one of {', '.join(RULES)}")
    return {"rule": rule, "calibration": str(calibration or ""), "importance": {}, "grams": {}}


def note_calibrated(own: dict, source: str, calibration, matrix: bool, columns_kept: bool) -> None:
    """Record what ``calibration`` (``gdn_export.hf.calibration.Calibration``) measured of stored weight ``source``:
    its input channels' importance, for a weight whose columns the export keeps as they are (``columns_kept``), and
    with rule "gptq" its input's second moments (a 2-D weight, ``matrix``)."""
    if source in calibration.importance and columns_kept:
        own["importance"][source] = calibration.importance[source]
        if own["rule"] == "gptq" and source in calibration.grams and matrix:
            own["grams"][source] = calibration.grams[source]


def rule_of(own: dict, name: str) -> tuple[str, np.ndarray | None, np.ndarray | None]:
    """(rule, importance, second moments) the weight of checkpoint name ``name`` was stored with: GPTQ needs its
    input's second moments, a weight without them is searched."""
    if name in own["grams"]:
        return "gptq", own["importance"].get(name), own["grams"][name]
    return ("search" if own["rule"] == "gptq" else own["rule"]), own["importance"].get(name), None


def describe(report) -> str:
    own = report.own
    how = f"{own['rule']} scales" if own["rule"] != "gptq" else \
        f"GPTQ for {len(own['grams'])} of them, the others search"
    if own["calibration"]:
        how += f", {own['calibration']}, {len(own['importance'])} of them weighted by input channel"
    return f"; {how}"
