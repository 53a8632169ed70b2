"""The toy format's tensors: bfloat16-rounded values in a float32 ``.dat`` (the codec protocol's required four)."""

from __future__ import annotations

import numpy as np
import torch

from gdn_export.hf.tensors import write_nnef_rows


def quantizable(shape: tuple[int, ...]) -> bool:
    return len(shape) == 2


def nbytes(shape: tuple[int, ...]) -> int:
    return 4 * int(np.prod(shape, dtype=np.int64))


def round_trip(x: torch.Tensor) -> torch.Tensor:
    return x.detach().to(torch.bfloat16).to(x.dtype)


def write_nnef(file, shape: tuple[int, ...], read_rows) -> None:
    rounded = lambda a, b: round_trip(torch.from_numpy(np.asarray(read_rows(a, b), np.float32))).numpy()  # noqa: E731
    write_nnef_rows(file, shape, np.dtype(np.float32), rounded)
