"""Every op's NNEF entry points, registered with the NNEF back-end on import: the ``t2n_extra`` handlers
(``backends.nnef.registry.CUSTOM_OPS``, active for an export's duration) and the module extractors
(torch-to-nnef's ``ModuleInfoExtractor`` subclasses). The one list of the ops an NNEF export knows."""

from gdn_export.ops.causal_conv1d import nnef as causal_conv1d  # noqa: F401  (registration on import)
from gdn_export.ops.gated_delta_rule.nnef import extractor, handlers  # noqa: F401
from gdn_export.ops.moe_ffn import nnef as moe_ffn  # noqa: F401
