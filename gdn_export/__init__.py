"""gdn_export: gated delta-rule models from PyTorch to NNEF for tract, exact and fast.

Importing the package registers ``torch.ops.t2n_extra.gated_delta_scan`` (and ``gated_delta_rule``,
``causal_conv1d_update``); everything else (torch-to-nnef and its handlers, tract, transformers) is imported
on first use of the name that needs it, so ``gdn-export --help`` and ``import gdn_export`` stay fast.
``gdn_export.export`` registers gdn_export's torch-to-nnef handlers for its duration; wrap your own
``torch_to_nnef.export_model_to_nnef`` call in ``gdn_export.backends.compat.torch_to_nnef.conversion(CUSTOM_OPS)``
(docs/ARCHITECTURE.md) to export them yourself.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

from gdn_export.errors import GdnExportError, LoweringError, OperandError, ParityError, TractRuntimeError
from gdn_export.ops.gated_delta_rule.naive import gated_delta_recurrence, l2norm
from gdn_export.ops.gated_delta_rule.op import GatedDeltaRule, gated_delta_rule
from gdn_export.ops.gated_delta_rule.scan_op import gated_delta_scan

__version__ = "0.1.0"


_LAZY = {
    "ExportReport": "gdn_export.pipeline.export", "export": "gdn_export.pipeline.export",
    "CheckpointError": "gdn_export.hf.checkpoint",
    "ConvertReport": "gdn_export.pipeline.convert", "check": "gdn_export.pipeline.convert", "convert": "gdn_export.pipeline.convert",
    "run_tract": "gdn_export.run.runtime", "Session": "gdn_export.run.session",
    "generate": "gdn_export.run.generation", "SamplingParams": "gdn_export.run.generation", "Engine": "gdn_export.run.serving",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if importlib.util.find_spec(f"gdn_export.{name}") is not None:  # a submodule, e.g. gdn_export.run.runtime
        return importlib.import_module(f"gdn_export.{name}")
    raise AttributeError(f"module 'gdn_export' has no attribute {name!r}")


__all__ = [
    "CheckpointError", "ConvertReport", "Engine", "ExportReport", "GatedDeltaRule", "GdnExportError", "LoweringError",
    "OperandError", "ParityError", "SamplingParams", "Session", "TractRuntimeError", "check", "convert", "export",
    "gated_delta_recurrence", "gated_delta_rule", "gated_delta_scan", "generate", "l2norm", "run_tract",
]
