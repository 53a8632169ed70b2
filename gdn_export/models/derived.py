"""Parameters an exportable model derives from the checkpoint's (a row permutation), remembering how.

A converter that streams weights from the checkpoint (``gdn_export.hf.convert``) writes such a parameter from
its recipe (``ROWS_OF``: the source parameter and the row indices) rather than from its traced value, which is a
placeholder when the source is one (``PLACEHOLDER`` marks it): nothing of the weight is computed in memory.
"""

from __future__ import annotations

import torch
from torch import nn

PLACEHOLDER = "gdn_placeholder"  # attribute set on a parameter whose values are not the model's
ROWS_OF = "gdn_rows_of"  # attribute: (source parameter, row indices) the parameter's values are


def rows_of(source: torch.Tensor, rows: torch.Tensor) -> nn.Parameter:
    """``source[rows]`` as a frozen parameter that records its recipe; a placeholder of that shape when ``source``
    is a placeholder."""
    if getattr(source, PLACEHOLDER, False):
        param = nn.Parameter(torch.empty((len(rows), *source.shape[1:]), dtype=source.dtype), requires_grad=False)
        setattr(param, PLACEHOLDER, True)
    else:
        param = nn.Parameter(source.detach()[rows].contiguous(), requires_grad=False)
    setattr(param, ROWS_OF, (source, rows))
    return param
