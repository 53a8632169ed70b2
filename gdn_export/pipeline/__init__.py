"""From a module or a checkpoint to an archive: export.py (``gdn_export.export``: one module, NNEF or ONNX),
convert.py (``gdn_export.convert``: a Hugging Face checkpoint to NNEF or ONNX, one plan, one orchestration),
onnx_convert.py (its ONNX steps).

Named ``pipeline`` rather than ``convert``/``export``: a submodule of that name would shadow the functions
``gdn_export.convert`` and ``gdn_export.export`` once imported."""
