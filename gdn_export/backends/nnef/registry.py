"""How an op reaches the NNEF back-end: its torch-to-nnef handler registered by ``t2n_extra`` name (the
``custom_op`` decorator), and what every handler needs from torch-to-nnef. The back-end names no op: each op's
``nnef`` module registers itself when imported (``gdn_export/ops/nnef_handlers.py`` imports them all), and the
export hands ``CUSTOM_OPS`` to ``backends.compat.torch_to_nnef.conversion`` for the duration of the export.
"""

from __future__ import annotations

from typing import Callable

from torch_to_nnef import torch_graph as tg
from torch_to_nnef.exceptions import T2NErrorNotImplemented
from torch_to_nnef.inference_target import TractNNEF

from gdn_export.backends.registration import registrar

# t2n_extra op name -> torch-to-nnef handler (g, node, name_to_tensor, op_helper, inference_target, **kwargs)
CUSTOM_OPS: dict[str, Callable] = {}


def custom_op(name: str) -> Callable[[Callable], Callable]:
    """Register the decorated function as the handler of ``t2n_extra::<name>`` nodes."""

    return registrar(CUSTOM_OPS, name, f"t2n_extra::{name} has two handlers")


def positional(op_helper, node) -> list:
    """The node's arguments in schema order: NNEF tensors for tensors, Python values for constants (None too)."""
    return [i.data if isinstance(i, tg.PythonConstant) else op_helper.get_or_add_tensor_variable_in_nnef(i)
            for i in node.inputs]


def output_tensors(op_helper, node, name_to_tensor):
    """NNEF tensors for the node's outputs, under the names torch-to-nnef gave them."""
    from nnef_tools.model import Tensor as NTensor

    outs = []
    for out in node.outputs:
        tensor = NTensor(op_helper.g, name=out.export_name, shape=tuple(out.shape), dtype=out.np_dtype)
        name_to_tensor[out.export_name] = tensor
        outs.append(tensor)
    return outs


def require_tract(inference_target, kind) -> None:
    if not isinstance(inference_target, TractNNEF):
        raise T2NErrorNotImplemented(f"{kind} exports only to tract (got {type(inference_target).__name__})")
