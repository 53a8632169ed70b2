"""``Session``: prefill and decode through an exported model in tract, carrying every state between calls."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from gdn_export.errors import GdnExportError
from gdn_export.export import read_metadata
from gdn_export.runtime import load_tract_model, run_tract
from gdn_export.runtime import steady_allocator as keep_buffers_mapped

NUMPY_DTYPES = {"float32": np.float32, "float16": np.float16}


class Session:
    """An exported gdn_export language model, run in tract.

    ``prefill(input_ids [B, S]) -> logits [B, S, vocab]`` and ``decode(input_ids [B, 1]) -> logits [B, 1, vocab]``
    both continue from the states the previous call left (conv and recurrent states of GDN layers, key and
    value caches of attention layers); ``reset()`` starts over. The batch size is fixed by the first call
    after a reset.

    ``steady_allocator`` (default on) keeps glibc from unmapping tract's big per-call buffers between calls
    (``gdn_export.runtime.steady_allocator``: process-wide; without it a decode step measured up to 3.5x slower,
    depending on the process's allocation history; the cost is that freed memory stays with the process).
    """

    def __init__(self, path: str | os.PathLike, steady_allocator: bool = True) -> None:
        if steady_allocator:
            keep_buffers_mapped()
        self.path = Path(path)
        metadata = read_metadata(self.path) if self.path.is_file() else None
        if not metadata or "states" not in metadata:
            raise GdnExportError(f"{self.path} was not written by gdn-export convert (no gdn_export.json with states)")
        self.metadata = metadata
        self.state_specs = metadata["states"]
        self._runnable = load_tract_model(self.path)
        self.states: list[np.ndarray] | None = None
        self.position = 0

    def reset(self) -> None:
        self.states = None
        self.position = 0

    def _initial_states(self, batch: int) -> list[np.ndarray]:
        return [
            np.zeros([batch if d == "B" else 0 if d == "P" else d for d in spec["shape"]], NUMPY_DTYPES[spec["dtype"]])
            for spec in self.state_specs
        ]

    def prefill(self, input_ids) -> np.ndarray:
        """Run S >= 1 new tokens; returns their logits and keeps the updated states."""
        ids = np.asarray(input_ids)
        if ids.ndim != 2 or ids.shape[1] < 1 or not np.issubdtype(ids.dtype, np.integer):
            raise GdnExportError(f"input_ids must be integers of shape [B, S] with S >= 1, got {ids.dtype} {list(ids.shape)}")
        if self.states is None:
            self.states = self._initial_states(ids.shape[0])
        elif ids.shape[0] != self.states[0].shape[0]:
            raise GdnExportError(f"batch size {ids.shape[0]} differs from this session's {self.states[0].shape[0]}; "
                                 "call reset() first")
        outputs = run_tract(self._runnable, [ids.astype(np.int64)] + self.states)
        self.states = outputs[1:]
        self.position += ids.shape[1]
        return outputs[0]

    def decode(self, input_ids) -> np.ndarray:
        """Run one new token per sequence (``[B, 1]``); returns logits ``[B, 1, vocab]``."""
        ids = np.asarray(input_ids)
        if ids.ndim != 2 or ids.shape[1] != 1:
            raise GdnExportError(f"decode takes input_ids of shape [B, 1], got {list(ids.shape)}")
        if self.states is None:
            raise GdnExportError("decode needs a prefill first (the session has no state)")
        return self.prefill(ids)
