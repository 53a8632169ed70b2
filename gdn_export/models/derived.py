"""Parameters an exportable model derives from the checkpoint's (rows picked, a part of axis 1 kept, zeros
appended), remembering how.

A converter that streams weights from the checkpoint (``gdn_export.pipeline.convert``) writes such a parameter from
its ``Recipe`` (``RECIPE``) rather than from its traced value, which is a placeholder when the source is one
(``PLACEHOLDER`` marks it): nothing of the weight is computed in memory. A recipe without ``rows`` works slice by
slice of the first axis (``apply`` on any run of the source's first axis gives that run of the result), so such a
weight is written a slice at a time, whatever its size.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

PLACEHOLDER = "gdn_placeholder"  # attribute set on a parameter whose values are not the model's
RECIPE = "gdn_recipe"  # attribute: the Recipe the parameter's values are made by


@dataclass(frozen=True, eq=False)
class Recipe:
    """``source[rows][:, part[0]:part[1]]`` with ``pad[1]`` zeros appended on axis ``pad[0]`` (each step only where
    given; ``rows`` None: every row, in order)."""

    source: torch.Tensor
    rows: torch.Tensor | None = None
    part: tuple[int, int] | None = None  # the kept range of axis 1
    pad: tuple[int, int] | None = None  # (axis >= 1, zeros appended on it)

    @property
    def shape(self) -> tuple[int, ...]:
        shape = list(self.source.shape)
        if self.rows is not None:
            shape[0] = len(self.rows)
        if self.part is not None:
            shape[1] = self.part[1] - self.part[0]
        if self.pad is not None:
            shape[self.pad[0]] += self.pad[1]
        return tuple(shape)

    def apply(self, value, rows_applied: bool = False):
        """The recipe on ``value`` (a torch tensor or numpy array of the source, or of a run of its first axis when
        ``rows`` is None or ``rows_applied``)."""
        if self.rows is not None and not rows_applied:
            value = value[self.rows.numpy() if isinstance(value, np.ndarray) else self.rows]
        if self.part is not None:
            value = value[:, self.part[0]:self.part[1]]
        if self.pad is not None:
            axis, count = self.pad
            zeros = list(value.shape)
            zeros[axis] = count
            if isinstance(value, np.ndarray):
                value = np.concatenate([value, np.zeros(zeros, value.dtype)], axis=axis)
            else:
                value = torch.cat([value, value.new_zeros(zeros)], dim=axis)
        return value


def derived(source: torch.Tensor, recipe: Recipe) -> nn.Parameter:
    """``recipe`` applied to ``source`` as a frozen parameter that records it; a placeholder of the result's shape
    when ``source`` is a placeholder."""
    if getattr(source, PLACEHOLDER, False):
        param = nn.Parameter(torch.empty(recipe.shape, dtype=source.dtype), requires_grad=False)
        setattr(param, PLACEHOLDER, True)
    else:
        # a copy: a parameter of its own, never a view of the source's storage
        value = recipe.apply(source.detach()).clone(memory_format=torch.contiguous_format)
        param = nn.Parameter(value, requires_grad=False)
    setattr(param, RECIPE, recipe)
    return param


def rows_of(source: torch.Tensor, rows: torch.Tensor | None) -> nn.Parameter:
    """``source[rows]`` (``rows`` None: every row, a copy of ``source`` the graph holds apart from it)."""
    return derived(source, Recipe(source, rows))


def part_of(source: torch.Tensor, part: tuple[int, int] | None, pad: tuple[int, int] | None = None) -> nn.Parameter:
    """``source[:, part[0]:part[1]]`` (every row when ``part`` is None) with ``pad = (axis, count)`` zeros appended."""
    return derived(source, Recipe(source, None, part, pad))
