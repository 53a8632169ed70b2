"""torch-to-nnef entry points: custom-op handlers and module extractors, all handing nodes to the emitter."""

from gdn_export.extractors import custom_ops, modules, moe_ffn  # noqa: F401  (registration on import)

# t2n_extra::moe_ffn: tract_moe_ffn or the dense form, decided per node (extractors/moe_ffn.py)
custom_ops.extras._T2N_EXTRA_REGISTRY._registry["moe_ffn"] = moe_ffn.handle
