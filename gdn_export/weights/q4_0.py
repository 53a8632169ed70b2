"""tract's Q4_0 weights: blocks of 32 values, one float16 scale and 32 four-bit codes each.

The math (tract's own rounding, and llama.cpp's Q4_0): in each block of 32 consecutive values along the inner
axis, ``m`` is the value of largest magnitude, sign kept; the scale is ``d = m / -8`` and each value ``x`` is
stored as the code ``q = clamp(floor(x / d + 8.5), 0, 15)``, read back as ``(q - 8) * d``. ``m`` itself maps to
code 0 (exactly ``-8 d``), so the extreme value of each block is kept exactly, where the |max| / 7 rule loses it
(measured on the issue's weights: 6.5% against 7.2% relative L2 error).

A block is 18 bytes: the scale (f16), then 16 bytes whose byte ``i`` holds code ``i`` in its low nibble and code
``16 + i`` in its high nibble (tract 0.21.11 and later). tract reads a ``.dat`` with this item type as a
block-quantized constant: a matmul over it runs its Q4_0 kernel, any other use dequantizes it. ``write_nnef``
streams a tensor row by row; ``dequantize`` is the reference the check compares the export with.
"""

from __future__ import annotations

from typing import BinaryIO, Callable

import numpy as np
import torch

BLOCK = 32
BLOCK_BYTES = 18
NAME = "q4_0"


def quantizable(shape: tuple[int, ...]) -> bool:
    """A matrix (rank 2 or more) whose inner axis is whole blocks."""
    return len(shape) >= 2 and shape[-1] % BLOCK == 0 and shape[-1] > 0


def quantize(x: np.ndarray) -> np.ndarray:
    """``x`` (float, inner axis a multiple of 32) -> uint8 ``[blocks, 18]``."""
    blocks = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, BLOCK)
    extreme = blocks[np.arange(len(blocks)), np.abs(blocks).argmax(axis=1)]
    scale = (extreme / -8.0).astype(np.float16)
    wide = scale.astype(np.float32)
    inverse = np.divide(1.0, wide, out=np.zeros_like(wide), where=wide != 0)
    codes = np.clip(np.floor(blocks * inverse[:, None] + 8.5), 0, 15).astype(np.uint8)
    out = np.empty((len(blocks), BLOCK_BYTES), np.uint8)
    out[:, :2] = scale.view(np.uint8).reshape(-1, 2)
    out[:, 2:] = codes[:, :16] | (codes[:, 16:] << 4)
    return out


def dequantize(blocks: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """uint8 ``[blocks, 18]`` -> float32 of ``shape``: what tract computes with."""
    scale = blocks[:, :2].copy().view(np.float16).astype(np.float32).reshape(-1)
    codes = np.concatenate([blocks[:, 2:] & 15, blocks[:, 2:] >> 4], axis=1).astype(np.float32)
    return ((codes - 8.0) * scale[:, None]).reshape(shape)


def round_trip(x: torch.Tensor) -> torch.Tensor:
    """``x`` as tract will see it once stored in Q4_0 (same dtype as ``x``)."""
    values = x.detach().float().numpy()
    return torch.from_numpy(dequantize(quantize(values), values.shape)).to(x.dtype)


def nbytes(shape: tuple[int, ...]) -> int:
    return int(np.prod(shape, dtype=np.int64)) // BLOCK * BLOCK_BYTES


def write_header(file: BinaryIO, shape: tuple[int, ...]) -> None:
    """The ``.dat`` header tract reads as Q4_0 (torch-to-nnef's own layout for it)."""
    from torch_to_nnef.nnef_io.tensor import DatBinHeader

    file.write(DatBinHeader.build_tract_qtensor(DatBinHeader.TractCustomTypes.Q40, tuple(shape)).to_bytes())


def write_nnef(file: BinaryIO, shape: tuple[int, ...], read_rows: Callable[[int, int], np.ndarray],
               slice_bytes: int = 64 << 20) -> None:
    """A Q4_0 ``.dat`` of a tensor of ``shape``, read a slice of its first axis at a time (``read_rows(start, stop)``
    returns those rows as float32): memory stays at one slice."""
    shape = tuple(shape)
    write_header(file, shape)
    row_bytes = max(1, int(np.prod(shape[1:], dtype=np.int64)) * 4)
    step = max(1, slice_bytes // row_bytes)
    for start in range(0, shape[0], step):
        file.write(quantize(read_rows(start, min(shape[0], start + step))).tobytes())
