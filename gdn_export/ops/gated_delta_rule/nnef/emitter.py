"""The emitter: the one place that validates a gated delta-rule node and decides how tract runs it.

Both entry points (the ``t2n_extra`` custom-op handlers and the module extractor) describe their node
as a :class:`GdnNode` and call ``nnef.handlers.emit``, which validates the operands, decides between the registered
lowerings (registry.py: native (module fused.py), scan, recurrent, chunked): the requested one where it can be exact, or for
``lowering="auto"`` the first exact one in the order of the runtime's policy (policy.py); it records the
decision and has the chosen lowering write the node.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gdn_export.errors import LoweringError
from gdn_export.ops.gated_delta_rule.nnef import policy, registry
from gdn_export.ops.gated_delta_rule.operands import Dims, validate_operands
from gdn_export.ops.gated_delta_rule.nnef.registry import LOWERINGS
from gdn_export.ops.protocol import Decision

if TYPE_CHECKING:
    from gdn_export.ops.gated_delta_rule.nnef.node import GdnNode
    from gdn_export.ops.options import LoweringOptions

__all__ = ["LOWERINGS", "Decision", "decide", "node_dims"]


def node_dims(node: GdnNode) -> Dims:
    """The node's sizes, its operands validated (OperandError names the first that disagrees)."""
    operands = node.operands()
    return validate_operands(
        {name: t.shape for name, t in operands.items()},
        {name: t.dtype for name, t in operands.items()},
        head_major=node.head_major,
        num_householder=node.num_householder,
    )


def decide(node: GdnNode, options: LoweringOptions) -> Decision:
    """Pick the lowering for one node (``ops.protocol.Decide``): its operands validated (``node_dims``; the
    Decision carries the Dims), the requested lowering if it can be exact (else raise), or for "auto" the first
    exact candidate of the runtime's policy."""
    dims = node_dims(node)
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
