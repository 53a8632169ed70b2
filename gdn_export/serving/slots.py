"""The host-side state of every request an ``Engine`` serves: one slot per request, one pool per graph state.

A serving graph (``convert(serving=True)``) takes a batch of rows, each row any slot's states, with each row's own
past length (``past_len``). ``SlotPool`` holds, per slot:

- the fixed-size states (a GDN layer's conv and recurrent states), in one array per state ``[slots + 1, ...]``;
  the last row is the *scratch* row that padding rows of a batch read (zeros; never written);
- the caches (an attention layer's keys and values), one array per slot and state whose past axis grows by
  doubling, and the slot's length (tokens it holds).

``gather(rows)`` builds a batch's inputs (``SCRATCH`` for a padding row; caches padded to the longest row, at least
one position: the graph masks each row's padding), ``scatter(rows, outputs, new_tokens)`` writes a batch's outputs
back into the real rows only: padding rows touch no slot, and no other slot is written.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gdn_export.errors import GdnExportError

NUMPY_DTYPES = {"float32": np.float32, "float16": np.float16}
SCRATCH = -1  # a padding row: reads the scratch row, writes nothing


@dataclass(frozen=True)
class Snapshot:
    """A slot's states after its first ``length`` tokens (copies), to restore into another slot."""

    length: int
    fixed: tuple[np.ndarray, ...]
    caches: tuple[np.ndarray, ...]  # each cut to ``length`` positions

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.fixed) + sum(a.nbytes for a in self.caches)


class SlotPool:
    """The states of ``slots`` requests for the graph states ``specs`` (an archive's ``metadata["states"]``)."""

    def __init__(self, specs: list[dict], slots: int, initial_capacity: int = 64) -> None:
        if slots < 1:
            raise GdnExportError(f"a slot pool needs at least one slot, got {slots}")
        self.slots = slots
        self.specs = specs
        self.lengths = np.zeros(slots, np.int64)
        self._fixed: dict[int, np.ndarray] = {}  # state index -> [slots + 1, ...]
        self._caches: dict[int, list[np.ndarray]] = {}  # state index -> one [..., capacity, ...] per slot
        self._cache_axis: dict[int, int] = {}  # the past axis of a cache, batch axis removed
        for index, spec in enumerate(specs):
            dtype = NUMPY_DTYPES[spec["dtype"]]
            dims = [d for d in spec["shape"] if d != "B"]
            if "P" in dims:
                axis = dims.index("P")
                self._cache_axis[index] = axis
                shape = [initial_capacity if d == "P" else d for d in dims]
                self._caches[index] = [np.zeros(shape, dtype) for _ in range(slots)]
            else:
                self._fixed[index] = np.zeros([slots + 1, *dims], dtype)

    @property
    def state_count(self) -> int:
        return len(self.specs)

    def reset(self, slot: int) -> None:
        """A fresh slot: fixed states zero, no cached position."""
        for pool in self._fixed.values():
            pool[slot] = 0
        self.lengths[slot] = 0

    def snapshot(self, slot: int) -> Snapshot:
        length = int(self.lengths[slot])
        return Snapshot(length, tuple(pool[slot].copy() for pool in self._fixed.values()),
                        tuple(_cut(self._caches[i][slot], self._cache_axis[i], length).copy() for i in self._caches))

    def restore(self, slot: int, snapshot: Snapshot) -> None:
        for pool, value in zip(self._fixed.values(), snapshot.fixed):
            pool[slot] = value
        for index, value in zip(self._caches, snapshot.caches):
            self._reserve(index, slot, snapshot.length)
            _cut(self._caches[index][slot], self._cache_axis[index], snapshot.length)[...] = value
        self.lengths[slot] = snapshot.length

    def gather(self, rows: list[int]) -> tuple[np.ndarray, list[np.ndarray]]:
        """(``past_len [B]``, the states of ``rows`` in graph order): caches padded to the longest row (at least
        one position)."""
        past_len = np.array([0 if row == SCRATCH else self.lengths[row] for row in rows], np.int64)
        padded = max(1, int(past_len.max()))
        states: list[np.ndarray] = []
        for index in range(self.state_count):
            if index in self._fixed:
                states.append(self._fixed[index][[self.slots if row == SCRATCH else row for row in rows]])
                continue
            axis, per_slot = self._cache_axis[index], self._caches[index]
            shape = list(per_slot[0].shape)
            shape[axis] = padded
            batch = np.zeros([len(rows), *shape], per_slot[0].dtype)
            for b, row in enumerate(rows):
                if row != SCRATCH and past_len[b]:
                    length = int(past_len[b])
                    _cut(batch[b], axis, length)[...] = _cut(per_slot[row], axis, length)
            states.append(batch)
        return past_len, states

    def scatter(self, rows: list[int], outputs: list[np.ndarray], new_tokens: int) -> None:
        """Write a batch's state outputs (graph order) into its real rows; each real row's length grows by
        ``new_tokens`` (a cache output holds exactly those new positions)."""
        for b, row in enumerate(rows):
            if row == SCRATCH:
                continue
            length = int(self.lengths[row])
            for index, output in enumerate(outputs):
                if index in self._fixed:
                    self._fixed[index][row] = output[b]
                else:
                    axis = self._cache_axis[index]
                    self._reserve(index, row, length + new_tokens)
                    target = self._caches[index][row]
                    target[(slice(None),) * axis + (slice(length, length + new_tokens),)] = output[b]
            self.lengths[row] = length + new_tokens

    def _reserve(self, index: int, slot: int, length: int) -> None:
        array, axis = self._caches[index][slot], self._cache_axis[index]
        capacity = array.shape[axis]
        if length <= capacity:
            return
        while capacity < length:
            capacity *= 2
        shape = list(array.shape)
        shape[axis] = capacity
        grown = np.zeros(shape, array.dtype)
        _cut(grown, axis, array.shape[axis])[...] = array
        self._caches[index][slot] = grown

    def release(self, slot: int) -> None:
        """Give back a finished slot's grown caches (a long request must not keep its memory)."""
        for index, per_slot in self._caches.items():
            if per_slot[slot].shape[self._cache_axis[index]] > 64:
                shape = list(per_slot[slot].shape)
                shape[self._cache_axis[index]] = 64
                per_slot[slot] = np.zeros(shape, per_slot[slot].dtype)
        self.lengths[slot] = 0


def _cut(array: np.ndarray, axis: int, length: int) -> np.ndarray:
    """A view of ``array``'s first ``length`` positions along ``axis``."""
    return array[(slice(None),) * axis + (slice(0, length),)]
