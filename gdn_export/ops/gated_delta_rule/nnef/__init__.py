"""NNEF lowerings of gated delta-rule nodes and the emitter that chooses between them.

emitter.py validates a node and decides; registry.py names the lowerings (fused.py "native", scan.py,
recurrent.py, chunked/), policy.py orders them per runtime for ``lowering="auto"``, capabilities.py says what
each tract version's fused op runs, chunking.py holds the chunk sizes (no NNEF: the export's options validate
``chunk_size`` from it). Shared by the lowerings: node.py (the node), layout.py and steps.py (the per-token layout
and scan steps). This package's modules import no torch-to-nnef at module level where the CLI's ``--help`` reads
them (registry.py, policy.py, chunking.py). Depends on ``gdn_export.ops`` and ``gdn_export.backends.nnef`` only.
"""
