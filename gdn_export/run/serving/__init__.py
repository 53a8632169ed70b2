"""Serving many requests at once over a serving graph (``convert(serving=True)``): ``Engine`` (continuous
batching, one slot per request), its ``SlotPool`` of host-side states and its ``PrefixCache``. docs/SERVING.md."""

from gdn_export.run.serving.engine import Engine
from gdn_export.run.serving.prefix_cache import PrefixCache
from gdn_export.run.serving.slots import SCRATCH, SlotPool, Snapshot

__all__ = ["Engine", "PrefixCache", "SCRATCH", "SlotPool", "Snapshot"]
