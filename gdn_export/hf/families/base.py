"""What every Hugging Face family provides: its transformers classes and an exportable decoder over them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn


@dataclass(frozen=True)
class StateSpec:
    """One state tensor carried between calls: graph input ``in_<name>``, output ``out_<name>``.

    shape entries are ints or the symbols "B" (batch) and "P" (past length, attention caches only); the
    output of a cache has P+S along that axis.
    """

    name: str
    shape: tuple
    dtype: torch.dtype
    layer: int
    kind: str  # "conv", "recurrent", "key", "value"

    def zeros(self, batch: int, dtype_override: torch.dtype | None = None) -> torch.Tensor:
        shape = [batch if d == "B" else 0 if d == "P" else d for d in self.shape]
        return torch.zeros(shape, dtype=dtype_override or self.dtype)

    @property
    def dynamic_axes(self) -> dict[int, str]:
        return {i: d for i, d in enumerate(self.shape) if isinstance(d, str)}


class ExportableLM(nn.Module):
    """``forward(input_ids [B, S], *states) -> (logits [B, S, vocab], *new_states)`` over a transformers model.

    Subclasses implement ``forward``; ``states`` lists the StateSpecs in graph order.
    """

    states: Sequence[StateSpec]

    def __init__(self, hf_model: nn.Module) -> None:
        super().__init__()
        self.hf = hf_model

    def initial_states(self, batch: int) -> list[torch.Tensor]:
        return [spec.zeros(batch) for spec in self.states]


@dataclass(frozen=True)
class Family:
    """A family of checkpoints: the model_types it accepts and how to export them.

    ``config_class``/``model_class`` name transformers classes, resolved lazily (transformers is imported
    only when a checkpoint is loaded); ``lm_class`` builds the exportable decoder over the loaded model.
    """

    name: str
    model_types: tuple[str, ...]
    lm_class: type[ExportableLM]
    config_class: str = ""
    model_class: str = ""
    reference: str = "transformers"  # what the conversion check compares with

    def classes(self):
        try:
            import transformers
        except ImportError:
            from gdn_export.hf.checkpoint import CheckpointError

            raise CheckpointError(f"converting {self.name} checkpoints needs transformers 5.24: "
                                  "pip install 'gdn_export[hf]'") from None

        return getattr(transformers, self.config_class), getattr(transformers, self.model_class)

    def exportable(self, hf_model: nn.Module, state_dtype: torch.dtype) -> ExportableLM:
        return self.lm_class(hf_model, state_dtype)
