"""The custom operators, one folder each (gated_delta_rule/, causal_conv1d/, moe_ffn/): schema and torch
registration, naive reference, decisions and one lowering module per back-end. protocol.py and options.py are what
they share (the Decision record, the export's plan); nnef_handlers.py lists the ops an NNEF export registers.
``gdn_export.gated_delta_rule`` & co. are the public names (docs/ARCHITECTURE.md). ``register_custom_ops()``
defines every ``t2n_extra`` op in torch; ``gdn_export``'s export-side names call it on first use. Nothing here imports
torch with the package: the run side and ``gdn-export --help`` read an op folder's light modules (``policy``,
``registry``) on the base install."""

from __future__ import annotations

import importlib

# the modules that define the t2n_extra custom ops (each defines its op when imported)
CUSTOM_OP_MODULES = ("gdn_export.ops.gated_delta_rule.op", "gdn_export.ops.gated_delta_rule.scan_op",
                     "gdn_export.ops.causal_conv1d.op", "gdn_export.ops.moe_ffn.op")


def register_custom_ops() -> None:
    """Define ``torch.ops.t2n_extra.gated_delta_rule``, ``gated_delta_scan``, ``causal_conv1d_update`` and
    ``moe_ffn`` (once per process; reused where another package defined them with the same signature)."""
    for module in CUSTOM_OP_MODULES:
        importlib.import_module(module)
