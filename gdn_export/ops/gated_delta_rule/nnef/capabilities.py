"""What tract's fused ``tract_transformers_gdn_recurrent`` accepts, per tract version.

Measured with one hand-written graph per case against a numpy reference (``docs/TRACT.md``).
Anything a row does not allow, the fused lowering refuses (``fused.refusal``): ``lowering="auto"`` then takes
the next exact lowering of the runtime's order (policy.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class FusedCapability:
    """One row of the table: the cases a range of tract versions runs exactly."""

    first_version: tuple[int, int, int]
    any_sequence_length: bool  # S > 1 and a symbolic S; otherwise S must be exactly 1
    grouped_heads: bool  # Hk < H (the op repeat_interleaves q/k itself)
    any_width: bool  # any K = V; otherwise K = V = 128 only
    operand_dtypes: frozenset  # dtypes of query, key, value, beta (one dtype for all four)
    state_dtypes: frozenset

    def describe(self) -> str:
        def names(dtypes: frozenset) -> str:
            return "/".join(sorted(np.dtype(d).name for d in dtypes))

        return (
            f"S {'any (symbolic too)' if self.any_sequence_length else '= 1'}, "
            f"{'grouped heads' if self.grouped_heads else 'Hk = H'}, "
            f"{'K = V any width' if self.any_width else 'K = V = 128'}, "
            f"{names(self.operand_dtypes)} operands, {names(self.state_dtypes)} state"
        )


F16, F32 = np.dtype(np.float16), np.dtype(np.float32)

# Newest first. Versions before the last row's first_version have no fused operator.
FUSED_TABLE: tuple[FusedCapability, ...] = (
    FusedCapability((0, 23, 7), True, True, True, frozenset({F16, F32}), frozenset({F16, F32})),
    FusedCapability((0, 23, 5), False, False, False, frozenset({F16}), frozenset({F32})),
)

# Measured up to 0.23.9; newer versions are assumed to keep 0.23.9's behaviour.
NEWEST_MEASURED = (0, 23, 9)


def check_target_version(version: tuple[int, int, int], installed: tuple[int, int, int] | None) -> None:
    """A target tract newer than both the newest version measured and the installed one is refused (ValueError):
    what it accepts is unknown, and no check could run the archive (``--tract-version 9.9.9``)."""
    known = max(NEWEST_MEASURED, installed or NEWEST_MEASURED)
    if version > known:
        raise ValueError(f"tract {'.'.join(map(str, version))} is newer than any version gdn_export knows "
                         f"(measured up to {'.'.join(map(str, NEWEST_MEASURED))}, installed "
                         f"{'.'.join(map(str, installed)) if installed else 'none'})")


def fused_capability(version: tuple[int, int, int]) -> FusedCapability | None:
    """The row for ``version``, or None when that tract has no fused operator."""
    for row in FUSED_TABLE:
        if version >= row.first_version:
            return row
    return None
