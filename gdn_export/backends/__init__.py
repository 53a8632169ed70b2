"""The back-ends: what writes a traced module to one format (nnef/: torch-to-nnef for tract; onnx/: torch's ONNX
exporter) and compat/ (every patch gdn_export applies to third-party internals). A back-end names no op: the ops
register into it (gdn_export/ops/<op>/nnef.py, onnx.py)."""
