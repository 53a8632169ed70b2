"""The int8 format's entry (``gdn_export.weights.formats``): int8 weights on tract's integer matmuls, the inputs
rounded per row in the graph, in one or two passes (``int8_passes``)."""

from __future__ import annotations

from gdn_export.errors import GdnExportError
from gdn_export.weights.formats import OwnedOption, WeightFormat, register


def _validate(dtype: str, runtime: str, quantize_embeddings: bool) -> None:
    if dtype != "float32":
        raise GdnExportError(f"quantize='int8' with dtype {dtype!r}: the int8 graph scales and rounds its activations "
                             "in float32; convert with dtype='float32' (--dtype float32)")
    if quantize_embeddings:
        raise GdnExportError("quantize_embeddings (--quantize-embeddings) with quantize='int8': the embedding table "
                             "of an int8 archive is stored in int8 already (a scale per row, applied to the gathered "
                             "rows); drop the option")


def check_passes(passes) -> None:
    if passes not in (1, 2) or isinstance(passes, bool):
        raise GdnExportError(f"int8_passes must be 1 or 2 (rounds of each int8 layer's input), got {passes!r}")


FORMAT = register(WeightFormat(
    name="int8",
    help="every linear layer's weight in int8 (a scale per output channel) on tract's integer matmuls, its input "
         "rounded per row in the graph (--dtype float32)",
    reference="int8 (inputs rounded per row as in the graph)",
    onnx_refusal="the ONNX exporter writes float weights only: its integer route with the same numbers (Abs, "
                 "ReduceMax, Round, Cast, MatMulInteger without zero points) is not written; DynamicQuantizeLinear "
                 "rounds asymmetrically to uint8, other numbers",
    options=(OwnedOption("int8_passes", 1, "--int8-passes", dict(
        type=int, choices=[1, 2], help="with --quantize int8: round each layer's input in 1 pass (the default) or 2 "
        "(the rounding's residual too: a second int8 row, mean KL 0.23x on the trained fixture, more int8 work; "
        "docs/INT8.md)")),),
    needs=("int8_passes chooses how quantize='int8' rounds its activations: it needs quantize='int8'",
           "--int8-passes chooses how --quantize int8 rounds its activations: add --quantize int8"),
    validate=_validate,
    resolve=lambda options, calibration: check_passes(options.get("int8_passes", 1)),
    # archives before the registry recorded the default Q4_0 rule for int8 too: kept, so they stay byte-identical
    metadata=lambda choice: {"q4_rule": "search", "int8_passes": choice.int8_passes},
    options_from_metadata=lambda metadata: {"int8_passes": metadata.get("int8_passes", 1)}))
