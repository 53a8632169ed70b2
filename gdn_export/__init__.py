"""gdn_export: gated delta-rule models from PyTorch to NNEF for tract, exact and fast.

Importing the package registers ``torch.ops.t2n_extra.gated_delta_scan`` (and ``gated_delta_rule``)
and gdn_export's torch-to-nnef handlers.
"""

from gdn_export.errors import GdnExportError, LoweringError, OperandError, ParityError, TractRuntimeError
from gdn_export.ops import GatedDeltaRule, gated_delta_recurrence, gated_delta_rule, gated_delta_scan, l2norm
from gdn_export import extractors  # noqa: E402,F401  (registers the torch-to-nnef handlers)
from gdn_export.export import ExportReport, export
from gdn_export.hf.checkpoint import CheckpointError
from gdn_export.hf.convert import ConvertReport, check, convert
from gdn_export.runtime import run_tract
from gdn_export.session import Session

__version__ = "0.1.0"

__all__ = [
    "CheckpointError", "ConvertReport", "ExportReport", "GatedDeltaRule", "GdnExportError", "LoweringError",
    "OperandError", "ParityError", "Session", "TractRuntimeError", "check", "convert", "export",
    "gated_delta_recurrence", "gated_delta_rule", "gated_delta_scan", "l2norm", "run_tract",
]
