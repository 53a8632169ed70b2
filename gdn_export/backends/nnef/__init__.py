"""The NNEF back-end for tract: the offline torch-to-nnef target (target.py), the NNEF builder the ops' lowerings
write with (builder.py), and the declared output names kept visible through tract (output_names.py)."""
