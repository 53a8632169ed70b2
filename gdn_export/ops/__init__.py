"""Torch side of gdn_export: the reference math and the custom ops that carry it through export.

Nothing here is imported with the package: the names below are imported on first use (they import torch), so the
run side and ``gdn-export --help`` can read an op folder's light modules (``gated_delta_rule.policy``,
``.registry``) on the base install. ``register_custom_ops()`` defines every ``t2n_extra`` op in torch;
``gdn_export``'s export-side names (``export``, ``convert``, ``gated_delta_rule``, ...) call it on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

# (the function gated_delta_rule is gdn_export.gated_delta_rule: here the name is its op's folder)
_LAZY = {"GatedDeltaRule": "gdn_export.ops.gated_delta_rule.op", "gated_delta_scan": "gdn_export.ops.gated_delta_rule.scan_op",
         "gated_delta_recurrence": "gdn_export.ops.gated_delta_rule.naive", "l2norm": "gdn_export.ops.gated_delta_rule.naive"}
# the modules that define the t2n_extra custom ops (each defines its op when imported)
CUSTOM_OP_MODULES = ("gdn_export.ops.gated_delta_rule.op", "gdn_export.ops.gated_delta_rule.scan_op",
                     "gdn_export.ops.causal_conv1d.op", "gdn_export.ops.moe_ffn.op")


def register_custom_ops() -> None:
    """Define ``torch.ops.t2n_extra.gated_delta_rule``, ``gated_delta_scan``, ``causal_conv1d_update`` and
    ``moe_ffn`` (once per process; reused where another package defined them with the same signature)."""
    for module in CUSTOM_OP_MODULES:
        importlib.import_module(module)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'gdn_export.ops' has no attribute {name!r}")


__all__ = ["GatedDeltaRule", "gated_delta_recurrence", "gated_delta_scan", "l2norm", "register_custom_ops"]
