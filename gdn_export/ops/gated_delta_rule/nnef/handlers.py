"""Handlers of the ``t2n_extra::gated_delta_scan`` and ``gated_delta_rule`` nodes: each describes its node as a
``GdnNode`` and emits it (validate, decide, write the chosen lowering).

torch-to-nnef 0.24.12 has its own ``gated_delta_scan`` handler, whose fused-op rules are stale for tract >= 0.23.7;
these replace it for the duration of an export (``backends.compat.torch_to_nnef.conversion``).
"""

from __future__ import annotations

from gdn_export.backends.nnef.registry import custom_op, output_tensors, positional, require_tract
from gdn_export.backends.nnef.builder import NnefBuilder
from gdn_export.ops.gated_delta_rule.nnef import registry
from gdn_export.ops.gated_delta_rule.nnef.emitter import decide
from gdn_export.ops.gated_delta_rule.nnef.node import GdnNode
from gdn_export.ops.options import LoweringOptions, policy_of
from gdn_export.ops.protocol import record


def emit(graph, node: GdnNode, options: LoweringOptions, decisions: list) -> list:
    """Validate, decide (appending the Decision to ``decisions``), write the chosen lowering; return the
    fragments/extensions it needs."""
    decision = record(decide, node, options, decisions)
    builder = NnefBuilder(graph, prefix=node.y.name)
    return registry.get(decision.lowering).lower(builder, node, decision.dims, options)


def emit_for(g, gdn: GdnNode, inference_target) -> list:
    """Hand the node to the emitter with the target's options, recording the decision on the target."""
    target = policy_of(inference_target)
    return emit(g, gdn, target.gdn_options, target.gdn_decisions)


@custom_op("gated_delta_scan")
def handle_gated_delta_scan(g, node, name_to_tensor, op_helper, inference_target, **kwargs):
    """Head-major node with q/k normalized and scaled by the caller."""
    require_tract(inference_target, node.kind)
    q, k, v, gate, beta, s0 = positional(op_helper, node)
    y, s_final = output_tensors(op_helper, node, name_to_tensor)
    gdn = GdnNode(name=y.name, q=q, k=k, v=v, g=gate, beta=beta, s0=s0, y=y, s_final=s_final, head_major=True,
                  use_qk_l2norm=False, scale=None, entry="t2n_extra::gated_delta_scan")
    return emit_for(g, gdn, inference_target)


@custom_op("gated_delta_rule")
def handle_gated_delta_rule(g, node, name_to_tensor, op_helper, inference_target, **kwargs):
    """Seq-major node of any variant that normalizes and scales q/k itself (``gdn_export.gated_delta_rule``)."""
    require_tract(inference_target, node.kind)
    q, k, v, gate, beta, erase, write, s0, scale, use_qk_l2norm, num_householder = positional(op_helper, node)
    y, s_final = output_tensors(op_helper, node, name_to_tensor)
    gdn = GdnNode(
        name=y.name, q=q, k=k, v=v, g=gate, beta=beta, erase=erase, write=write, s0=s0, y=y, s_final=s_final,
        head_major=False, use_qk_l2norm=bool(use_qk_l2norm), scale=float(scale), entry="gated_delta_rule",
        num_householder=int(num_householder),
    )
    return emit_for(g, gdn, inference_target)
