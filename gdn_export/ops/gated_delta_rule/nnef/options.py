"""The gated delta rule's options of an NNEF export, and their rules: which lowering (``LOWERINGS``), an f16 core
for the fused op (``CORE_DTYPES``), the chunked lowering's tokens per chunk. Light (no torch, no numpy): the CLI's
``--help`` and the export's plan (``ops.options.LoweringOptions``) validate with it before anything is traced."""

from __future__ import annotations

from gdn_export.errors import LoweringError
from gdn_export.ops.gated_delta_rule.nnef.chunking import chunk_size_error
from gdn_export.ops.gated_delta_rule.nnef.registry import LOWERINGS

CORE_DTYPES = (None, "float16")


def validate(lowering: str = "auto", core_dtype: str | None = None, chunk_size: int | None = None) -> None:
    """Raise LoweringError naming the first of the gated delta rule's options that is not valid."""
    if lowering not in LOWERINGS:
        raise LoweringError(f"lowering {lowering!r} is not one of {', '.join(LOWERINGS)}")
    if core_dtype not in CORE_DTYPES:
        raise LoweringError(f"core_dtype {core_dtype!r}: only 'float16' (or None, the model's own) is supported")
    if chunk_size is not None and chunk_size_error(chunk_size):
        raise LoweringError(f"chunk_size: {chunk_size_error(chunk_size)}")
