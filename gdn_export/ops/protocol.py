"""What every op shares with the pipelines: the record of one decision, and the one signature of ``decide``.

Each op decides, per node and per back-end, how the node is written, with one function of one signature::

    def decide(node: <the op's node facts>, plan: <the back-end's plan>) -> Decision

in the op's back-end module (``ops/<op>/nnef.py``, ``ops/<op>/onnx.py``; the gated delta rule's NNEF one in
``emitter.py``, over the lowerings its registry names). ``node`` is the op's own record of what one node is
(``Node``: its name and entry point, and the facts its rule reads: ``GdnNode``, ``ConvNode``, ``MoeNode``, the
ONNX ``RuleFacts``); ``plan`` is the export's one frozen, validated plan for that back-end
(``ops.options.NnefOptions`` for NNEF, from which an op with options of its own makes its own object,
``GatedDeltaRuleOptions.of``; ``backends.onnx.registry.OnnxOptions`` for ONNX). ``decide`` raises
LoweringError where a requested lowering cannot be exact, and writes nothing: the handler that writes the node
calls it, records the ``Decision`` (``record``), and lowers what it says. The export report and the archive's
``gdn_export.json`` list the Decisions; a pipeline that must know a decision before tracing (which MoE stacks a
Q4_0 export quantizes) calls the same ``decide`` with the facts it has.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, TypeVar


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


class Node(Protocol):
    """What every op's node facts carry: the node's name in the graph (the name of the output it is reported by)
    and its entry point (the ``t2n_extra`` qualname), which its Decision repeats."""

    name: str
    entry: str


N = TypeVar("N", bound=Node, contravariant=True)
P = TypeVar("P", contravariant=True)


class Decide(Protocol[N, P]):
    """The one signature every op's ``decide`` implements, per back-end: ``decide(node, plan) -> Decision``."""

    def __call__(self, node: N, plan: P, /) -> Decision: ...


def record(decide: Decide[N, P], node: N, plan: P, decisions: list[Decision]) -> Decision:
    """The one way a handler asks for a decision: ``decide(node, plan)``, appended to the export's ``decisions``."""
    decision = decide(node, plan)
    decisions.append(decision)
    return decision
