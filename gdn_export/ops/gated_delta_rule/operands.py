"""The operands of one delta-rule node and their validation: the torch ops (``gdn_export.ops``) check their
arguments with it, and the lowerings (``gdn_export.ops.gated_delta_rule.nnef``) read the sizes it returns (``Dims``)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

OPERANDS = ("q", "k", "v", "g", "beta", "erase", "write", "s0")
REQUIRED = ("q", "k", "v", "s0")
FLOAT_DTYPES = {np.dtype(np.float16), np.dtype(np.float32)}


@dataclass(frozen=True)
class Dims:
    """The sizes every operand must agree on."""

    batch: int
    seq: int  # tokens (q's time axis); k, v and beta carry seq * num_householder steps
    key_heads: int
    heads: int
    width_k: int
    width_v: int
    num_householder: int = 1
    channel_decay: bool = False  # g is [.., K] (KDA, GDN2) rather than one scalar per head
    has_decay: bool = True  # False for DeltaNet (no g)
    gated_writes: bool = False  # erase/write gates (GDN2) instead of beta

    @property
    def groups(self) -> int:
        return self.heads // self.key_heads

    @property
    def is_plain_gdn(self) -> bool:
        """Scalar decay, beta, one step per token: the only variant tract's fused operator computes."""
        return self.has_decay and not self.channel_decay and not self.gated_writes and self.num_householder == 1


def _layout(head_major: bool) -> dict[str, str]:
    t, tn = "T", "T*n"
    if head_major:
        return {"q": f"[B, Hk, {t}, K]", "k": f"[B, Hk, {tn}, K]", "v": f"[B, H, {tn}, V]",
                "g": f"[B, H, {t}] or [B, H, {t}, K]", "beta": f"[B, H, {tn}]", "erase": f"[B, H, {t}, K]",
                "write": f"[B, H, {t}, V]", "s0": "[B, H, K, V]"}
    return {"q": f"[B, {t}, Hk, K]", "k": f"[B, {tn}, Hk, K]", "v": f"[B, {tn}, H, V]",
            "g": f"[B, {t}, H] or [B, {t}, H, K]", "beta": f"[B, {tn}, H]", "erase": f"[B, {t}, H, K]",
            "write": f"[B, {t}, H, V]", "s0": "[B, H, K, V]"}


def _static(shape: Sequence[int]) -> tuple[int, ...]:
    """Sizes as ints; reading them while traced is fine here (only widths and counts are compared)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Converting a tensor to a Python")
        return tuple(int(d) for d in shape)


def validate_operands(
    shapes: Mapping[str, Sequence[int] | None],
    dtypes: Mapping[str, Any] | None = None,
    *,
    head_major: bool,
    num_householder: int = 1,
) -> Dims:
    """Check ranks, sizes and dtypes of a node's operands; return the sizes they agree on.

    ``shapes`` maps q, k, v, s0 and any of g, beta, erase, write to a shape (absent or None: not given).
    Raises OperandError naming the first operand that disagrees, with the expected and actual value.
    """
    from gdn_export.errors import OperandError

    layout = _layout(head_major)
    given = {name: _static(shape) for name, shape in shapes.items() if shape is not None and name in OPERANDS}
    n = int(num_householder)
    if n < 1:
        raise OperandError("num_householder", "an integer >= 1", str(num_householder))
    if "beta" in given and ("erase" in given or "write" in given):
        raise OperandError("erase" if "erase" in given else "write", "no erase/write gate when beta is given "
                           "(beta is the GDN gate, erase/write the GDN2 gates)", "both")
    if "beta" not in given and ("erase" in given) != ("write" in given):
        missing = "write" if "erase" in given else "erase"
        raise OperandError(missing, "erase and write given together", "only one of them")
    if "beta" not in given and "erase" not in given:
        raise OperandError("beta", "beta, or erase and write gates", "none of them")
    if "erase" in given and n != 1:
        raise OperandError("num_householder", "1 with erase/write gates", str(n))

    ranks = {"q": 4, "k": 4, "v": 4, "beta": 3, "erase": 4, "write": 4, "s0": 4}
    for name in REQUIRED:
        if name not in given:
            raise OperandError(name, layout[name], "nothing")
    for name, shape in given.items():
        expected_ranks = (3, 4) if name == "g" else (ranks[name],)
        if len(shape) not in expected_ranks:
            raise OperandError(name, f"rank {' or '.join(map(str, expected_ranks))} {layout[name]}",
                               f"rank {len(shape)} {list(shape)}")
    seq_axis, head_axis = (2, 1) if head_major else (1, 2)
    q = given["q"]
    dims = Dims(batch=q[0], seq=q[seq_axis], key_heads=q[head_axis], heads=given["v"][head_axis], width_k=q[3],
                width_v=given["v"][3], num_householder=n, channel_decay=len(given.get("g", ())) == 4,
                has_decay="g" in given, gated_writes="erase" in given)

    def expect(name: str, axis: int, want: int, what: str) -> None:
        if name in given and given[name][axis] != want:
            raise OperandError(name, f"{what}={want} on axis {axis} of {layout[name]}",
                               f"{given[name][axis]} in {list(given[name])}")

    steps = dims.seq * n
    expect("k", 0, dims.batch, "B")
    expect("k", seq_axis, steps, "T*n" if n > 1 else "T")
    expect("k", head_axis, dims.key_heads, "Hk")
    expect("k", 3, dims.width_k, "K")
    if dims.key_heads < 1 or dims.heads % dims.key_heads != 0:
        raise OperandError("v", f"a head count H that is a multiple of q/k's Hk={dims.key_heads}", f"H={dims.heads}")
    for name in ("v", "g", "beta", "erase", "write", "s0"):
        expect(name, 0, dims.batch, "B")
    for name, length in (("v", steps), ("beta", steps), ("g", dims.seq), ("erase", dims.seq), ("write", dims.seq)):
        expect(name, seq_axis, length, "T*n" if length != dims.seq else "T")
    for name in ("g", "beta", "erase", "write"):
        expect(name, head_axis, dims.heads, "H")
    expect("g", 3, dims.width_k, "K") if dims.channel_decay else None
    expect("erase", 3, dims.width_k, "K")
    expect("write", 3, dims.width_v, "V")
    expect("s0", 1, dims.heads, "H")
    expect("s0", 2, dims.width_k, "K")
    expect("s0", 3, dims.width_v, "V")
    if dtypes is not None:
        for name in given:
            dtype = np.dtype(dtypes[name])
            if dtype not in FLOAT_DTYPES:
                raise OperandError(name, "dtype float16 or float32", f"{dtype.name}")
    return dims
