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


def rows_of(source: torch.Tensor, rows: torch.Tensor | None) -> nn.Parameter:
    """``source[rows]`` (``rows`` None: every row, a copy of ``source`` the graph holds apart from it) as a frozen
    parameter that records its recipe; a placeholder of that shape when ``source`` is a placeholder."""
    count = source.shape[0] if rows is None else len(rows)
    if getattr(source, PLACEHOLDER, False):
        param = nn.Parameter(torch.empty((count, *source.shape[1:]), dtype=source.dtype), requires_grad=False)
        setattr(param, PLACEHOLDER, True)
    else:
        value = source.detach().clone() if rows is None else source.detach()[rows].contiguous()
        param = nn.Parameter(value, requires_grad=False)
    setattr(param, ROWS_OF, (source, rows))
    return param
