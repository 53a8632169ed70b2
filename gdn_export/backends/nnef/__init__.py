"""The NNEF back-end for tract: the offline torch-to-nnef target (target.py), the NNEF builder the ops' lowerings
write with (builder.py), and the declared output names kept visible through tract (output_names.py)."""

from gdn_export.backends.compat.torch_to_nnef import import_torch_to_nnef

import_torch_to_nnef()  # before any module of this back-end imports it: its compile at import held back
