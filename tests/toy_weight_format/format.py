"""The toy format's registry entry (a format of gdn_export's own wraps it in ``register``; the test registers it for
its own duration)."""

from gdn_export.errors import GdnExportError
from gdn_export.weights.formats import WeightFormat


def _validate(dtype: str, runtime: str, quantize_embeddings: bool) -> None:
    if dtype != "float32":
        raise GdnExportError(f"quantize='bf16r' with dtype {dtype!r}: it stores float32 values")


FORMAT = WeightFormat(
    name="bf16r", codec="toy_weight_format.codec",
    help="every linear layer's weight rounded to bfloat16, stored in float32 (a test's format)",
    reference="bfloat16-rounded weights", onnx_refusal="a test's format", validate=_validate)
