"""TorchScript-exporter symbolics: how a ``t2n_extra`` custom op becomes a placeholder node, and their registration.

Each op's ``onnx`` module gives the symbolic of its ``t2n_extra`` ops (``registry.symbolic``): it makes a
*placeholder* node of the private domain ``gdn_export`` (``placeholder_node``), carrying every operand and the
node's options as attributes; ``gdn_export.backends.onnx.rewrite`` then replaces each one by the lowering the op's
ONNX decision picked (the rewriter the op registered with ``registry.placeholder``). A placeholder never reaches a
written file (the writer refuses one). The traced shape and dtype of each operand ride along as attributes, for
the decision. This module names no op of gdn_export; ``aten::unflatten`` is the back-end's own (``_unflatten``).
"""

from __future__ import annotations

from torch.onnx import symbolic_helper as sh

from gdn_export.backends.onnx.registry import SYMBOLICS

DOMAIN = "gdn_export"
OPSET = 17  # the default-domain opset of written files (tract's ONNX loader and onnxruntime 1.32 both run it)

def is_none(value) -> bool:
    """Whether a symbolic's optional operand was given as None."""
    return sh._is_none(value)


def constant(value, kind: str):
    """A constant argument of the op (``kind``: "f", "i", "b", "s", as torch's symbolic helper reads them)."""
    return sh._maybe_get_const(value, kind)


def set_like(out, like, rank: int | None = None, dtype=None) -> None:
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


def placeholder_node(g, op: str, operands: list, outputs: int, **attributes):
    """One ``gdn_export::<op>`` node; each operand's traced shape and dtype ride along as attributes."""
    shapes = [_sizes(x) for x in operands]
    return g.op(f"{DOMAIN}::{op}", *operands, outputs=outputs,
                ranks_i=[len(s) for s in shapes], shapes_i=[d for s in shapes for d in s],
                dtypes_s=",".join(_dtype(x) for x in operands), **attributes)


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


_REGISTERED: set[str] = set()


def register() -> None:
    """Register with torch's exporter every symbolic the ops gave (``registry.SYMBOLICS``, filled when
    ``gdn_export/ops/onnx_handlers.py`` is imported) and the back-end's own ``aten::unflatten``; each once per
    process, for the default-domain opset ``OPSET``."""
    from torch.onnx import register_custom_op_symbolic

    for qualname, symbolic in [*sorted(SYMBOLICS.items()), ("aten::unflatten", _unflatten)]:
        if qualname not in _REGISTERED:
            register_custom_op_symbolic(qualname, symbolic, OPSET)
            _REGISTERED.add(qualname)
