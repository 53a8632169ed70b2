"""NNEF lowerings of gated delta-rule nodes and the emitter that chooses between them.

emitter.py validates a node and decides; registry.py names the lowerings (fused.py "native", scan.py,
recurrent.py, chunked/), policy.py orders them per runtime for ``lowering="auto"``, options.py holds an
export's validated choices. Shared by the lowerings: node.py (the node), layout.py and steps.py (the per-token
layout and scan steps), capabilities.py (what each tract version's fused op runs), nnef_builder.py. conv.py
lowers the short causal conv. Depends on ``gdn_export.ops`` only, never on the export around it.
"""
