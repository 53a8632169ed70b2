"""What both chunk bodies are written with: NNEF lines with fresh names, the triangular solve, the output.

``(I + A)^-1`` is never the nilpotent product (it explodes with correlated keys): block forward substitution
over blocks of ``SOLVE_BLOCK`` sub-steps, each diagonal block inverted by block doubling. With beta near 2
and nearly parallel keys (cond(I + A) ~ 2e3), numpy f32 against the float64 oracle (16 seeds): worst error
5e-5 of max|ref| (blocks of 16 or 32), 1.1e-4 with doubling over the whole chunk, 1.1e-4 when T is formed
and then applied.
"""

from __future__ import annotations

import numpy as np

from gdn_export.ops.gated_delta_rule.nnef.chunking import SOLVE_BLOCK  # noqa: F401
MASKED = -1e30  # added to masked log-decay differences: exp gives exactly 0 for any finite difference


class Body:
    """NNEF lines of a scan body, one assignment per line, with fresh names."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.count = 0

    def __call__(self, expression: str, name: str | None = None) -> str:
        if name is None:
            name, self.count = f"x{self.count}", self.count + 1
        self.lines.append(f"    {name} = {expression};")
        return name

    def times(self, x: str, *factors: str | None) -> str:
        for factor in factors:
            if factor is not None:
                x = self(f"{x} * {factor}")
        return x


def mask(value: np.ndarray, rank: int) -> np.ndarray:
    """``value`` as f32 with leading size-1 axes up to ``rank``, to broadcast against the body's tensors."""
    return np.asarray(value, np.float32).reshape((1,) * (rank - value.ndim) + value.shape)


def solve_block(chunk: int) -> int:
    """Sub-steps per forward-substitution block for a chunk of ``chunk`` sub-steps: SOLVE_BLOCK, or the whole
    chunk where it is shorter (the short-sequence tail's chunks)."""
    return min(SOLVE_BLOCK, chunk)


def solve_masks(chunk: int, token_axis: int) -> dict[str, np.ndarray]:
    """The constants ``solve_unit_lower`` reads (``[.., n, s, s]`` blocks, or ``[.., s, s]`` where the chunk is
    one block; ``token_axis`` axes before the blocks): the identity and, per doubling level h, the h x h blocks
    below the diagonal joined at that level."""
    s = solve_block(chunk)
    rank = token_axis + (2 if s == chunk else 3)
    index = np.arange(s)
    found = {"identity": mask(np.eye(s), rank)}
    h = 1
    while h < s:
        found[f"join{h}"] = mask((index[:, None] // (2 * h) == index[None, :] // (2 * h))
                                 & (index[:, None] // h % 2 == 1) & (index[None, :] // h % 2 == 0), rank)
        h *= 2
    return found


def solve_unit_lower(x: Body, a: str, rhs: str, chunk: int, t: int) -> str:
    """``(I + strictly_lower(A))^-1 rhs`` for ``A [.., C, C]`` (C on axis ``t``), ``rhs [.., C, F]``: block forward
    substitution, ``X_r = T_r (rhs_r - A[r, :r] X_{:r})`` with ``T_r`` the inverse of diagonal block r.
    Solving against rhs (not forming T, then T rhs) measured 3-5x more accurate in f32 with correlated keys.

    Blocks are cut from reshaped views ``[.., n, s, ...]`` (a slice and a concat on a block axis): tract
    0.23.9 pushes slices of the token axis itself up into the matmuls that made it (splitting k S into
    four matmuls that each pack the state) and splits matmuls that read a concat into per-block pieces.

    A chunk of one block (the short-sequence tail's) is solved as ``T rhs`` without block views: the same
    products, and no size-1 block axes for tract's optimizer to try removing from the scan body at every load."""
    s = solve_block(chunk)
    n = chunk // s
    if n == 1:
        return x(f"matmul({diagonal_inverses(x, s, a)}, {rhs})")
    grid = x(f"reshape({a}, shape = [{n}, {s}, {n}, {s}], axis_start = {t}, axis_count = 2)")  # [.., n, s, n, s]
    parts = x(f"reshape({rhs}, shape = [{n}, {s}], axis_start = {t}, axis_count = 1)")  # [.., n, s, F]

    def block(r: int, columns: int, first: int = 0) -> str:
        """A's block row r, block columns [first, first + columns), as ``[.., 1, s, columns * s]``."""
        cut = x(f"slice({grid}, axes = [{t}, {t + 2}], begin = [{r}, {first}], end = [{r + 1}, {first + columns}])")
        return x(f"reshape({cut}, shape = [{columns * s}], axis_start = {t + 2}, axis_count = 2)")

    inverse = diagonal_inverses(x, s, x(f"concat([{', '.join(block(r, 1, r) for r in range(n))}], axis = {t})"))
    inverse = x(f"reshape({inverse}, shape = [{n * s}], axis_start = {t}, axis_count = 2)")  # [.., n*s, s]
    rows: list[str] = []
    for r in range(n):
        part = x(f"slice({parts}, axes = [{t}], begin = [{r}], end = [{r + 1}])")  # [.., 1, s, F]
        if rows:
            done = x(f"reshape(concat([{', '.join(rows)}], axis = {t}), shape = [1, {r * s}], axis_start = {t}, "
                     f"axis_count = 2)") if r > 1 else rows[0]
            part = x(f"{part} - matmul({block(r, r)}, {done})")
        inverse_r = x(f"reshape(slice({inverse}, axes = [{t}], begin = [{r * s}], end = [{(r + 1) * s}]), shape = [1, {s}], "
                      f"axis_start = {t}, axis_count = 1)")  # [.., 1, s, s]
        rows.append(x(f"matmul({inverse_r}, {part})"))
    return x(f"reshape(concat([{', '.join(rows)}], axis = {t}), shape = [{chunk}], axis_start = {t}, axis_count = 2)")


def diagonal_inverses(x: Body, size: int, blocks: str) -> str:
    """``(I + strictly_lower(A_rr))^-1`` of every diagonal block: ``T_1 = I``, ``T_2h = T_h - T_h (A * M_h) T_h``
    with ``M_h`` the lower off-diagonal h x h blocks joined at this level: exact, log2(s) levels."""
    inverse = x(f"identity - {blocks} * join1")
    h = 2
    while h < size:
        inverse = x(f"{inverse} - matmul(matmul({inverse}, {blocks} * join{h}), {inverse})")
        h *= 2
    return inverse


def write_y(x: Body, y: str, head_major: bool, grouped: bool, heads: int) -> None:
    """The expression ``y`` (``[B, H, C, V]``, or ``[B, Hk, G, C, V]`` with grouped heads) into the body's output
    ``y_t`` in the node's layout: head-major ``[B, H, C, V]`` as it is, seq-major ``[B, C, H, V]``."""
    if head_major:
        x(f"reshape({x(y)}, shape = [{heads}], axis_start = 1, axis_count = 2)" if grouped else y, "y_t")
    elif grouped:  # [B, C, Hk, G, V] -> [B, C, H, V]
        moved = x(f"transpose({x(y)}, axes = [0, 3, 1, 2, 4])")
        x(f"reshape({moved}, shape = [{heads}], axis_start = 2, axis_count = 2)", "y_t")
    else:
        x(f"transpose({x(y)}, axes = [0, 2, 1, 3])", "y_t")
