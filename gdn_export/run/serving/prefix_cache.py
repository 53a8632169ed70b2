"""Snapshots of a request's states at chunk-aligned prompt boundaries, keyed by the token prefix: a later request
with the same prefix starts from the snapshot instead of recomputing it.

A delta-rule layer's state after k tokens summarizes all k of them, so only boundaries the prefill actually stopped
at can be restored: the ``Engine`` cuts prompts into pieces of a multiple of ``ALIGN`` tokens and offers a snapshot
after each piece. A hit restores exactly the states the cold run had at that boundary, and the rest of the prompt
runs in the same pieces as cold: the same numbers. Bounded in bytes, least recently used first out.
"""

from __future__ import annotations

import collections
import threading
from typing import Sequence

from gdn_export.run.serving.slots import Snapshot

ALIGN = 64  # Megatron-LM's and the chunked lowering's chunk: snapshots sit at multiples of it


class PrefixCache:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: collections.OrderedDict[tuple[int, ...], Snapshot] = collections.OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def longest(self, prompt: Sequence[int]) -> Snapshot | None:
        """The snapshot of the longest aligned prefix of ``prompt`` that leaves at least one prompt token to run (the
        first generated token needs the last prompt token's logits), or None."""
        with self._lock:
            for length in range((len(prompt) - 1) // ALIGN * ALIGN, 0, -ALIGN):
                snapshot = self._entries.get(tuple(prompt[:length]))
                if snapshot is not None:
                    self._entries.move_to_end(tuple(prompt[:length]))
                    self.hits += 1
                    return snapshot
            self.misses += 1
            return None

    def wants(self, prefix: Sequence[int]) -> bool:
        """Whether a snapshot after ``prefix`` would be kept (aligned, not held yet, caching on)."""
        with self._lock:
            return self.max_bytes > 0 and len(prefix) % ALIGN == 0 and tuple(prefix) not in self._entries

    def put(self, prefix: Sequence[int], snapshot: Snapshot) -> None:
        if snapshot.nbytes > self.max_bytes:
            return
        key = tuple(prefix)
        with self._lock:
            if key in self._entries:
                return
            self._entries[key] = snapshot
            self._bytes += snapshot.nbytes
            while self._bytes > self.max_bytes:
                _, evicted = self._entries.popitem(last=False)
                self._bytes -= evicted.nbytes
