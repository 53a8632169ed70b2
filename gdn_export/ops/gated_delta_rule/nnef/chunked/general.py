"""The general chunk body: the rest of the family, in the chunked form of docs/MATH.md's generalized recurrence.

gdn.py holds the tuned body for scalar decay with beta and one step per token (GDN, DeltaNet); this body
covers what it does not, inside the same outer structure (outer.py):

- erase/write gates (GDN2): the erased key ``e = b*k`` and written value ``u = w*v`` replace ``beta*k`` and
  ``beta*v`` (beta is the special case ``b = w = beta``);
- Householder sub-steps (Gated DeltaProduct): a chunk of ``Cr`` tokens holds ``c = n*Cr`` sub-steps, each a
  virtual token of the plain recurrence; the decay applies at the first sub-step of a token, q is read
  after the last, so q and the cumulative decay are repeated n times and y is taken at every n-th row;
- per-channel decay (KDA, GDN2): see ``channel_decay_pairs``.

Per chunk, with ``G`` the cumulative log-decay inside the chunk (per head or per key channel):

    A_ij = sum_k e_i k_j exp(G_i - G_j)  (i > j)       P_ij = sum_k q_i k_j exp(G_i - G_j)  (i >= j)
    Delta = (I + A)^-1 (U - (E * exp G) S)                 (forward substitution, ``body.solve_unit_lower``)
    Y = (Q * exp G) S + P Delta        S <- exp(G_C) * S + (K * exp(G_C - G))^T Delta

Every exponent is of a difference ``G_i - G_j`` with ``i >= j`` or of ``G`` itself, all <= 0 (g <= 0): no
factor can overflow, whatever the decay.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from nnef_tools.model import Tensor as NTensor

from gdn_export.ops.gated_delta_rule.nnef.chunked import outer
from gdn_export.ops.gated_delta_rule.nnef.chunked.body import MASKED, Body, solve_masks, solve_unit_lower, write_y
from gdn_export.ops.gated_delta_rule.nnef.chunked.outer import chunk_ones, cumulative_log_decay, scan_layout
from gdn_export.ops.gated_delta_rule.nnef.layout import L2NORM_EPS
from gdn_export.backends.nnef.builder import NnefBuilder
from gdn_export.ops.gated_delta_rule.operands import Dims

SUB_BLOCK = 4  # tokens per exact per-channel decay block (channel_decay_pairs; measured: outer.CHANNEL_CHUNK)


HEADS_READ = None  # scan_inputs reads every operand cut to its whole chunks (outer.py)

def refusal(dims: Dims) -> str | None:
    """Why this body would not compute the node (None: it does)."""
    if dims.channel_decay and dims.num_householder != 1:
        return "per-channel decay with Householder sub-steps has no chunked form here; use the scan"
    return None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Variant(outer.Variant):
    """What the chunk body computes; one fragment per distinct variant (``tokens`` is Cr)."""

    steps: int  # n
    decay: str  # "none", "head", "channel"
    gated: bool  # erase/write gates instead of beta

    @property
    def substeps(self) -> int:
        return self.tokens * self.steps

    @property
    def name(self) -> str:
        return (f"gdn_export_chunkg_c{self.tokens}_n{self.steps}_{self.decay}{'_gates' if self.gated else ''}"
                f"{self.semantics}_hk{self.key_heads}_h{self.heads}_k{self.width_k}_v{self.width_v}")


def variant(node, dims: Dims, tokens: int) -> Variant:
    """``tokens`` (outer.tokens_per_chunk) real tokens a chunk."""
    decay = "channel" if dims.channel_decay else "head" if dims.has_decay else "none"
    return Variant.of(node, dims, tokens, steps=dims.num_householder, decay=decay, gated=dims.gated_writes)


def scan_inputs(b: NnefBuilder, variant: Variant, heads: dict[str, NTensor], whole: dict[str, NTensor], dims: Dims):
    """The scan's inputs, ``name: (tensor, axis, step)``: the per-chunk ones (built from the operands cut to whole
    chunks, ``heads``) first, so the scan runs one step per whole chunk, then the uncut per-token operands
    (``whole``), of which it reads no more (outer.chunk_scan)."""
    cr, t, grouped = variant.tokens, variant.token_axis, variant.grouped
    layout = lambda x, groups, substeps=False: scan_layout(b, x, variant.head_major, groups, grouped,  # noqa: E731
                                                           substeps)
    q = layout(whole["q"], 1)  # [B, H, T, K] or [B, Hk, 1, T, K]
    q_head = layout(heads["q"], 1)  # [.., N*Cr, K]
    first_channel = b.op("slice", q_head, shape=(*q_head.shape[:t + 1], 1),
                         attribs={"axes": [t + 1], "begin": [0], "end": [1]})
    scanned = {"one": (chunk_ones(b, first_channel, cr), t, 1)}
    if variant.decay != "none":
        gamma, end = cumulative_log_decay(b, layout(heads["g"], dims.groups), cr)
        scanned["end"] = (end, t, 1)
        scanned["gamma"] = (gamma, t, cr)
    scanned["q"] = (q, t, cr)
    per_token = lambda name, groups: layout(whole[name], groups, variant.steps > 1)  # noqa: E731
    scanned["k"] = (per_token("k", 1), t, cr)
    scanned["v"] = (per_token("v", dims.groups), t, cr)
    for name in ("erase", "write") if variant.gated else ("beta",):
        scanned[name] = (per_token(name, dims.groups), t, cr)
    return scanned


def masks(variant: Variant) -> dict[str, np.ndarray]:
    """Masks added (log space, before exp) or multiplied in the body, shaped to broadcast at their use."""
    c, t = variant.substeps, variant.token_axis
    lower = np.tril(np.ones((c, c)))
    found = solve_masks(c, t)
    if variant.decay == "channel":
        s, blocks = SUB_BLOCK, c // SUB_BLOCK
        sub_lower = np.tril(np.ones((s, s)))
        found["sub_causal_log"] = np.where(sub_lower > 0, 0.0, MASKED).reshape((1,) * (t + 1) + (s, s, 1))
        past = np.arange(c)[None, :] < (np.arange(blocks) * s)[:, None]  # token j precedes block I
        found["past_log"] = np.where(past, 0.0, MASKED).reshape((1,) * t + (blocks, c, 1))
        found["block_eye"] = np.eye(blocks).reshape((1,) * t + (blocks, 1, blocks, 1))
    elif variant.decay == "head":
        found["causal_log"] = np.where(lower > 0, 0.0, MASKED).reshape((1,) * t + (c, c))
    else:
        found["causal"] = lower.reshape((1,) * t + (c, c))
    return {name: np.asarray(value, np.float32) for name, value in found.items()}


def lines(variant: Variant) -> list[str]:
    """One chunk, every operand ``[B, H, steps, X]`` (grouped heads: ``[B, Hk, G|1, steps, X]``; outer.scan_layout);
    outputs ``s_t`` and ``y_t`` (node layout)."""
    x = Body()
    cr, n, c, t = variant.tokens, variant.steps, variant.substeps, variant.token_axis
    swap = [*range(t), t + 1, t]  # the last two axes exchanged
    # every scan input is first combined with another one (one_t): tract 0.23.9 moves a body op whose only
    # varying input is one scan input out of the loop (and fails to load some of them)
    q = x("q_t * one_t")

    def substeps(name: str) -> str:
        """A per-sub-step input, pinned; ``[.., Cr, n, X]`` merged to ``[.., n*Cr, X]`` (a static reshape)."""
        pinned = x(f"{name}_t * one_t")
        return pinned if n == 1 else x(f"reshape({pinned}, shape = [{c}], axis_start = {t}, axis_count = 2)")

    k, v = substeps("k"), substeps("v")
    if variant.l2norm:
        q, k = (x(f"{u} * rsqrt(sum_reduce({u} * {u}, axes = [{t + 1}]) + {L2NORM_EPS!r})") for u in (q, k))
    if variant.scale is not None and variant.scale != 1.0:
        q = x(f"{q} * {float(variant.scale)!r}")
    if variant.gated:
        e, u = x(f"{k} * (erase_t * one_t)"), x(f"{v} * (write_t * one_t)")
    else:
        beta = substeps("beta")
        e, u = x(f"{k} * {beta}"), x(f"{v} * {beta}")

    def per_substep(u: str) -> str:
        """``[.., Cr, X]`` -> ``[.., n*Cr, X]``, each token's row repeated for its n sub-steps."""
        if n == 1:
            return u
        rows = x(f"reshape({u}, shape = [{cr}, 1], axis_start = {t}, axis_count = 1)")
        return x(f"reshape(concat([{', '.join([rows] * n)}], axis = {t + 1}), shape = [{c}], axis_start = {t}, axis_count = 2)")

    q = per_substep(q)
    if variant.decay == "none":
        a = x(f"matmul({e}, {k}, transposeB = true)")  # only the strictly lower part is read
        p = x(f"matmul({q}, {k}, transposeB = true) * causal")
        e_read, q_read, k_end, decayed = e, q, k, "s_prev"
    else:
        gamma = per_substep(x("gamma_t * one_t"))  # [.., G, c, 1|K]
        decay_in = x(f"exp({gamma})")
        e_read, q_read = x(f"{e} * {decay_in}"), x(f"{q} * {decay_in}")
        k_end = x(f"{k} * exp(end_t - {gamma})")
        if variant.decay == "head":
            pairs = x(f"exp({gamma} - transpose({gamma}, axes = {swap}) + causal_log)")
            a = x(f"matmul({e}, {k}, transposeB = true) * {pairs}")
            p = x(f"matmul({q}, {k}, transposeB = true) * {pairs}")
            decayed = x("s_prev * exp(end_t)")
        else:
            a, p = channel_decay_pairs(x, e, q, k, gamma, c, t)
            decayed = x(f"s_prev * transpose(exp(end_t), axes = {swap})")  # row k of S by exp(G_C[k])
    residual = x(f"{u} - matmul({e_read}, s_prev)")
    delta = solve_unit_lower(x, a, residual, c, t)
    y = f"matmul({q_read}, s_prev) + matmul({p}, {delta})"  # [.., c, V]
    x(f"matmul({k_end}, {delta}, transposeA = true) + {decayed}", "s_t")
    if n > 1:  # the readout after each token's last sub-step
        steps = x(f"reshape({x(y)}, shape = [{cr}, {n}], axis_start = {t}, axis_count = 1)")
        y = (f"reshape(slice({steps}, axes = [{t + 1}], begin = [{n - 1}], end = [{n}]), shape = [{cr}], "
             f"axis_start = {t}, axis_count = 2)")
    write_y(x, y, variant.head_major, variant.grouped, variant.heads)
    return x.lines


def channel_decay_pairs(x: Body, e: str, q: str, k: str, gamma: str, c: int, t: int) -> tuple[str, str]:
    """A and P for a per-channel decay ``gamma [.., c, K]`` (c on axis ``t``), exactly and without overflow.

    ``exp(G_i - G_j)`` is a [c, c, K] tensor; factoring it as ``exp(G_i) exp(-G_j)`` overflows as soon as the
    decay inside a chunk passes ~88. So the chunk is cut into blocks of s = SUB_BLOCK tokens:
    - inside a diagonal block, ``exp(G_i - G_j)`` is formed elementwise ([s, s, K] per block, masked before exp);
    - for block row I against the earlier tokens j, with ``R_I`` the cumulative decay just before block I:
      ``exp(G_i - G_j) = exp(G_i - R_I) * exp(R_I - G_j)``, both factors <= 1 since i >= start(I) > j, so one
      matmul per block row of ``e_i exp(G_i - R_I)`` against ``k_j exp(R_I - G_j)`` (masked to j < start(I)).
    An underflowing factor bounds the true product below the same tiny value: exact to f32 rounding."""
    s, blocks = SUB_BLOCK, c // SUB_BLOCK
    cut = lambda u: x(f"reshape({u}, shape = [{blocks}, {s}], axis_start = {t}, axis_count = 1)")  # noqa: E731
    g_blocks, k_blocks, e_blocks, q_blocks = cut(gamma), cut(k), cut(e), cut(q)  # [.., nb, s, K]
    rows = lambda u: x(f"reshape({u}, shape = [{s}, 1], axis_start = {t + 1}, axis_count = 1)")  # noqa: E731  [.., nb, s, 1, K]
    columns = lambda u: x(f"reshape({u}, shape = [1, {s}], axis_start = {t + 1}, axis_count = 1)")  # noqa: E731
    inside = x(f"{columns(k_blocks)} * exp({rows(g_blocks)} - {columns(g_blocks)} + sub_causal_log)")  # [.., nb, s, s, K]
    diagonal = {name: x(f"sum_reduce({rows(u)} * {inside}, axes = [{t + 3}])")
                for name, u in (("a", e_blocks), ("p", q_blocks))}
    ends = x(f"slice({g_blocks}, axes = [{t + 1}], begin = [{s - 1}], end = [{s}])")  # [.., nb, 1, K]
    start = x(f"slice({ends}, axes = [{t}], begin = [0], end = [1]) * 0.0")
    before = x(f"concat([{start}, slice({ends}, axes = [{t}], begin = [0], end = [{blocks - 1}])], axis = {t})")  # R_I
    left = x(f"exp({g_blocks} - {before})")  # [.., nb, s, K]
    whole = lambda u: x(f"reshape({u}, shape = [1, {c}], axis_start = {t}, axis_count = 1)")  # noqa: E731  [.., 1, c, K]
    right = x(f"{whole(k)} * exp({before} - {whole(gamma)} + past_log)")  # [.., nb, c, K]
    found = []
    for name, u in (("a", e_blocks), ("p", q_blocks)):
        earlier = x(f"matmul({u} * {left}, {right}, transposeB = true)")  # [.., nb, s, c]
        placed = x(f"reshape({diagonal[name]}, shape = [1, {s}], axis_start = {t + 2}, axis_count = 2) * block_eye")
        both = x(f"{earlier} + reshape({placed}, shape = [{c}], axis_start = {t + 2}, axis_count = 2)")
        found.append(x(f"reshape({both}, shape = [{c}], axis_start = {t}, axis_count = 2)"))  # [.., c, c]
    return found[0], found[1]
