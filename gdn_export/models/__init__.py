"""Model pieces below both the FLA layers (``gdn_export.layers``) and the Hugging Face families (``gdn_export.hf``).

``state``: the carried states (``StateSpec``) and their naming; ``blocks``: export-friendly tensor functions
(positions, masks, rotary tables, cached attention, the short conv + gated delta rule mixer, the decay
formula, dense MoE); ``decoder``: the one decoder loop every family runs, with its hooks. Nothing here
imports transformers or ``gdn_export.hf``.
"""
