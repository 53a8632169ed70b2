"""The ONNX back-end: the same exportable modules, state inputs/outputs and names as the NNEF graph, written as
ONNX for onnxruntime (its contrib ops where exact) or any ONNX runtime with ``Scan`` (tract's ONNX loader too).

``export_onnx`` (``gdn_export.export(..., format="onnx")``), ``OnnxSession``, ``run_model``. Per-node decisions:
each op's ``onnx`` module (``gdn_export/ops/onnx_handlers.py``), through ``registry.py``.
"""

from __future__ import annotations

from gdn_export.backends.onnx.exporter import OnnxExportReport, export_onnx, onnx_path
from gdn_export.run.onnx_session import OnnxSession, read_onnx_metadata, run_model

__all__ = ["OnnxExportReport", "OnnxSession", "export_onnx", "onnx_path", "read_onnx_metadata", "run_model"]
