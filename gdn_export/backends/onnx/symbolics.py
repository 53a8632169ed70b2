"""TorchScript-exporter symbolics for the ``t2n_extra`` custom ops.

The gated delta rule and the short conv become *placeholder* nodes of the private domain ``gdn_export``, carrying
every operand and the node's options as attributes; ``gdn_export.backends.onnx.rewrite`` then replaces each one by the
lowering the ONNX decision picked (``gdn_export.ops.gated_delta_rule.onnx``): onnxruntime's contrib op or a
portable ``Scan``; ``moe_ffn`` likewise becomes its dense form. A placeholder never reaches a written file (the
writer refuses one). The traced shape and dtype of each operand ride along as attributes, for the decision.
"""

from __future__ import annotations

import torch
from torch.onnx import symbolic_helper as sh

DOMAIN = "gdn_export"
OPSET = 17  # the default-domain opset of written files (tract's ONNX loader and onnxruntime 1.32 both run it)

_ONNX_DTYPE = {torch.float32: 1, torch.float16: 10, torch.float64: 11}


def _none(value) -> bool:
    return sh._is_none(value)


def _set_like(out, like, rank: int | None = None, dtype=None) -> None:
    """Give a placeholder's output a tensor type (rank and dtype; sizes unknown)."""
    base = like.type()
    try:
        base = base.with_sizes([None] * (rank if rank is not None else len(base.varyingSizes())))
        if dtype is not None:
            base = base.with_dtype(dtype)
        out.setType(base)
    except (AttributeError, RuntimeError, TypeError):
        pass


def _sizes(value) -> list[int]:
    """Traced sizes, -1 for a dynamic axis (B, S)."""
    sizes = sh._get_tensor_sizes(value)
    return [-1 if d is None else int(d) for d in sizes] if sizes is not None else []


def _dtype(value) -> str:
    try:
        return value.type().scalarType() or "Float"
    except (AttributeError, RuntimeError):
        return "Float"


def _placeholder(g, op: str, operands: list, outputs: int, **attributes):
    """One ``gdn_export::<op>`` node; each operand's traced shape and dtype ride along as attributes."""
    shapes = [_sizes(x) for x in operands]
    return g.op(f"{DOMAIN}::{op}", *operands, outputs=outputs,
                ranks_i=[len(s) for s in shapes], shapes_i=[d for s in shapes for d in s],
                dtypes_s=",".join(_dtype(x) for x in operands), **attributes)


def _rule(g, q, k, v, gate, beta, erase, write, s0, scale, use_qk_l2norm, num_householder):
    scale = float(sh._maybe_get_const(scale, "f"))
    norm = int(bool(sh._maybe_get_const(use_qk_l2norm, "b")))
    n = int(sh._maybe_get_const(num_householder, "i"))
    present = "".join("1" if not _none(x) else "0" for x in (gate, beta, erase, write))
    operands = [q, k, v] + [x for x in (gate, beta, erase, write) if not _none(x)] + [s0]
    y, state = _placeholder(g, "GatedDeltaRule", operands, 2, scale_f=scale, use_qk_l2norm_i=norm,
                            num_householder_i=n, present_s=present, head_major_i=0)
    _set_like(y, q, 4)
    _set_like(state, s0, 4, torch.float32)
    return y, state


def _scan(g, q, k, v, gate, beta, s0):
    y, state = _placeholder(g, "GatedDeltaRule", [q, k, v, gate, beta, s0], 2, scale_f=1.0, use_qk_l2norm_i=0,
                            num_householder_i=1, present_s="1100", head_major_i=1)
    _set_like(y, q, 4)
    _set_like(state, s0, 4)
    return y, state


def _conv(g, x, weight, state):
    y, new_state = _placeholder(g, "CausalConv1dUpdate", [x, weight, state], 2)
    _set_like(y, x, 3)
    _set_like(new_state, state, 3)
    return y, new_state


def _moe(g, x, routing, router_weight, gate_proj, up_proj, down_proj, top_k, gate):
    gate_name = sh._maybe_get_const(gate, "s")
    y = _placeholder(g, "MoeFfn", [x, routing, gate_proj, up_proj, down_proj], 1,
                     top_k_i=int(sh._maybe_get_const(top_k, "i")), gate_s=str(gate_name))
    _set_like(y, x, 2)
    return y


def _unflatten(g, x, dim, sizes):
    """``aten::unflatten`` as ``Reshape(x, Concat(Shape(x)[:d], sizes, Shape(x)[d+1:]))``, ``d`` resolved here.

    Why not torch's own symbolic (symbolic_opset13.unflatten): it computes ``d`` in the graph (Add, Mod, Reshape)
    and the exporter's shape inference then gives the Reshape a static output shape: every later ``x.shape`` is
    folded to the traced sizes (Qwen4-Exp's hyper-connections baked B and S into all the reshapes after them).
    The same function; the shape slices use Shape's start/end (opset 15)."""
    rank = sh._get_tensor_rank(x)
    d = sh._maybe_get_const(dim, "i")
    if rank is None or not isinstance(d, int):
        from torch.onnx.symbolic_opset13 import unflatten

        return unflatten(g, x, dim, sizes)
    d %= rank
    parts = ([g.op("Shape", x, start_i=0, end_i=d)] if d > 0 else []) + [sizes]
    if d + 1 < rank:
        parts.append(g.op("Shape", x, start_i=d + 1))
    return g.op("Reshape", x, g.op("Concat", *parts, axis_i=0) if len(parts) > 1 else sizes)


_REGISTERED = False


def register() -> None:
    """Register the symbolics (once per process; for the default-domain opset ``OPSET``)."""
    global _REGISTERED
    if _REGISTERED:
        return
    from torch.onnx import register_custom_op_symbolic

    register_custom_op_symbolic("t2n_extra::gated_delta_rule", _rule, OPSET)
    register_custom_op_symbolic("t2n_extra::gated_delta_scan", _scan, OPSET)
    register_custom_op_symbolic("t2n_extra::causal_conv1d_update", _conv, OPSET)
    register_custom_op_symbolic("t2n_extra::moe_ffn", _moe, OPSET)
    register_custom_op_symbolic("aten::unflatten", _unflatten, OPSET)
    _REGISTERED = True
