"""The lowerings of a gated delta-rule node, by name: the emitter knows them through this table only.

A lowering is one module of ``gdn_export.ops.gated_delta_rule.nnef`` with

    NAME: str                                    what ``lowering=`` requests and the report prints
    refusal(node, dims, options) -> str | None   why it cannot compute exactly this node (None: it can)
    lower(builder, node, dims, options) -> list  writes the node's NNEF; returns the fragments/extensions used

and, where the defaults do not fit,

    LABEL: str = NAME                            how a reason names it when it is refused ("fused op refused: ...")
    ALWAYS_EXACT: bool = False                   ``refusal`` never refuses: a request then reads
                                                 "requested (lowering='scan')", without "and exact"
    note(node, dims, options) -> str = ""        what the reason adds when it is chosen ("; chunks of 64 tokens, ...")

``node`` is a ``node.GdnNode``, ``dims`` its ``ops.operands.Dims``, ``options`` the export's
``options.GatedDeltaRuleOptions``, ``builder`` an ``nnef_builder.NnefBuilder``. To add a lowering: write its module,
add its NAME and module to ``REGISTERED``, and, for ``lowering="auto"`` to pick it, place it in ``policy.ORDER``.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Callable

# NAME -> module of this package, in the order LOWERINGS lists them (the CLI's choices, error messages);
# the names are spelled here so that LOWERINGS needs no import (``gdn-export --help`` imports no torch)
REGISTERED = {"native": "fused", "scan": "scan", "recurrent": "recurrent", "chunked": "chunked"}


def _nothing_to_note(node, dims, options) -> str:
    return ""


@dataclass(frozen=True)
class Lowering:
    """One registered lowering: its module's names, the optional ones given their defaults."""

    name: str
    label: str
    always_exact: bool
    refusal: Callable[..., "str | None"]
    note: Callable[..., str]
    lower: Callable[..., list]
    module: ModuleType

    @classmethod
    def of(cls, module: ModuleType) -> Lowering:
        missing = [name for name in ("NAME", "refusal", "lower") if not hasattr(module, name)]
        if missing:
            raise TypeError(f"{module.__name__} is registered as a lowering but has no {', '.join(missing)}")
        return cls(module.NAME, getattr(module, "LABEL", module.NAME), getattr(module, "ALWAYS_EXACT", False),
                   module.refusal, getattr(module, "note", _nothing_to_note), module.lower, module)


LOWERINGS = ("auto", *REGISTERED)


@functools.cache
def get(name: str) -> Lowering:
    """The lowering registered under ``name`` (its module imported on first use)."""
    lowering = Lowering.of(importlib.import_module(f"{__package__}.{REGISTERED[name]}"))
    if lowering.name != name:
        raise TypeError(f"{lowering.module.__name__} is registered as {name!r} but its NAME is {lowering.name!r}")
    return lowering


def registry() -> dict[str, Lowering]:
    """Every registered lowering, by name."""
    return {name: get(name) for name in REGISTERED}
