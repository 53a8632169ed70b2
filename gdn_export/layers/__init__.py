"""Plain-torch versions of flash-linear-attention's layers, with FLA's parameter names and explicit states.

``load_state_dict(fla_layer.state_dict())`` works unchanged; each delta-rule layer's
``forward(x, conv_states, recurrent_state) -> (out, new_conv_states, new_recurrent_state)`` serves prefill and
decode and exports to one S-generic graph (the gated delta rule and the short convs are single nodes).
FLA itself is never imported.
"""

from gdn_export.layers.attention import Attention
from gdn_export.layers.base import DeltaLayer
from gdn_export.layers.common import FusedRMSNormGated, GatedMLP, RMSNorm, ShortConvolution
from gdn_export.layers.delta_net import DeltaNet
from gdn_export.layers.gated_deltanet import GatedDeltaNet
from gdn_export.layers.gated_deltaproduct import GatedDeltaProduct
from gdn_export.layers.gdn2 import GatedDeltaNet2
from gdn_export.layers.kda import KimiDeltaAttention
from gdn_export.layers.lm import FlaForCausalLM, LMConfig

__all__ = [
    "Attention", "DeltaLayer", "DeltaNet", "FlaForCausalLM", "FusedRMSNormGated", "GatedDeltaNet", "GatedDeltaNet2",
    "GatedDeltaProduct", "GatedMLP", "KimiDeltaAttention", "LMConfig", "RMSNorm", "ShortConvolution",
]
