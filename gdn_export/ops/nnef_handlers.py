"""torch-to-nnef entry points: custom-op handlers and module extractors, all handing nodes to the emitter."""

from gdn_export.ops.gated_delta_rule.nnef import extractor, handlers  # noqa: F401  (registration on import)
from gdn_export.ops.moe_ffn import nnef as moe_ffn

# t2n_extra::moe_ffn: tract_moe_ffn or the dense form, decided per node (ops/moe_ffn/nnef.py)
handlers.extras._T2N_EXTRA_REGISTRY._registry["moe_ffn"] = moe_ffn.handle
