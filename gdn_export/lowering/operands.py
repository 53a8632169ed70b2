"""The operands of one gated delta-rule node and their validation, shared by the torch ops and the emitter."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

OPERANDS = ("q", "k", "v", "g", "beta", "s0")
FLOAT_DTYPES = {np.dtype(np.float16), np.dtype(np.float32)}


@dataclass(frozen=True)
class Dims:
    """The sizes every operand must agree on."""

    batch: int
    seq: int
    key_heads: int
    heads: int
    width_k: int
    width_v: int

    @property
    def groups(self) -> int:
        return self.heads // self.key_heads


def _layout_names(head_major: bool) -> dict[str, str]:
    if head_major:
        return {"q": "[B, Hk, T, K]", "k": "[B, Hk, T, K]", "v": "[B, H, T, V]", "g": "[B, H, T]",
                "beta": "[B, H, T]", "s0": "[B, H, K, V]"}
    return {"q": "[B, T, Hk, K]", "k": "[B, T, Hk, K]", "v": "[B, T, H, V]", "g": "[B, T, H]",
            "beta": "[B, T, H]", "s0": "[B, H, K, V]"}


def _static(shape: Sequence[int]) -> tuple[int, ...]:
    """Sizes as ints; reading them while traced is fine here (only widths and counts are compared)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Converting a tensor to a Python")
        return tuple(int(d) for d in shape)


def validate_operands(
    shapes: Mapping[str, Sequence[int]],
    dtypes: Mapping[str, Any] | None = None,
    *,
    head_major: bool,
) -> Dims:
    """Check ranks, sizes and dtypes of the six operands; return the sizes they agree on.

    Raises OperandError naming the first operand that disagrees, with the expected and actual value.
    """
    from gdn_export.errors import OperandError

    layout = _layout_names(head_major)
    ranks = {"q": 4, "k": 4, "v": 4, "g": 3, "beta": 3, "s0": 4}
    shapes = {name: _static(shapes[name]) for name in OPERANDS}
    for name in OPERANDS:
        if len(shapes[name]) != ranks[name]:
            raise OperandError(name, f"rank {ranks[name]} {layout[name]}", f"rank {len(shapes[name])} {list(shapes[name])}")
    seq_axis, head_axis = (2, 1) if head_major else (1, 2)
    q = shapes["q"]
    dims = Dims(
        batch=q[0], seq=q[seq_axis], key_heads=q[head_axis], heads=shapes["v"][head_axis],
        width_k=q[3], width_v=shapes["v"][3],
    )
    if shapes["k"] != q:
        raise OperandError("k", f"the shape of q {list(q)} {layout['k']}", str(list(shapes["k"])))
    if dims.key_heads < 1 or dims.heads % dims.key_heads != 0:
        raise OperandError("v", f"a head count H that is a multiple of q/k's Hk={dims.key_heads}", f"H={dims.heads}")

    def expect(name: str, axis: int, want: int, what: str) -> None:
        got = shapes[name][axis]
        if got != want:
            raise OperandError(name, f"{what}={want} on axis {axis} of {layout[name]}", f"{got} in {list(shapes[name])}")

    for name in ("v", "g", "beta", "s0"):
        expect(name, 0, dims.batch, "B")
    for name in ("v", "g", "beta"):
        expect(name, seq_axis, dims.seq, "T")
    for name in ("g", "beta"):
        expect(name, head_axis, dims.heads, "H")
    expect("s0", 1, dims.heads, "H")
    expect("s0", 2, dims.width_k, "K")
    expect("s0", 3, dims.width_v, "V")
    if dtypes is not None:
        for name in OPERANDS:
            dtype = np.dtype(dtypes[name])
            if dtype not in FLOAT_DTYPES:
                raise OperandError(name, "dtype float16 or float32", f"{dtype.name}")
    return dims
