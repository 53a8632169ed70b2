"""The short causal conv of linear-attention layers (``t2n_extra::causal_conv1d_update``).

op.py: the torch custom op and its operand check; nnef.py: its decision and NNEF lowering (tract's fused op where
the target has it, else portable slices).
"""
