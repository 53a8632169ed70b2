"""What every op shares with the pipelines: the record of one decision, and the contract of ``decide``.

Each op decides, per node and per back-end, how the node is written: a function ``decide(<the node's facts>,
options) -> (lowering, reason)`` in the op's back-end module (``ops/<op>/nnef.py``, ``ops/<op>/onnx.py``; the gated
delta rule's in ``emitter.py``, over the lowerings its registry names), reading the export's one frozen plan
(``ops.options.LoweringOptions``). The handler that writes the node records a ``Decision``; the export report and
the archive's ``gdn_export.json`` list them all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Decision:
    """Which lowering one node got, and why; the export report lists these."""

    node: str
    entry: str
    lowering: str  # a registered lowering's NAME (registry.py); for the short conv, "native" or "portable"
    reason: str
    dims: Any | None  # the gated delta rule's Dims; None for the other ops

    def summary(self) -> dict:
        return {"node": self.node, "entry": self.entry, "lowering": self.lowering, "reason": self.reason}
