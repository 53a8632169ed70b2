"""transformers' checkpoint conversions, replayed lazily: which checkpoint tensors make each model parameter.

transformers 5 renames checkpoint tensors and converts some on load (``conversion_mapping.py``): per-expert
``experts.<e>.gate_proj`` / ``up_proj`` matrices stacked and concatenated into one ``experts.gate_up_proj``,
Kimi's three short convolutions concatenated, and so on. ``parameter_sources`` groups a checkpoint's tensor names
exactly as ``convert_and_load_state_dict_in_model`` does (its own ``rename_source_key`` and converters), but
with loaders in place of tensors: a ``ParameterSource`` reads its checkpoint tensors only when asked, then runs
transformers' own conversion operations on them. A parameter that is one tensor renamed (most) is that tensor's
``TensorEntry``, which can also be streamed in slices.
"""

from __future__ import annotations

import copy
import re
from collections import Counter
from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable

import numpy as np
import torch
from torch import nn

from gdn_export.hf.tensors import TORCH_TO_NUMPY, CheckpointError, TensorEntry


@dataclass
class ParameterSource:
    """A parameter made by a transformers conversion from several checkpoint tensors.

    ``rows(start, stop, target)`` reads a run of its first axis: for a stack of numbered members (per-expert
    matrices stacked into ``experts.gate_up_proj``: every source pattern has one tensor per row, in order, and the
    conversion of a run of them is that run of rows, checked on shapes) by converting only those members, so an
    expert stack is written a slice of experts at a time; otherwise by reading it whole once (kept until
    ``release``)."""

    target: str  # the parameter's name in the model
    first: str  # the name transformers converts the group under
    mapping: object  # the WeightConverter, its tensors added as loaders
    entries: list[TensorEntry]
    model: nn.Module
    shape: tuple[int, ...] = ()
    _whole: np.ndarray | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        return f"{self.target} (from {len(self.entries)} tensors: {self.entries[0].name}, ...)"

    @property
    def dtype(self) -> str:
        return self.entries[0].dtype

    @property
    def nbytes(self) -> int:
        return sum(e.end - e.begin for e in self.entries)

    def _convert(self, load: Callable[[TensorEntry], torch.Tensor], members: slice = slice(None)) -> torch.Tensor:
        mapping = copy.copy(self.mapping)
        mapping.collected_tensors = {k: [lambda e=e: load(e) for e in v[members]]
                                     for k, v in self.mapping.collected_tensors.items()}
        value = mapping.convert(self.first, model=self.model, config=getattr(self.model, "config", None))[self.target]
        return value[0] if isinstance(value, list) else value

    def _missing_members(self) -> list[str]:
        """Names absent from a group whose members are numbered (experts.<e>.<part>): each part should have every
        number the others have."""
        parts: dict[str, set[str]] = {}
        for entry in self.entries:
            found = list(re.finditer(r"\.(\d+)\.", entry.name))
            match = found[-1] if found else None  # the innermost number: the expert's (layers are numbered too)
            if match:
                parts.setdefault(entry.name[:match.start()] + ".*." + entry.name[match.end():], set()).add(match.group(1))
        numbers = set().union(*parts.values()) if parts else set()
        return sorted(pattern.replace("*", n) for pattern, have in parts.items() for n in numbers - have)

    def read(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self._convert(lambda entry: entry.read(dtype)).contiguous()

    @cached_property
    def row_per_member(self) -> bool:
        """Whether row i of the parameter is made from the i-th tensor of each source pattern alone (a stack)."""
        if not self.shape or any(len(v) != self.shape[0] for v in self.mapping.collected_tensors.values()):
            return False
        try:
            one = self._convert(lambda entry: torch.empty(entry.shape, device="meta"), slice(0, 1))
        except (RuntimeError, ValueError, IndexError, KeyError):
            return False
        return tuple(one.shape) == (1, *self.shape[1:])

    def rows(self, start: int, stop: int, target: np.dtype) -> np.ndarray:
        """Rows ``start:stop`` (of the first axis) as ``target``, flat."""
        dtype = {np.dtype(n): t for t, n in TORCH_TO_NUMPY.items()}[np.dtype(target)]
        if self.row_per_member:
            return self._convert(lambda entry: entry.read(dtype), slice(start, stop)).contiguous().numpy().reshape(-1)
        if self._whole is None or self._whole.dtype != target:
            self._whole = self.read(dtype).numpy()
        return self._whole[start:stop].reshape(-1)

    def release(self) -> None:
        self._whole = None

    def infer_shape(self) -> tuple[int, ...]:
        """The converted shape, computed on meta tensors (nothing read); CheckpointError when transformers'
        conversion cannot combine the tensors (one of another shape, one missing)."""
        try:
            return tuple(self._convert(lambda entry: torch.empty(entry.shape, device="meta")).shape)
        except (RuntimeError, ValueError, IndexError, KeyError) as err:
            missing = self._missing_members()
            if missing:
                raise CheckpointError(f"the checkpoint tensors that make {self.target} are incomplete: "
                                      f"{', '.join(missing[:3])} missing" + (" ..." if len(missing) > 3 else ""))
            shapes = Counter(tuple(e.shape) for e in self.entries)
            common = shapes.most_common(1)[0][0]
            odd = [f"{e.name} {list(e.shape)}" for e in self.entries if tuple(e.shape) != common]
            detail = (f"{', '.join(odd[:3])} where the others are {list(common)}" if odd else
                      f"{len(self.entries)} tensors, of which transformers' conversion could not make it "
                      f"({str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__})")
            raise CheckpointError(f"the checkpoint tensors that make {self.target} do not fit together: "
                                  f"{detail}") from None


def parameter_sources(model: nn.Module, entries: dict[str, TensorEntry]):
    """``(sources, unexpected)``: the checkpoint source of each model parameter or buffer name that the checkpoint
    holds (a ``TensorEntry`` or a ``ParameterSource``), and the checkpoint names that make nothing in ``model``.
    ``entries`` are keyed by the names transformers would see (after the published layout's renaming)."""
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (WeightConverter, WeightRenaming, dot_natural_key,
                                                     rename_source_key)
    except ImportError:
        PreTrainedModel = None
    state = model.state_dict()  # meta parameters: names and shapes only
    if PreTrainedModel is None or not isinstance(model, PreTrainedModel):
        sources = {k: e for k, e in entries.items() if k in state}
        return sources, sorted(k for k in entries if k not in state)
    mapping = get_model_conversion_mapping(model)
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    groups: dict[str, object] = {}
    members: dict[str, list[TensorEntry]] = {}
    sources: dict[str, object] = {}
    unexpected = []
    prefix = model.base_model_prefix
    for key in sorted(entries, key=dot_natural_key):
        renamed, pattern = rename_source_key(key, renamings, converters, prefix, state)
        if renamed not in state and key in state:
            renamed, pattern = rename_source_key(key, [], [], base_model_prefix=prefix, meta_state_dict=state)
        if renamed not in state:
            unexpected.append(key)
        elif pattern is None:
            sources[renamed] = entries[key]
        else:
            group = groups.setdefault(renamed, copy.deepcopy(by_pattern[pattern]))
            group.add_tensor(renamed, key, pattern, entries[key])
            members.setdefault(renamed, []).append(entries[key])
    for first, group in groups.items():
        patterns = list(group.target_patterns)
        for target_pattern in patterns:
            target = first.replace(patterns[0], target_pattern)
            source = ParameterSource(target, first, group, members[first], model)
            source.shape = source.infer_shape()
            sources[target] = source
    return sources, unexpected
