"""The host-side state of every request an ``Engine`` serves: one slot per request, one pool per graph state.

A serving graph (``convert(serving=True)``) takes a batch of rows, each row any slot's states, with each row's own
past length (``past_len``). ``SlotPool`` holds, per slot:

- the fixed-size states (a GDN layer's conv and recurrent states), in one array per state ``[slots + 1, ...]``;
  the last row is the *scratch* row that padding rows of a batch read (zeros; never written). Each array is a
  mapping of its own, and a slot's rows are handed back to the system (``_drop``: they read as zeros after) when
  the slot is reset or released and while its states are resident (below): at the 0.8B shape a slot's fixed
  states are 19.6 MB, and with 8 slots decoding the stale copies beside the resident tensors were 0.16 GB of
  `gdn-export serve`'s peak (benchmarks/RESULTS.md). A mapping of its own, not a heap array freed per slot: the
  workers' heaps keep what they free (``steady_allocator``), so freeing per-slot arrays there raised the peak;
- the caches (an attention layer's keys and values), one array per slot and state whose past axis grows by
  doubling, and the slot's length (tokens it holds).

``gather(rows)`` builds a batch's inputs (``SCRATCH`` for a padding row; caches padded to the longest row, at least
one position: the graph masks each row's padding), ``scatter(rows, outputs, new_tokens)`` writes a batch's outputs
back into the real rows only: padding rows touch no slot, and no other slot is written.

A decode batch usually runs the same rows step after step, so ``scatter(..., resident=True)`` keeps its
fixed-size state outputs as they came (the runtime's tensors) instead of copying them into the pool, and the next
``gather`` of the same rows hands them back as they are: no copy of the recurrent states per step. They are
written into the pool (``flush``) before anything else reads or writes one of those slots: a gather of other rows
sharing a slot with them, a reset, snapshot, restore or release.
"""

from __future__ import annotations

import mmap
import sys
from dataclasses import dataclass

import numpy as np

from gdn_export.errors import GdnExportError
from gdn_export.targets import numpy_dtype

SCRATCH = -1  # a padding row: reads the scratch row, writes nothing
# Linux's MADV_DONTNEED on a private anonymous mapping frees the pages and reads zeros after; elsewhere (macOS's is
# advisory and may keep the contents) the rows are zeroed by writing, in plain arrays
_GIVES_BACK = sys.platform.startswith("linux") and hasattr(mmap, "MADV_DONTNEED") and hasattr(mmap, "MAP_PRIVATE")


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
        self.initial_capacity = initial_capacity
        self.lengths = np.zeros(slots, np.int64)
        self._fixed: dict[int, np.ndarray] = {}  # state index -> [slots + 1, ...]
        self._resident: tuple[tuple[int, ...], dict[int, object]] | None = None  # (rows, state index -> tensor)
        self._dropped: set[int] = set(range(slots))  # slots whose fixed rows are zero pages, holding no memory
        self._caches: dict[int, list[np.ndarray]] = {}  # state index -> one [..., capacity, ...] per slot
        self._cache_axis: dict[int, int] = {}  # the past axis of a cache, batch axis removed
        for index, spec in enumerate(specs):
            dtype = numpy_dtype(spec["dtype"])
            dims = [d for d in spec["shape"] if d != "B"]
            if "P" in dims:
                axis = dims.index("P")
                self._cache_axis[index] = axis
                shape = [initial_capacity if d == "P" else d for d in dims]
                self._caches[index] = [np.zeros(shape, dtype) for _ in range(slots)]
            else:
                self._fixed[index] = _mapped_zeros([slots + 1, *dims], dtype)

    @property
    def state_count(self) -> int:
        return len(self.specs)

    def flush(self, slot: int | None = None) -> None:
        """Write the resident batch's states into the pool (if ``slot`` is given: only when it is one of its rows)."""
        if self._resident is None or (slot is not None and slot not in self._resident[0]):
            return
        rows, tensors = self._resident
        self._resident = None
        for index, tensor in tensors.items():
            values = _numpy(tensor)
            for b, row in enumerate(rows):
                if row != SCRATCH:
                    self._fixed[index][row] = values[b]
        self._dropped.difference_update(rows)

    def reset(self, slot: int) -> None:
        """A fresh slot: fixed states zero, no cached position."""
        self.flush(slot)
        self._drop(slot)
        self.lengths[slot] = 0

    def snapshot(self, slot: int) -> Snapshot:
        self.flush(slot)
        length = int(self.lengths[slot])
        return Snapshot(length, tuple(pool[slot].copy() for pool in self._fixed.values()),
                        tuple(_cut(self._caches[i][slot], self._cache_axis[i], length).copy() for i in self._caches))

    def restore(self, slot: int, snapshot: Snapshot) -> None:
        self.flush(slot)
        self._dropped.discard(slot)
        for pool, value in zip(self._fixed.values(), snapshot.fixed):
            pool[slot] = value
        for index, value in zip(self._caches, snapshot.caches):
            self._reserve(index, slot, snapshot.length)
            _cut(self._caches[index][slot], self._cache_axis[index], snapshot.length)[...] = value
        self.lengths[slot] = snapshot.length

    def gather(self, rows: list[int]) -> tuple[np.ndarray, list]:
        """(``past_len [B]``, the states of ``rows`` in graph order): caches padded to the longest row (at least
        one position); the fixed states of the resident batch as they are when ``rows`` are its rows."""
        resident = self._resident is not None and self._resident[0] == tuple(rows)
        if not resident and self._resident is not None and set(rows) & set(self._resident[0]) - {SCRATCH}:
            self.flush()
        past_len = np.array([0 if row == SCRATCH else self.lengths[row] for row in rows], np.int64)
        padded = max(1, int(past_len.max()))
        states: list = []
        for index in range(self.state_count):
            if index in self._fixed:
                states.append(self._resident[1][index] if resident else
                              self._fixed[index][[self.slots if row == SCRATCH else row for row in rows]])
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

    def scatter(self, rows: list[int], outputs: list, new_tokens, resident: bool = False) -> None:
        """Write a batch's state outputs (graph order: numpy arrays or the runtime's tensors) into its real rows; each
        real row's length grows by ``new_tokens`` (one count for all rows, or one per row: the call's ``seq_len``; a
        cache output's first that many new positions are the row's, the rest padding). ``resident``: keep the fixed
        states as the resident batch instead (see the module docstring)."""
        counts = np.broadcast_to(np.asarray(new_tokens, np.int64), (len(rows),))
        if resident:
            if self._resident is not None and self._resident[0] != tuple(rows):
                self.flush()  # another batch's: the same rows' were this step's inputs, replaced now
            self._resident = (tuple(rows), {i: outputs[i] for i in self._fixed})
            for row in rows:  # the resident tensors hold these slots' states now: the rows' memory goes back
                if row != SCRATCH:
                    self._drop(row)
        outputs = [None if resident and i in self._fixed else _numpy(o) for i, o in enumerate(outputs)]
        for b, row in enumerate(rows):
            if row == SCRATCH:
                continue
            length, added = int(self.lengths[row]), int(counts[b])
            if not resident:
                self._dropped.discard(row)
            for index, output in enumerate(outputs):
                if output is None:
                    continue
                if index in self._fixed:
                    self._fixed[index][row] = output[b]
                else:
                    axis = self._cache_axis[index]
                    self._reserve(index, row, length + added)
                    target = self._caches[index][row]
                    target[(slice(None),) * axis + (slice(length, length + added),)] = _cut(output[b], axis, added)
            self.lengths[row] = length + added

    def rewind(self, slot: int, length: int, states: list) -> None:
        """Take back the tokens a call added to ``slot`` past its first ``length``: the caches keep their first
        ``length`` positions (the rest is masked, then overwritten by the next call), the fixed states become the
        call's inputs, ``states`` (graph order, numpy, the slot's row of each; the caches' entries are not read).
        A verify call whose drafts were not all kept (speculative decoding)."""
        self.flush(slot)
        self._dropped.discard(slot)
        for index, pool in self._fixed.items():
            pool[slot] = _numpy(states[index])
        self.lengths[slot] = length

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

    def _drop(self, slot: int) -> None:
        """Zero ``slot``'s fixed states, handing their whole pages back to the system (``MADV_DONTNEED``: a private
        anonymous mapping reads zeros after, and holds no memory until written again)."""
        if slot in self._dropped:  # a resident batch's rows: dropped at its first step, not again at every step
            return
        self._dropped.add(slot)
        for pool in self._fixed.values():
            _zero_row(pool, slot)

    def drop_resident(self) -> None:
        """Forget the resident batch without writing it (after a failed step: its requests end)."""
        self._resident = None

    def release(self, slot: int) -> None:
        """Give back a finished slot's memory: its fixed states (zeros after) and grown caches (a long request must
        not keep its memory)."""
        self.flush(slot)
        self._drop(slot)
        for index, per_slot in self._caches.items():
            if per_slot[slot].shape[self._cache_axis[index]] > self.initial_capacity:
                shape = list(per_slot[slot].shape)
                shape[self._cache_axis[index]] = self.initial_capacity
                per_slot[slot] = np.zeros(shape, per_slot[slot].dtype)
        self.lengths[slot] = 0


def _mapped_zeros(shape: list[int], dtype) -> np.ndarray:
    """A zero array in an anonymous mapping of its own (its memory is taken as rows are written; ``_zero_row`` gives
    a row's pages back)."""
    if not _GIVES_BACK:
        return np.zeros(shape, dtype)
    nbytes = max(1, int(np.prod(shape)) * np.dtype(dtype).itemsize)
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)  # private: MADV_DONTNEED then reads zeros
    return np.frombuffer(mapping, dtype, int(np.prod(shape))).reshape(shape)


def _zero_row(array: np.ndarray, row: int) -> None:
    """``array[row] = 0`` for an ``_mapped_zeros`` array, its row's whole pages given back (``MADV_DONTNEED``) and
    only the partial pages at its ends written."""
    buffer = array.base
    while isinstance(buffer, np.ndarray):  # the mapping under the reshaped array
        buffer = buffer.base
    buffer = buffer.obj if isinstance(buffer, memoryview) else buffer
    flat = array.reshape(-1).view(np.uint8)
    size = array[0].nbytes
    begin, end = row * size, (row + 1) * size
    first, last = -(-begin // mmap.PAGESIZE) * mmap.PAGESIZE, end // mmap.PAGESIZE * mmap.PAGESIZE
    if not _GIVES_BACK or not isinstance(buffer, mmap.mmap) or last <= first:
        array[row] = 0
        return
    buffer.madvise(mmap.MADV_DONTNEED, first, last - first)
    flat[begin:first] = 0
    flat[last:end] = 0


def _numpy(value) -> np.ndarray:
    """A numpy array of an output: as it is, or copied out of the runtime's tensor."""
    return value if isinstance(value, np.ndarray) else value.to_numpy()


def _cut(array: np.ndarray, axis: int, length: int) -> np.ndarray:
    """A view of ``array``'s first ``length`` positions along ``axis``."""
    return array[(slice(None),) * axis + (slice(0, length),)]
