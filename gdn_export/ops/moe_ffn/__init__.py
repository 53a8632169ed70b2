"""The mixture-of-experts feed-forward (``t2n_extra::moe_ffn``).

op.py: the torch custom op and the expert-stack module; nnef.py: its decision (tract's fused ``tract_moe_ffn`` or
the dense form) and NNEF lowering.
"""
