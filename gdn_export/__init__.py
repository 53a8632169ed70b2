"""gdn_export: gated delta-rule models from PyTorch to NNEF for tract, exact and fast.

Importing the package registers ``torch.ops.t2n_extra.gated_delta_scan`` (and ``gated_delta_rule``,
``causal_conv1d_update``); everything else (torch-to-nnef and its handlers, tract, transformers) is imported
on first use of the name that needs it, so ``gdn-export --help`` and ``import gdn_export`` stay fast.
``gdn_export.export`` registers gdn_export's torch-to-nnef handlers; call ``import gdn_export.extractors``
to register them for your own ``torch_to_nnef.export_model_to_nnef`` call.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

from gdn_export.errors import GdnExportError, LoweringError, OperandError, ParityError, TractRuntimeError
from gdn_export.ops import GatedDeltaRule, gated_delta_recurrence, gated_delta_rule, gated_delta_scan, l2norm

__version__ = "0.1.0"

_LAZY = {
    "ExportReport": "gdn_export.exporter", "export": "gdn_export.exporter",
    "CheckpointError": "gdn_export.hf.checkpoint",
    "ConvertReport": "gdn_export.hf.convert", "check": "gdn_export.hf.convert", "convert": "gdn_export.hf.convert",
    "run_tract": "gdn_export.runtime", "Session": "gdn_export.session",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if importlib.util.find_spec(f"gdn_export.{name}") is not None:  # a submodule, e.g. gdn_export.runtime
        return importlib.import_module(f"gdn_export.{name}")
    raise AttributeError(f"module 'gdn_export' has no attribute {name!r}")


__all__ = [
    "CheckpointError", "ConvertReport", "ExportReport", "GatedDeltaRule", "GdnExportError", "LoweringError",
    "OperandError", "ParityError", "Session", "TractRuntimeError", "check", "convert", "export",
    "gated_delta_recurrence", "gated_delta_rule", "gated_delta_scan", "l2norm", "run_tract",
]
