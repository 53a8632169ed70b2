"""The emitter: the one place that validates a gated delta-rule node and decides how tract runs it.

Both entry points (the ``t2n_extra`` custom-op handlers and the module extractor) describe their node
as a :class:`GdnNode` and call :func:`emit`. It validates the operands, picks the fused operator or the
portable scan from the target's tract version and the node's semantics, records the decision on the
target, and writes the chosen lowering.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from nnef_tools.model import Graph as NGraph
from nnef_tools.model import Tensor as NTensor

from gdn_export.errors import LoweringError
from gdn_export.lowering import chunked, chunked_general, fused, policy, recurrent, scan
from gdn_export.lowering.capabilities import F16, F32, fused_capability
from gdn_export.lowering.nnef_builder import NnefBuilder
from gdn_export.lowering.operands import Dims, validate_operands

LOWERINGS = ("auto", "native", "scan", "recurrent", "chunked")


@dataclass
class GdnNode:
    """One delta-rule node as an entry point hands it over.

    ``use_qk_l2norm`` and ``scale`` are the node's own semantics: the node normalizes q/k itself and
    multiplies q by ``scale`` (None: q is used as given, already normalized and scaled by the caller).
    g is None (no decay), per head or per key channel; beta is None when erase/write gates are given.
    """

    name: str
    q: NTensor
    k: NTensor
    v: NTensor
    g: NTensor | None
    beta: NTensor | None
    s0: NTensor
    y: NTensor  # output tensors, created by the entry point with their final names and dtypes
    s_final: NTensor
    head_major: bool
    use_qk_l2norm: bool
    scale: float | None
    entry: str  # which entry point produced the node, for the report
    erase: NTensor | None = None
    write: NTensor | None = None
    num_householder: int = 1

    def operands(self) -> dict[str, NTensor]:
        given = {"q": self.q, "k": self.k, "v": self.v, "g": self.g, "beta": self.beta, "erase": self.erase,
                 "write": self.write, "s0": self.s0}
        return {name: t for name, t in given.items() if t is not None}


@dataclass(frozen=True)
class Decision:
    """Which lowering one node got, and why; the export report lists these."""

    node: str
    entry: str
    lowering: str  # "native" (tract_transformers_gdn_recurrent) or "scan" (tract_core_scan)
    reason: str
    dims: Dims | None  # None for nodes that are not a gated delta rule (the short conv)

    def summary(self) -> dict:
        return {"node": self.node, "entry": self.entry, "lowering": self.lowering, "reason": self.reason}


def fused_refusal(node: GdnNode, dims: Dims, version: tuple[int, int, int], seq_may_vary: bool,
                  core_f16: bool = False) -> str | None:
    """Why the fused operator would not compute exactly this node on this tract version (None: it would)."""
    capability = fused_capability(version)
    version_name = ".".join(map(str, version))
    if not dims.is_plain_gdn:
        variant = ("no decay gate (DeltaNet)" if not dims.has_decay else "channel-wise decay" if dims.channel_decay
                   else "erase/write gates" if dims.gated_writes else f"{dims.num_householder} Householder sub-steps")
        return f"the fused op computes scalar-gated GDN only; this node has {variant}"
    if capability is None:
        return f"tract {version_name} has no tract_transformers_gdn_recurrent (first in 0.23.5)"
    if not node.use_qk_l2norm or node.scale is None:
        return ("q/k arrive already normalized; the fused op normalizes them again (eps 1e-6), "
                "which is not the same function")
    if not math.isclose(node.scale, 1.0 / math.sqrt(dims.width_k), rel_tol=1e-12):
        return f"scale {node.scale:g} is not 1/sqrt(K) = {1.0 / math.sqrt(dims.width_k):g}, the fused op's"
    if dims.width_k != dims.width_v:
        return f"K={dims.width_k} != V={dims.width_v} (the fused op needs K = V on every version)"
    rule = f"tract {version_name} runs the fused op only for {capability.describe()}"
    if not capability.any_width and dims.width_k != 128:
        return f"{rule}; this node has K = V = {dims.width_k}"
    if not capability.grouped_heads and dims.key_heads != dims.heads:
        return f"{rule}; this node has Hk={dims.key_heads} < H={dims.heads}"
    if not capability.any_sequence_length and (dims.seq != 1 or seq_may_vary):
        return f"{rule}; this node's sequence axis is {'symbolic' if seq_may_vary else dims.seq}"
    if fused_operand_dtype(node, capability.operand_dtypes, core_f16) is None:
        found = sorted({np.dtype(t.dtype).name for t in (node.q, node.k, node.v, node.beta)})
        return f"{rule}; this node has {'/'.join(found)} q/k/v/beta"
    if F32 not in capability.state_dtypes:
        return f"{rule}; the state must be f32"
    return None


def fused_operand_dtype(node: GdnNode, allowed: frozenset, core_f16: bool = False) -> np.dtype | None:
    """The one dtype q, k, v and beta go to the fused op in: their own one, f32 (widening every operand
    is exact), or f16 when the caller asked for an f16 core (rounding: never chosen otherwise)."""
    if core_f16:
        return F16 if F16 in allowed else None
    found = {np.dtype(t.dtype) for t in (node.q, node.k, node.v, node.beta)}
    if len(found) == 1 and next(iter(found)) in allowed:
        return next(iter(found))
    return F32 if F32 in allowed else None


def chunked_refusal(dims: Dims, target) -> str | None:
    """Why the chunked form does not apply: a variant it cannot compute exactly, or a static S that holds
    no whole chunk (nothing to gain, and a scan over zero chunks does not load)."""
    variant = None if chunked.covers(dims) else chunked_general.refusal(dims)
    tokens = chunk_tokens(dims, target)
    if variant is None and not target.seq_may_vary and dims.seq < tokens:
        return f"a static S={dims.seq} holds no chunk of {tokens} tokens"
    return variant


def chunk_tokens(dims: Dims, target) -> int:
    """Tokens per chunk of the chunked form for this node: the target's ``gdn_chunk_size``, or the default of
    the body that computes the node."""
    size = getattr(target, "gdn_chunk_size", None)
    if chunked.covers(dims):
        return size or chunked.CHUNK
    return chunked_general.token_chunk(dims, size)


def decide(node: GdnNode, dims: Dims, target) -> Decision:
    """Pick the lowering for one node: the requested one if it can be exact (else raise), or for "auto" the
    first exact candidate of the runtime's policy (gdn_export/lowering/policy.py)."""
    requested = target.gdn_lowering
    if requested not in LOWERINGS:
        raise LoweringError(f"lowering {requested!r} is not one of {', '.join(LOWERINGS)}")
    if requested in ("scan", "recurrent"):
        return Decision(node.name, node.entry, requested, f"requested (lowering={requested!r})", dims)
    if requested == "chunked":
        why_not = chunked_refusal(dims, target)
        if why_not is not None:
            raise LoweringError(f"{node.name}: lowering='chunked' cannot be exact: {why_not}")
        return Decision(node.name, node.entry, "chunked", f"requested (lowering='chunked') and exact; chunks of "
                        f"{chunk_tokens(dims, target)} tokens", dims)
    core_f16 = getattr(target, "gdn_core_dtype", None) == "float16"
    refusal = fused_refusal(node, dims, target.tract_version, target.seq_may_vary, core_f16)
    rounding = "; q/k/v/beta rounded to float16 (core_dtype='float16' requested: not exact)" if core_f16 else ""
    if requested == "native":
        if refusal is not None:
            raise LoweringError(f"{node.name}: lowering='native' cannot be exact: {refusal}")
        return Decision(node.name, node.entry, "native", "requested (lowering='native') and exact" + rounding, dims)
    runtime = getattr(target, "gdn_runtime", "any")
    skipped = []
    for candidate in policy.candidates(runtime):
        why_not = refusal if candidate == "native" else chunked_refusal(dims, target) if candidate == "chunked" else None
        if why_not is None:
            chosen = ("fused op is exact for this node on this tract" + rounding if candidate == "native"
                      else policy.basis(runtime, candidate))
            if candidate == "chunked":
                chosen += f"; chunks of {chunk_tokens(dims, target)} tokens"
            # with no runtime the fallback needs no justification beyond why the fused op was refused
            reason = "; ".join(skipped) if runtime == "any" and skipped else "; ".join([chosen] + skipped)
            return Decision(node.name, node.entry, candidate, reason, dims)
        skipped.append(f"{'fused op' if candidate == 'native' else candidate} refused: {why_not}")
    raise LoweringError(f"{node.name}: no lowering fits: {'; '.join(skipped)}")  # the scan always fits


def emit(graph: NGraph, node: GdnNode, target) -> list:
    """Validate, decide, write the chosen lowering; return the fragments/extensions it needs."""
    operands = node.operands()
    dims = validate_operands(
        {name: t.shape for name, t in operands.items()},
        {name: t.dtype for name, t in operands.items()},
        head_major=node.head_major,
        num_householder=node.num_householder,
    )
    decision = decide(node, dims, target)
    target.gdn_decisions.append(decision)
    builder = NnefBuilder(graph, prefix=node.y.name)
    if decision.lowering == "native":
        core_f16 = getattr(target, "gdn_core_dtype", None) == "float16"
        operand_dtype = fused_operand_dtype(node, fused_capability(target.tract_version).operand_dtypes, core_f16)
        return fused.lower(builder, node, dims, operand_dtype)
    if decision.lowering == "chunked":
        body = chunked if chunked.covers(dims) else chunked_general
        return body.lower(builder, node, dims, chunk_tokens(dims, target))
    return {"scan": scan, "recurrent": recurrent}[decision.lowering].lower(builder, node, dims)
