"""Comparing tract's outputs with torch's: the tolerance rule and the error it raises."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from gdn_export.errors import ParityError

# max abs error allowed, relative to max(|reference|) (floored at 1 for logits-like outputs elsewhere)
RELATIVE_TOLERANCE = {np.dtype(np.float32): 1e-4, np.dtype(np.float16): 2e-2}


def max_abs_error(actual: np.ndarray, expected: np.ndarray) -> float:
    if actual.shape != expected.shape:
        return float("inf")
    diff = np.abs(actual.astype(np.float64) - expected.astype(np.float64))
    return float(diff.max()) if diff.size else 0.0


def tolerance_for(expected: np.ndarray, relative: float | None = None) -> float:
    if relative is None:
        relative = RELATIVE_TOLERANCE.get(np.dtype(expected.dtype), 1e-4)
    scale = float(np.abs(expected.astype(np.float64)).max()) if expected.size else 0.0
    return relative * max(scale, 1e-6)


@dataclass
class ParityResult:
    errors: dict[str, float]
    tolerances: dict[str, float]

    @property
    def ok(self) -> bool:
        return all(self.errors[n] <= self.tolerances[n] for n in self.errors)

    def raise_if_failed(self) -> None:
        if not self.ok:
            raise ParityError(self.errors, self.tolerances)

    def __str__(self) -> str:
        return "parity: " + ", ".join(
            f"{n} {e:.2e} (<= {self.tolerances[n]:.2e})" for n, e in self.errors.items()
        )


def check_parity(
    names: Sequence[str], expected: Sequence[np.ndarray], actual: Sequence[np.ndarray],
    relative: float | None = None,
) -> ParityResult:
    """Max abs error of every output; an output whose shape differs counts as an infinite error."""
    if len(actual) != len(expected):
        raise ParityError({"output count": float(len(actual))}, {"output count": float(len(expected))})
    errors, tolerances = {}, {}
    for name, exp, act in zip(names, expected, actual):
        exp = np.asarray(exp)
        errors[name] = max_abs_error(np.asarray(act), exp)
        tolerances[name] = tolerance_for(exp, relative)
    return ParityResult(errors, tolerances)
