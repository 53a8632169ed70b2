"""The tuned chunk body: scalar per-head decay (GDN, beta in [0, 2]) or none (DeltaNet), one step per token.

Per chunk of C tokens (docs/MATH.md, the chunked form), with ``gamma`` the cumulative log-decay inside the
chunk, q and k normalized:

    Gamma_ij = exp(gamma_i - gamma_j) for i >= j (masked BEFORE exp: no overflow), 0 above
    A = strictly_lower(diag(beta) k k^T * Gamma)                       P = tril(q k^T * Gamma)
    Delta = (I + A)^-1 diag(beta) (v - diag(exp(gamma)) k S)           (= U - W S of the WY form)
    Y = diag(exp(gamma)) q S + P Delta      S <- exp(gamma_C) S + k^T diag(exp(gamma_C - gamma)) Delta

Solving against the residual instead of forming U and W halves the triangular solve and the matmuls
before it (``body.solve_unit_lower``). Only ``exp`` of differences gamma_i - gamma_j, i >= j, is taken.

Covered here: seq- and head-major nodes, any K, V, grouped heads, f16 or f32 operands (``covers``);
general.py writes the rest of the family. The outer structure (split, tail, outputs) is outer.py's.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from nnef_tools.model import Tensor as NTensor

from gdn_export.ops.gated_delta_rule.nnef.capabilities import F32
from gdn_export.ops.gated_delta_rule.nnef.chunked import outer
from gdn_export.ops.gated_delta_rule.nnef.chunked.body import MASKED, Body, mask, solve_masks, solve_unit_lower, write_y
from gdn_export.ops.gated_delta_rule.nnef.chunked.outer import chunk_ones, cumulative_log_decay, scan_layout
from gdn_export.ops.gated_delta_rule.nnef.layout import L2NORM_EPS
from gdn_export.backends.nnef.builder import NnefBuilder
from gdn_export.ops.gated_delta_rule.operands import Dims


# the operands whose whole chunks this body's scan reads cut (``scan_inputs``): q, k, v enter uncut
HEADS_READ = ("beta", "g")


def covers(dims: Dims) -> bool:
    """Whether this body computes the node: scalar decay or none, beta, one step per token (GDN, DeltaNet)."""
    return not dims.channel_decay and not dims.gated_writes and dims.num_householder == 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class Variant(outer.Variant):
    """What the chunk body computes; one fragment per distinct variant."""

    has_decay: bool

    @property
    def name(self) -> str:
        return (f"gdn_export_chunk_c{self.tokens}{'_decay' if self.has_decay else ''}{self.semantics}_h{self.heads}"
                f"_k{self.width_k}_v{self.width_v}_hk{self.key_heads}")


def variant(node, dims: Dims, tokens: int) -> Variant:
    return Variant.of(node, dims, tokens, has_decay=node.g is not None)


def scan_inputs(b: NnefBuilder, variant: Variant, heads: dict[str, NTensor], whole: dict[str, NTensor], dims: Dims):
    """The scan's inputs, ``name: (tensor, axis, step)``, a per-chunk one first (outer.chunk_scan). Seq-major q,
    k, v enter as they are, ``[B, T, H, X]``, scanned C tokens at a time along T."""
    c, t, grouped = variant.tokens, variant.token_axis, variant.grouped
    f32 = lambda x: b.cast(x, F32)  # noqa: E731
    layout = lambda x, groups: scan_layout(b, x, variant.head_major, groups, grouped)  # noqa: E731
    if variant.head_major:
        scanned = {name: (layout(whole[name], 1), t, c) for name in ("q", "k")}
        scanned["v"] = (layout(whole["v"], dims.groups), t, c)
    else:
        scanned = {name: (f32(whole[name]), 1, c) for name in ("q", "k", "v")}
        scanned["vbeta"] = (b.unsqueeze(f32(heads["beta"]), [3]), 1, c)
    beta = layout(heads["beta"], dims.groups)
    if variant.has_decay:
        gamma, end, left, right = cumulative_decay(b, layout(heads["g"], dims.groups), c)
        per_chunk = {"end": (end, t, 1)}
        scanned.update(gamma=(gamma, t, c), left=(left, t, c), right=(right, t + 1, c))
    else:
        per_chunk = {"one": (chunk_ones(b, beta, c), t, 1)}
    scanned["beta"] = (beta, t, c)
    return {**per_chunk, **scanned}


def masks(variant: Variant) -> dict[str, np.ndarray]:
    """Masks the body reads (full scan inputs), broadcastable against its tensors."""
    lower, rank = np.tril(np.ones((variant.tokens, variant.tokens))), variant.token_axis + 2
    return {
        "causal": mask(lower, rank),  # the readout's mask without decay
        "causal_log": mask(np.where(lower > 0, 0.0, MASKED), rank),  # added before exp: masked entries become exactly 0
        **solve_masks(variant.tokens, variant.token_axis),
    }


def cumulative_decay(b: NnefBuilder, g: NTensor, chunk: int):
    """From ``g [.., N*C, 1]`` (scan_layout's): per-chunk cumulative sums ``gamma`` (same shape), each chunk's total
    ``[.., N, 1]``, and ``left = [gamma, 1]`` ``[.., N*C, 2]``, ``right = [1; -gamma^T]`` ``[.., 2, N*C]`` whose
    product in the body is ``gamma_i - gamma_j`` (one rounding, as a subtraction).

    Computed before the scan: tract 0.23.9 fails to load a body holding a matmul of a constant by a scan
    input (it tries to pull it out of the loop), and a broadcast difference in the body takes its slow
    path. Tiny tensors (one value per token and head): no speed concern here. Assumes finite g."""
    gamma, end = cumulative_log_decay(b, g, chunk)
    t = len(g.shape) - 2
    ones = b.binary("add", b.binary("mul", gamma, b.scalar(0.0, F32)), b.scalar(1.0, F32))
    left = b.op("concat", [gamma, ones], shape=(*gamma.shape[:t + 1], 2), attribs={"axis": t + 1})  # [gamma_i, 1]
    right = b.op("concat", [ones, b.unary("neg", gamma)], shape=(*gamma.shape[:t + 1], 2), attribs={"axis": t + 1})
    return gamma, end, left, b.transpose(right, [*range(t), t + 1, t])  # [1; -gamma_j]


def lines(variant: Variant) -> list[str]:
    """One chunk. Inputs: ``q_t, k_t, v_t``, seq-major ``[B, C, Hk|H, K|V]`` with ``vbeta_t [B, C, H, 1]``, or
    head-major ``[B, H, C, K|V]`` (grouped heads: ``[B, Hk, 1|G, C, K|V]``); ``beta_t [B, H, C, 1]`` (``[B, Hk, G,
    C, 1]``; every tensor below likewise); with decay ``gamma_t [.., C, 1]``, ``end_t [.., 1, 1]``, ``left_t [..,
    C, 2]``, ``right_t [.., 2, C]``; the masks; ``s_prev [B, H, K, V]``. Outputs ``s_t`` and ``y_t`` (in the
    node's layout). No tensor has a size-1 axis but those of the per-token and per-chunk gates and, with grouped
    heads, the key tensors' group axis (outer.scan_layout says why).

    k and q are stacked along the tokens first, so one RMS norm normalizes both (``l2norm(x) =
    rms_norm(x, eps / K) / sqrt(K)``, exact scaling where sqrt(K) is a power of two, K a power of four) and one matmul reads the state for
    ``k S`` and ``q S``; the stack is cut on a block axis of a reshaped view (tract 0.23.9 pushes a slice of the
    token axis back through the norm onto the scan input and pulls it out of the loop). Every constant factor
    (1/sqrt(K), q's scale) rides on a per-token column or on the C x C decay matrix, so no [C, K] tensor is
    rescaled. Seq-major q, k are read in place by ``tract_core_einsum`` (its packing takes the strides)."""
    x = Body()
    seq_major, width, c, key_heads = not variant.head_major, variant.width_k, variant.tokens, variant.key_heads
    t, grouped = variant.token_axis, variant.grouped
    token_axis = 1 if seq_major else t
    stacked = x(f"concat([k_t, q_t], axis = {token_axis})")  # [B, 2C, Hk, K] or [B, Hk, (1,) 2C, K]
    root = 1.0
    if variant.l2norm:
        stacked = x(f"tract_core_rms_norm({stacked}, axis = {3 if seq_major else t + 1}, eps = {L2NORM_EPS / width!r})")
        root = float(1.0 / np.sqrt(width))  # what rms_norm leaves to multiply: l2norm = rms_norm / sqrt(K)
    q_scale = root * float(variant.scale if variant.scale is not None else 1.0)
    view = x(f"reshape({stacked}, shape = [2, {c}], axis_start = {token_axis}, axis_count = 1)")

    def half(index: int) -> str:
        cut = x(f"slice({view}, axes = [{token_axis}], begin = [{index}], end = [{index + 1}])")
        return x(f"reshape({cut}, shape = [{c}], axis_start = {token_axis}, axis_count = 2)")

    k = half(0)  # q is only read stacked with k
    g = "g" if grouped else ""  # the group axis of the einsums' state operands
    if seq_major:  # [B, C, Hk, K] read in place
        def pairs(a: str, b: str) -> str:
            products = x(f"tract_core_einsum([{a}, {b}], expr = \"bihk,bjhk->bhij\", acc = \"f32\")")  # [B, Hk, ., C]
            return x(f"reshape({products}, shape = [{key_heads}, 1], axis_start = 1, axis_count = 1)") if grouped \
                else products
        with_state = x(f"tract_core_einsum([{stacked}, s_prev], expr = \"bchk,bh{g}kv->bh{g}cv\", acc = \"f32\")")
        written_value = heads_first(x, x("v_t * vbeta_t"), key_heads, variant.heads // key_heads)
    else:  # [B, H, C, X] or [B, Hk, 1|G, C, X]
        pairs = lambda a, b: x(f"matmul({a}, {b}, transposeB = true)")  # noqa: E731
        with_state = x(f"matmul({stacked}, s_prev)")
        written_value = x("v_t * beta_t")
    # k k^T and q k^T in one product of the stacked [k; q] by k (k packed once), cut on a block axis
    both = x(f"reshape({pairs(stacked, k)}, shape = [2, {c}], axis_start = {t}, axis_count = 1)")  # [.., 2, C, C]
    key_products, readout = (x(f"reshape(slice({both}, axes = [{t}], begin = [{i}], end = [{i + 1}]), shape = [{c}], "
                               f"axis_start = {t}, axis_count = 2)") for i in (0, 1))  # [.., C, C]
    states = x(f"reshape({with_state}, shape = [2, {c}], axis_start = {t}, axis_count = 1)")  # [.., 2, C, V]
    key_state, query_state = (x(f"reshape(slice({states}, axes = [{t}], begin = [{i}], end = [{i + 1}]), shape = [{c}], "
                                f"axis_start = {t}, axis_count = 2)") for i in (0, 1))
    # k k^T carries 1/root^2 too much: beta takes it
    beta = x(f"beta_t * {root * root!r}") if root != 1.0 else "beta_t"
    if variant.has_decay:
        decay = x("exp(matmul(left_t, right_t) + causal_log)")  # Gamma_ij = exp(gamma_i - gamma_j), 0 for i < j
        state_to_token = x("exp(gamma_t)")
        erase = x(f"beta_t * {state_to_token}")
        token_to_end = x("exp(end_t - gamma_t)")
        a = x(f"{key_products} * {beta} * {decay}")
    else:
        decay, state_to_token, erase, token_to_end = "causal", None, x("beta_t * one_t"), None
        a = x(f"{key_products} * {beta}")  # only the strictly lower part is read
    readout = x(f"{readout} * {decay}")
    readout = x(f"{readout} * {q_scale * root!r}") if q_scale * root != 1.0 else readout
    q_factor = scaled_factor(x, state_to_token, q_scale)  # rows of q S
    erase = scaled_factor(x, erase, root)  # rows of k S in the residual
    key_factor = scaled_factor(x, token_to_end, root)  # rows of Delta in the state update
    # Delta = (I + A)^-1 diag(beta) (v - exp(gamma) k S): one solve per chunk, against the residual
    residual = x(f"{written_value} - {erase} * {key_state}")  # [B, H, C, V] or [B, Hk, G, C, V]
    delta = solve_unit_lower(x, a, residual, c, t)
    y = f"{x.times(query_state, q_factor)} + matmul({readout}, {delta})"  # [B, H, C, V] or [B, Hk, G, C, V]
    scaled = x.times(delta, key_factor)
    decayed = x.times("s_prev", x("exp(end_t)") if variant.has_decay else None)
    # written as update + s: tract fuses the add into the matmul's output (no extra pass over the state)
    if seq_major:
        update = x(f"tract_core_einsum([{k}, {scaled}], expr = \"bchk,bh{g}cv->bh{g}kv\", acc = \"f32\")")
    else:
        update = x(f"matmul({k}, {scaled}, transposeA = true)")
    x(f"{update} + {decayed}", "s_t")
    write_y(x, y, variant.head_major, grouped, variant.heads)
    return x.lines


def scaled_factor(x: Body, factor: str | None, constant: float) -> str | None:
    """``factor * constant`` as a body value or literal (None when it is 1)."""
    if constant == 1.0:
        return factor
    return repr(constant) if factor is None else x(f"{factor} * {constant!r}")


def heads_first(x: Body, value: str, key_heads: int, groups: int) -> str:
    """``[B, C, H, X]`` -> ``[B, H, C, X]``, with grouped heads ``[B, Hk, G, C, X]``."""
    if groups == 1:
        return x(f"transpose({value}, axes = [0, 2, 1, 3])")
    split = x(f"reshape({value}, shape = [{key_heads}, {groups}], axis_start = 2, axis_count = 1)")
    return x(f"transpose({split}, axes = [0, 2, 3, 1, 4])")
