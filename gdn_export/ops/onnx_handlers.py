"""Every op's ONNX lowering, registered with the ONNX back-end on import (``backends.onnx.registry.placeholder``):
the one list of the ops an ONNX export knows."""

from gdn_export.ops.causal_conv1d import onnx as causal_conv1d  # noqa: F401  (registration on import)
from gdn_export.ops.gated_delta_rule import onnx as gated_delta_rule  # noqa: F401
from gdn_export.ops.moe_ffn import onnx as moe_ffn  # noqa: F401
