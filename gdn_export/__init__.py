"""gdn_export: gated delta-rule models from PyTorch to NNEF for tract, exact and fast.

Importing the package registers ``torch.ops.t2n_extra.gated_delta_scan`` (and ``gated_delta_rule``,
``causal_conv1d_update``); everything else (torch-to-nnef and its handlers, tract, transformers) is imported
on first use of the name that needs it, so ``gdn-export --help`` and ``import gdn_export`` stay fast.
``gdn_export.export`` registers gdn_export's torch-to-nnef handlers; call ``import gdn_export.ops.nnef_handlers``
to register them for your own ``torch_to_nnef.export_model_to_nnef`` call.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys
from typing import Any

from gdn_export.errors import GdnExportError, LoweringError, OperandError, ParityError, TractRuntimeError
from gdn_export.ops import GatedDeltaRule, gated_delta_recurrence, gated_delta_rule, gated_delta_scan, l2norm

__version__ = "0.1.0"


class _CompileHeldBack:
    """A meta-path finder that runs one module of torch-to-nnef with ``torch.compile`` as the identity.

    torch-to-nnef 0.24.12's ``tensor/quant/base.py`` wraps the dequantization of its own quantized tensors in
    ``torch.compile`` at import, which imports inductor: 1.2 s of CPU in every process that exports (measured:
    3.5-4.2 s against 2.5 s for ``import torch_to_nnef``). gdn_export writes its Q4_0 itself and never dequantizes
    those tensors, which stay correct, only eager (tract_quirks.T2N_COMPILES_AT_IMPORT)."""

    MODULE = "torch_to_nnef.tensor.quant.base"

    def find_spec(self, name, path=None, target=None):
        if name != self.MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_held_back(module) -> None:
            import torch

            compile_ = torch.compile
            torch.compile = lambda model=None, *args, **kwargs: model
            try:
                exec_module(module)
            finally:
                torch.compile = compile_

        spec.loader.exec_module = exec_held_back
        return spec


if not any(isinstance(f, _CompileHeldBack) for f in sys.meta_path):
    sys.meta_path.insert(0, _CompileHeldBack())

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
