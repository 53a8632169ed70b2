"""Module extractor for :class:`gdn_export.GatedDeltaRule`: the reified module becomes one emitter node."""

from __future__ import annotations

from torch_to_nnef import torch_graph as tg
from torch_to_nnef.exceptions import T2NErrorNotImplemented
from torch_to_nnef.op import helper
from torch_to_nnef.op.custom_extractors.base import ModuleInfoExtractor

from gdn_export.backends.nnef.registry import require_tract
from gdn_export.ops.gated_delta_rule.nnef.handlers import emit_for
from gdn_export.ops.gated_delta_rule.nnef.node import GdnNode
from gdn_export.ops.gated_delta_rule.op import GatedDeltaRule, default_scale


class GatedDeltaRuleExtractor(ModuleInfoExtractor):
    MODULE_CLASS = GatedDeltaRule

    @staticmethod
    def _call_original_mod_with_args(mod, *args):
        # the tracer keeps tensor arguments only: without a decay (g=None, DeltaNet) five are left
        return mod(*args[:3], None, *args[3:]) if len(args) == 5 else mod(*args)

    def convert_to_nnef(self, g, node, name_to_tensor, null_ref, torch_graph, inference_target, **kwargs):
        require_tract(inference_target, "GatedDeltaRule")
        tensors = [i for i in node.inputs if isinstance(i, tg.TensorVariable)]
        if len(tensors) not in (5, 6) or len(node.outputs) != 2:
            raise T2NErrorNotImplemented(
                f"GatedDeltaRule expects (q, k, v, g or None, beta, initial_state) -> (o, state), got "
                f"{len(tensors)} tensor inputs and {len(node.outputs)} outputs"
            )
        operands = [helper.get_or_add_tensor_variable_in_nnef(g, t, name_to_tensor) for t in tensors]
        if len(operands) == 5:  # g=None: no decay
            operands.insert(3, None)
        q, k, v, gate, beta, s0 = operands
        outputs = list(node.outputs)
        # the tracer lists module outputs in escape order; the state is the one shaped like s0
        if list(outputs[0].shape) == list(s0.shape) and list(outputs[1].shape) != list(s0.shape):
            outputs.reverse()
        y, s_final = (
            helper.add_tensor_variable_node_as_nnef_tensor(g, out, name_to_tensor, prevent_variable=True)
            for out in outputs
        )
        module: GatedDeltaRule = node.op_ref
        scale = default_scale(q.shape[-1]) if module.scale is None else float(module.scale)
        gdn = GdnNode(
            name=y.name, q=q, k=k, v=v, g=gate, beta=beta, s0=s0, y=y, s_final=s_final, head_major=False,
            use_qk_l2norm=module.use_qk_l2norm, scale=scale, entry="GatedDeltaRule module",
            num_householder=module.num_householder,
        )
        return emit_for(g, gdn, inference_target)
