"""The emitter: the one place that validates a gated delta-rule node and decides how tract runs it.

Both entry points (the ``t2n_extra`` custom-op handlers and the module extractor) describe their node
as a :class:`GdnNode` and call :func:`emit`. It validates the operands, decides between the registered
lowerings (registry.py: native (module fused.py), scan, recurrent, chunked): the requested one where it can be exact, or for
``lowering="auto"`` the first exact one in the order of the runtime's policy (policy.py); it records the
decision and has the chosen lowering write the node.
"""

from __future__ import annotations

from dataclasses import dataclass

from nnef_tools.model import Graph as NGraph

from gdn_export.errors import LoweringError
from gdn_export.ops.gated_delta_rule import policy, registry
from gdn_export.backends.nnef.builder import NnefBuilder
from gdn_export.ops.gated_delta_rule.nnef.node import GdnNode
from gdn_export.ops.options import LoweringOptions
from gdn_export.ops.gated_delta_rule.registry import LOWERINGS
from gdn_export.ops.gated_delta_rule.operands import Dims, validate_operands

__all__ = ["LOWERINGS", "Decision", "GdnNode", "decide", "emit", "node_dims"]


@dataclass(frozen=True)
class Decision:
    """Which lowering one node got, and why; the export report lists these."""

    node: str
    entry: str
    lowering: str  # a registered lowering's NAME (registry.py); for the short conv, "native" or "portable"
    reason: str
    dims: Dims | None  # None for nodes that are not a gated delta rule (the short conv)

    def summary(self) -> dict:
        return {"node": self.node, "entry": self.entry, "lowering": self.lowering, "reason": self.reason}


def node_dims(node: GdnNode) -> Dims:
    """The node's sizes, its operands validated (OperandError names the first that disagrees)."""
    operands = node.operands()
    return validate_operands(
        {name: t.shape for name, t in operands.items()},
        {name: t.dtype for name, t in operands.items()},
        head_major=node.head_major,
        num_householder=node.num_householder,
    )


def decide(node: GdnNode, dims: Dims, options: LoweringOptions) -> Decision:
    """Pick the lowering for one node: the requested one if it can be exact (else raise), or for "auto" the
    first exact candidate of the runtime's policy."""
    requested = options.lowering
    if requested != "auto":
        lowering = registry.get(requested)
        why_not = lowering.refusal(node, dims, options)
        if why_not is not None:
            raise LoweringError(f"{node.name}: lowering={requested!r} cannot be exact: {why_not}")
        checked = "" if lowering.always_exact else " and exact"
        return Decision(node.name, node.entry, requested,
                        f"requested (lowering={requested!r}){checked}{lowering.note(node, dims, options)}", dims)
    skipped = []
    for name in policy.candidates(options.runtime):
        lowering = registry.get(name)
        why_not = lowering.refusal(node, dims, options)
        if why_not is None:
            chosen = policy.basis(options.runtime, name) + lowering.note(node, dims, options)
            # with no runtime the fallback needs no justification beyond why the earlier ones were refused
            reason = "; ".join(skipped) if options.runtime == "any" and skipped else "; ".join([chosen] + skipped)
            return Decision(node.name, node.entry, name, reason, dims)
        skipped.append(f"{lowering.label} refused: {why_not}")
    raise LoweringError(f"{node.name}: no lowering fits: {'; '.join(skipped)}")  # the scan always fits


def emit(graph: NGraph, node: GdnNode, options: LoweringOptions, decisions: list) -> list:
    """Validate, decide (appending the Decision to ``decisions``), write the chosen lowering; return the
    fragments/extensions it needs."""
    dims = node_dims(node)
    decision = decide(node, dims, options)
    decisions.append(decision)
    builder = NnefBuilder(graph, prefix=node.y.name)
    return registry.get(decision.lowering).lower(builder, node, dims, options)
