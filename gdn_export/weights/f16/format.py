"""The f16 format's entry (``gdn_export.weights.formats``): float16 weights for a float32 graph, on a CPU."""

from __future__ import annotations

from gdn_export.errors import GdnExportError, worded
from gdn_export.weights.formats import WeightFormat, register


def _validate(dtype: str, runtime: str, quantize_embeddings: bool) -> None:
    if dtype != "float32":
        raise worded(GdnExportError(f"quantize='f16' with dtype {dtype!r}: it stores float16 weights for a float32 "
                                    "graph; a float16 graph has float16 weights already: drop quantize='f16' or "
                                    "convert with dtype='float32'"),
                     f"--quantize f16 with --dtype {dtype}: it stores float16 weights for a float32 graph; a float16 "
                     "graph has float16 weights already: drop one")
    if quantize_embeddings:
        raise worded(GdnExportError("quantize_embeddings with quantize='f16': the embedding table of an f16 archive is "
                                    "stored in float16 already; drop the option"),
                     "--quantize-embeddings with --quantize f16: the embedding table of an f16 archive is stored in "
                     "float16 already; drop the option")
    if runtime == "cuda":
        raise worded(GdnExportError("quantize='f16' with runtime='cuda': float16 weights in a float32 graph are "
                                    "measured on tract's CPU runtime only; for tract's CUDA runtime convert with "
                                    "dtype='float16' (its kernels compute in float16)"),
                     "--quantize f16 with --runtime cuda: float16 weights in a float32 graph are measured on tract's "
                     "CPU runtime only; for CUDA convert with --dtype float16")


FORMAT = register(WeightFormat(
    name="f16",
    help="every linear layer's weight and the embedding table in float16, computed in float32 (half the bytes; on a "
         "CPU faster than --dtype float16, docs/QUANTIZATION.md)",
    reference="float16 (rounded to nearest even)",
    onnx_refusal="an NNEF archive's float16 weights for a float32 graph (tract's mixed matmul); for ONNX convert "
                 "with --dtype float16",
    validate=_validate))
