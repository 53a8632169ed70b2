"""The gated delta rule (GDN, DeltaNet, Gated DeltaProduct, KDA, GDN2): everything about the op, in one folder.

op.py and scan_op.py: the torch custom ops (``gated_delta_rule`` seq-major, ``gated_delta_scan`` head-major) and
the ``GatedDeltaRule`` module; naive.py: the reference recurrence; operands.py: operand validation (``Dims``);
nnef/: everything NNEF decides and writes (emitter.py: validate, decide; registry.py names the lowerings, policy.py
ranks them per runtime, capabilities.py says what tract's fused op runs, chunking.py the chunk sizes; node.py: one
node as the lowerings see it; one module per lowering: fused, scan, recurrent, chunked/; handlers.py and
extractor.py: the torch-to-nnef entry points); onnx.py: the ONNX decisions.
"""
