"""gdn_export: gated delta-rule models from PyTorch to NNEF for tract, exact and fast.

``import gdn_export`` imports no torch: every name is imported on its first use, so the run side (``Session``,
``Engine``, ``generate``, ``gdn-export info/generate/serve``) works on the base install (numpy, tract) and
``gdn-export --help`` stays fast. The export side needs the ``[convert]`` extra (torch, torch-to-nnef,
transformers, onnx); its names (``export``, ``convert``, ``check``, ``gated_delta_rule``, ``GatedDeltaRule``,
``gated_delta_scan``, ...) define the ``t2n_extra`` custom ops in torch on first use (``torch.ops.t2n_extra.
gated_delta_scan``, ``gated_delta_rule``, ``causal_conv1d_update``, ``moe_ffn``; or call
``gdn_export.ops.register_custom_ops()``); when torch is already imported, ``import gdn_export`` defines them at
once. ``gdn_export.export`` registers gdn_export's torch-to-nnef handlers for its duration; wrap your own ``torch_to_nnef.export_model_to_nnef`` call in
``gdn_export.backends.compat.torch_to_nnef.conversion(CUSTOM_OPS)`` (docs/ARCHITECTURE.md) to export them yourself.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from typing import Any

from gdn_export.errors import (GdnExportError, LoweringError, MissingExtraError, OperandError, ParityError,
                               TractRuntimeError, missing_extra)

__version__ = "0.1.0"


_LAZY = {  # name -> the module that defines it, imported on first use (the export side's import torch)
    "GatedDeltaRule": "gdn_export.ops.gated_delta_rule.op", "gated_delta_rule": "gdn_export.ops.gated_delta_rule.op",
    "gated_delta_scan": "gdn_export.ops.gated_delta_rule.scan_op",
    "gated_delta_recurrence": "gdn_export.ops.gated_delta_rule.naive", "l2norm": "gdn_export.ops.gated_delta_rule.naive",
    "ExportReport": "gdn_export.pipeline.export", "export": "gdn_export.pipeline.export",
    "CheckpointError": "gdn_export.hf.checkpoint",
    "ConvertReport": "gdn_export.pipeline.convert", "check": "gdn_export.pipeline.convert", "convert": "gdn_export.pipeline.convert",
    "run_tract": "gdn_export.run.runtime", "Session": "gdn_export.run.session",
    "generate": "gdn_export.run.generation", "SamplingParams": "gdn_export.run.generation",
    "SpeculativeConfig": "gdn_export.run.generation", "Engine": "gdn_export.run.serving",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        try:
            if not _LAZY[name].startswith("gdn_export.run."):  # the export side: its custom ops first
                importlib.import_module("gdn_export.ops").register_custom_ops()
            module = importlib.import_module(_LAZY[name])
        except ModuleNotFoundError as err:  # gdn_export.convert without the [convert] extra: say what to install
            missing = missing_extra(err, f"gdn_export.{name}")
            if missing is None:
                raise
            raise missing from None
        return getattr(module, name)
    if importlib.util.find_spec(f"gdn_export.{name}") is not None:  # a submodule, e.g. gdn_export.run.runtime
        return importlib.import_module(f"gdn_export.{name}")
    raise AttributeError(f"module 'gdn_export' has no attribute {name!r}")


if "torch" in sys.modules:  # torch is already paid for: define the t2n_extra ops now (~20 ms), as a torch
    # custom-op package does on import, so torch.ops.t2n_extra.* resolve without touching an export-side name first.
    # Without torch nothing heavy is imported (the run side and gdn-export --help stay torch-free).
    importlib.import_module("gdn_export.ops").register_custom_ops()


__all__ = [
    "CheckpointError", "ConvertReport", "Engine", "ExportReport", "GatedDeltaRule", "GdnExportError", "LoweringError",
    "MissingExtraError", "OperandError", "ParityError", "SamplingParams", "Session", "SpeculativeConfig", "TractRuntimeError", "check",
    "convert", "export", "gated_delta_recurrence", "gated_delta_rule", "gated_delta_scan", "generate", "l2norm", "run_tract",
]
