"""How weights reach an archive: streamed from their source (``streamed``), and in which encoding (``q4_0``,
``int8``, ``f16``)."""

# why each quantization stays NNEF-only (the CLI's message and format="onnx"'s); here, light for the CLI's import
ONNX_QUANTIZE_REFUSAL = {
    "q4_0": "tract's Q4_0 format; an ONNX export keeps float weights",
    "int8": "the ONNX exporter writes float weights only: its integer route with the same numbers (Abs, ReduceMax, "
            "Round, Cast, MatMulInteger without zero points) is not written; DynamicQuantizeLinear rounds "
            "asymmetrically to uint8, other numbers",
    "f16": "an NNEF archive's float16 weights for a float32 graph (tract's mixed matmul); for ONNX convert with "
           "--dtype float16",
}
