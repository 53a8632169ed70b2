"""Handlers for the ``t2n_extra::gated_delta_scan``, ``gated_delta_rule`` and ``causal_conv1d_update`` nodes.

torch-to-nnef 0.24.12 registers its own ``gated_delta_scan`` handler, whose fused-op rules are stale
for tract >= 0.23.7, and its registry asserts on a second registration. gdn_export therefore replaces
the registry entry outright when it is imported (import order cannot matter: torch-to-nnef's handler
is registered when ``torch_to_nnef.op.extras`` is first imported, which this module does first).
"""

from __future__ import annotations

from torch_to_nnef import torch_graph as tg
from torch_to_nnef.exceptions import T2NErrorNotImplemented
from torch_to_nnef.inference_target import TractNNEF
from torch_to_nnef.op import extras

from gdn_export.ops.causal_conv1d import nnef as conv
from gdn_export.ops.gated_delta_rule.emitter import Decision, emit
from gdn_export.backends.nnef.builder import NnefBuilder
from gdn_export.ops.gated_delta_rule.nnef.node import GdnNode
from gdn_export.ops.causal_conv1d.op import check_conv_operands
from gdn_export.backends.nnef.target import policy_of


def _positional(op_helper, node) -> list:
    """The node's arguments in schema order: NNEF tensors for tensors, Python values for constants (None too)."""
    return [i.data if isinstance(i, tg.PythonConstant) else op_helper.get_or_add_tensor_variable_in_nnef(i)
            for i in node.inputs]


def output_tensors(op_helper, node, name_to_tensor):
    """NNEF tensors for the node's two outputs, under the names torch-to-nnef gave them."""
    from nnef_tools.model import Tensor as NTensor

    outs = []
    for out in node.outputs:
        tensor = NTensor(op_helper.g, name=out.export_name, shape=tuple(out.shape), dtype=out.np_dtype)
        name_to_tensor[out.export_name] = tensor
        outs.append(tensor)
    return outs


def _require_tract(inference_target, kind):
    if not isinstance(inference_target, TractNNEF):
        raise T2NErrorNotImplemented(f"{kind} exports only to tract (got {type(inference_target).__name__})")


def emit_for(g, gdn: GdnNode, inference_target) -> list:
    """Hand the node to the emitter with the target's options, recording the decision on the target."""
    target = policy_of(inference_target)
    return emit(g, gdn, target.gdn_options, target.gdn_decisions)


def handle_gated_delta_scan(g, node, name_to_tensor, op_helper, inference_target, **kwargs):
    """Head-major node with q/k normalized and scaled by the caller."""
    _require_tract(inference_target, node.kind)
    q, k, v, gate, beta, s0 = _positional(op_helper, node)
    y, s_final = output_tensors(op_helper, node, name_to_tensor)
    gdn = GdnNode(name=y.name, q=q, k=k, v=v, g=gate, beta=beta, s0=s0, y=y, s_final=s_final, head_major=True,
                  use_qk_l2norm=False, scale=None, entry="t2n_extra::gated_delta_scan")
    return emit_for(g, gdn, inference_target)


def handle_gated_delta_rule(g, node, name_to_tensor, op_helper, inference_target, **kwargs):
    """Seq-major node of any variant that normalizes and scales q/k itself (``gdn_export.gated_delta_rule``)."""
    _require_tract(inference_target, node.kind)
    q, k, v, gate, beta, erase, write, s0, scale, use_qk_l2norm, num_householder = _positional(op_helper, node)
    y, s_final = output_tensors(op_helper, node, name_to_tensor)
    gdn = GdnNode(
        name=y.name, q=q, k=k, v=v, g=gate, beta=beta, erase=erase, write=write, s0=s0, y=y, s_final=s_final,
        head_major=False, use_qk_l2norm=bool(use_qk_l2norm), scale=float(scale), entry="gated_delta_rule",
        num_householder=int(num_householder),
    )
    return emit_for(g, gdn, inference_target)


def handle_causal_conv1d_update(g, node, name_to_tensor, op_helper, inference_target, **kwargs):
    """The GDN short conv: tract's fused conv op where the target has it, else portable slices."""
    _require_tract(inference_target, node.kind)
    x, weight, state = _positional(op_helper, node)
    check_conv_operands(x.shape, weight.shape, state.shape)
    y, new_state = output_tensors(op_helper, node, name_to_tensor)
    target = policy_of(inference_target)
    lowering, reason = conv.decide(target.gdn_options)
    target.gdn_decisions.append(Decision(y.name, "t2n_extra::causal_conv1d_update", lowering, reason, None))
    return conv.lower(NnefBuilder(g, y.name), x, weight, state, y, new_state, lowering)


HANDLERS = {
    "gated_delta_scan": handle_gated_delta_scan,
    "gated_delta_rule": handle_gated_delta_rule,
    "causal_conv1d_update": handle_causal_conv1d_update,
}
extras._T2N_EXTRA_REGISTRY._registry.update(HANDLERS)
