"""Prefill lowering for the rest of the family: the chunked form of FAMILY.md section 6 in general.

``chunked.py`` holds the tuned body for scalar decay with beta and one step per token (GDN, DeltaNet);
this module covers what it does not, with the same outer structure (a scan over chunks of real tokens,
then the per-token tail of ``chunked.py``, so a decode token is never padded to a chunk):

- erase/write gates (GDN2): the erased key ``e = b*k`` and written value ``u = w*v`` replace ``beta*k`` and
  ``beta*v`` (beta is the special case ``b = w = beta``);
- Householder sub-steps (Gated DeltaProduct): a chunk of ``Cr`` tokens holds ``c = n*Cr`` sub-steps, each a
  virtual token of the plain recurrence; the decay applies at the first sub-step of a token, q is read
  after the last, so q and the cumulative decay are repeated n times and y is taken at every n-th row;
- per-channel decay (KDA, GDN2): see ``channel_decay_pairs``.

Per chunk, with ``G`` the cumulative log-decay inside the chunk (per head or per key channel):

    A_ij = sum_k e_i k_j exp(G_i - G_j)  (i > j)       P_ij = sum_k q_i k_j exp(G_i - G_j)  (i >= j)
    Delta = (I + A)^-1 (U - (E * exp G) S)                 (forward substitution, ``chunked.solve_unit_lower``)
    Y = (Q * exp G) S + P Delta        S <- exp(G_C) * S + (K * exp(G_C - G))^T Delta

Every exponent is of a difference ``G_i - G_j`` with ``i >= j`` or of ``G`` itself, all <= 0 (g <= 0): no
factor can overflow, whatever the decay.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from nnef_tools.model import Tensor as NTensor
from torch_to_nnef.op.fragment import Fragment

from gdn_export.lowering import chunked
from gdn_export.lowering.capabilities import F32
from gdn_export.lowering.chunked import MASKED, SOLVE_BLOCK, Body, solve_unit_lower
from gdn_export.lowering.layout import L2NORM_EPS, step_operands
from gdn_export.lowering.nnef_builder import NnefBuilder
from gdn_export.lowering.operands import Dims

# per-channel decay: chunks of 32 tokens cut into exact [4, 4, K] decay blocks (channel_decay_pairs). Measured
# (KDA, H=16, K=V=128, S=1024, bench_lowerings --variants): chunk 64 with blocks of 32/16/8/4: 619/267/195/223 ms,
# chunk 32 with blocks of 8/4: 160/142 ms; the scan takes ~480 ms
CHANNEL_CHUNK = 32
SUB_BLOCK = 4

def refusal(dims: Dims) -> str | None:
    """Why this module's body would not compute the node (None: it does)."""
    if dims.channel_decay and dims.num_householder != 1:
        return "per-channel decay with Householder sub-steps has no chunked form here; use the scan"
    return None


def token_chunk(dims: Dims, chunk: int | None = None) -> int:
    """Real tokens per chunk, Cr: ``c = n * Cr`` sub-steps must be a multiple of the solve block, and at least
    the chunk size when n divides it (``chunk``, by default 64, or ``CHANNEL_CHUNK`` with per-channel decay)."""
    chunk = chunk or (CHANNEL_CHUNK if dims.channel_decay else chunked.CHUNK)
    n = dims.num_householder
    unit = SOLVE_BLOCK // math.gcd(SOLVE_BLOCK, n)  # tokens per solve-block multiple
    return unit * max(1, -(-chunk // (unit * n)))


@dataclasses.dataclass(frozen=True)
class Variant:
    """What the chunk body computes; one fragment per distinct variant."""

    tokens: int  # Cr
    steps: int  # n
    decay: str  # "none", "head", "channel"
    gated: bool  # erase/write gates instead of beta
    l2norm: bool
    scale: float | None
    head_major: bool
    key_heads: int
    heads: int
    width_k: int
    width_v: int

    @property
    def substeps(self) -> int:
        return self.tokens * self.steps

    @property
    def name(self) -> str:
        scale = "none" if self.scale is None else repr(float(self.scale)).replace(".", "p").replace("-", "m").replace("+", "")
        return (f"gdn_export_chunkg_c{self.tokens}_n{self.steps}_{self.decay}{'_gates' if self.gated else ''}"
                f"{'_l2' if self.l2norm else ''}_s{scale}_{'hm' if self.head_major else 'sm'}_hk{self.key_heads}"
                f"_h{self.heads}_k{self.width_k}_v{self.width_v}")


def lower(b: NnefBuilder, node, dims: Dims, tokens: int) -> list:
    """Write the chunked lowering of ``node`` (which ``refusal`` accepted), ``tokens`` (``token_chunk``) real
    tokens a chunk; return the fragments it uses."""
    n = dims.num_householder
    variant = Variant(tokens, n, "channel" if dims.channel_decay else "head" if dims.has_decay else "none",
                      dims.gated_writes, node.use_qk_l2norm, node.scale, node.head_major, dims.key_heads, dims.heads,
                      dims.width_k, dims.width_v)
    time_axis = 2 if node.head_major else 1
    raw = {"q": node.q, "k": node.k, "v": node.v, "beta": node.beta, "g": node.g, "erase": node.erase,
           "write": node.write}
    heads, whole, tails = {}, {}, {}
    for name, x in raw.items():
        if x is None:
            continue
        if n > 1 and name in ("k", "v", "beta"):
            # sub-steps on an axis of their own before the cut: tract 0.23.9 gets the length of a reshape of a
            # symbolic tail wrong (S - 64*(S/32) for (2S - 64*(S/32)) / 2)
            x = b.split_axis(x, time_axis, [-1, n])
        whole[name] = x
        heads[name], tails[name] = chunked.split_like(b, x, node.q, time_axis, variant.tokens)
    s0 = b.unsqueeze(b.split_axis(b.cast(node.s0, F32), 1, [dims.key_heads, dims.groups]), [0])  # [1, B, Hk, G, K, V]
    y_head, state, scan = chunk_part(b, variant, heads, whole, s0, dims)
    tail_ops = step_operands(b, dataclasses.replace(node, **tails), dims, substeps_split=n > 1)
    y_tail, final = chunked.token_part(b, tail_ops, state, dims)
    chunked.write_outputs(b, node, dims, y_head, y_tail, final)
    return [chunked.SPLIT, chunked.FINAL, chunked.PAD, chunked.TAKE, scan,
            chunked.tail_fragment(n, tail_ops.log_decay is not None)]


def chunk_part(b: NnefBuilder, variant: Variant, heads: dict[str, NTensor], whole: dict[str, NTensor], s0: NTensor,
               dims: Dims):
    """The chunk scan, the state after it, and its fragment. The per-chunk inputs (built from the operands cut
    to whole chunks, ``heads``) come first, so the scan runs one step per whole chunk; the per-token inputs are
    the uncut operands (``whole``), of which it reads no more (see chunked.chunk_part)."""
    cr = variant.tokens
    layout = lambda name, groups: chunked.scan_layout(b, whole[name], variant.head_major, groups)  # noqa: E731
    q = layout("q", 1)  # [1, B, Hk, 1, T, K]
    q_head = chunked.scan_layout(b, heads["q"], variant.head_major, 1)  # [1, B, Hk, 1, N*Cr, K]
    first_channel = b.op("slice", q_head, shape=(*q_head.shape[:5], 1), attribs={"axes": [5], "begin": [0], "end": [1]})
    scanned = {"one": (chunked.chunk_ones(b, first_channel, cr), 4, 1)}  # per chunk first: see chunked.chunk_part
    if variant.decay != "none":
        gamma, end = chunked.cumulative_log_decay(b, chunked.scan_layout(b, heads["g"], variant.head_major, dims.groups), cr)
        scanned["end"] = (end, 4, 1)
        scanned["gamma"] = (gamma, 4, cr)
    scanned["q"] = (q, 4, cr)
    substep = lambda name, groups: chunked.scan_layout(b, whole[name], variant.head_major, groups, True)  # noqa: E731
    per_token = substep if variant.steps > 1 else layout
    scanned["k"] = (per_token("k", 1), 4, cr)
    scanned["v"] = (per_token("v", dims.groups), 4, cr)
    for name in ("erase", "write") if variant.gated else ("beta",):
        scanned[name] = (per_token(name, dims.groups), 4, cr)
    masks = {name: b.constant(name, value) for name, value in constants(variant).items()}
    fragment = scan_fragment(variant, {name: tuple(axis_chunk) for name, (_, *axis_chunk) in scanned.items()}, tuple(masks))
    batch, steps = heads["q"].shape[0], heads["q"].shape[2 if variant.head_major else 1]
    shape = (batch, dims.heads, steps, dims.width_v) if variant.head_major else (batch, steps, dims.heads, dims.width_v)
    y = b.tensor("chunk_y", shape, F32)
    states = b.tensor("chunk_states", (steps // cr, *s0.shape[1:]), F32)
    b.multi_op(fragment.name, (*(x for x, *_ in scanned.values()), *masks.values(), s0), (y, states))
    return y, chunked.final_state(b, s0, states), fragment


def constants(variant: Variant) -> dict[str, np.ndarray]:
    """Masks added (log space, before exp) or multiplied in the body, shaped to broadcast at their use."""
    c = variant.substeps
    lower = np.tril(np.ones((c, c)))
    found = {name: value for name, value in chunked.constants(c).items()
             if name.startswith("join") or name == "identity"}
    if variant.decay == "channel":
        s, blocks = SUB_BLOCK, c // SUB_BLOCK
        sub_lower = np.tril(np.ones((s, s)))
        found["sub_causal_log"] = np.where(sub_lower > 0, 0.0, MASKED).reshape((1,) * 5 + (s, s, 1))
        past = np.arange(c)[None, :] < (np.arange(blocks) * s)[:, None]  # token j precedes block I
        found["past_log"] = np.where(past, 0.0, MASKED).reshape((1,) * 4 + (blocks, c, 1))
        found["block_eye"] = np.eye(blocks).reshape((1,) * 4 + (blocks, 1, blocks, 1))
    elif variant.decay == "head":
        found["causal_log"] = np.where(lower > 0, 0.0, MASKED).reshape((1,) * 4 + (c, c))
    else:
        found["causal"] = lower.reshape((1,) * 4 + (c, c))
    return {name: np.asarray(value, np.float32) for name, value in found.items()}


def body(variant: Variant) -> list[str]:
    """One chunk, every operand ``[1, B, Hk, G|1, steps, X]``; outputs ``s_t`` and ``y_t`` (node layout)."""
    x = Body()
    cr, n, c = variant.tokens, variant.steps, variant.substeps
    # every scan input is first combined with another one (one_t): tract 0.23.9 moves a body op whose only
    # varying input is one scan input out of the loop (and fails to load some of them)
    q = x("q_t * one_t")

    def substeps(name: str) -> str:
        """A per-sub-step input, pinned; ``[.., Cr, n, X]`` merged to ``[.., n*Cr, X]`` (a static reshape)."""
        pinned = x(f"{name}_t * one_t")
        return pinned if n == 1 else x(f"reshape({pinned}, shape = [{c}], axis_start = 4, axis_count = 2)")

    k, v = substeps("k"), substeps("v")
    if variant.l2norm:
        q, k = (x(f"{t} * rsqrt(sum_reduce({t} * {t}, axes = [5]) + {L2NORM_EPS!r})") for t in (q, k))
    if variant.scale is not None and variant.scale != 1.0:
        q = x(f"{q} * {float(variant.scale)!r}")
    if variant.gated:
        e, u = x(f"{k} * (erase_t * one_t)"), x(f"{v} * (write_t * one_t)")
    else:
        beta = substeps("beta")
        e, u = x(f"{k} * {beta}"), x(f"{v} * {beta}")

    def per_substep(t: str) -> str:
        """``[.., Cr, X]`` -> ``[.., n*Cr, X]``, each token's row repeated for its n sub-steps."""
        if n == 1:
            return t
        rows = x(f"reshape({t}, shape = [{cr}, 1], axis_start = 4, axis_count = 1)")
        return x(f"reshape(concat([{', '.join([rows] * n)}], axis = 5), shape = [{c}], axis_start = 4, axis_count = 2)")

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
            pairs = x(f"exp({gamma} - transpose({gamma}, axes = [0, 1, 2, 3, 5, 4]) + causal_log)")
            a = x(f"matmul({e}, {k}, transposeB = true) * {pairs}")
            p = x(f"matmul({q}, {k}, transposeB = true) * {pairs}")
            decayed = x("s_prev * exp(end_t)")
        else:
            a, p = channel_decay_pairs(x, e, q, k, gamma, c)
            decayed = x("s_prev * transpose(exp(end_t), axes = [0, 1, 2, 3, 5, 4])")  # row k of S by exp(G_C[k])
    residual = x(f"{u} - matmul({e_read}, s_prev)")
    delta = solve_unit_lower(x, a, residual, c)
    y = x(f"matmul({q_read}, s_prev) + matmul({p}, {delta})")  # [1, B, Hk, G, c, V]
    x(f"matmul({k_end}, {delta}, transposeA = true) + {decayed}", "s_t")
    if n > 1:  # the readout after each token's last sub-step
        steps = x(f"reshape({y}, shape = [{cr}, {n}], axis_start = 4, axis_count = 1)")
        y = x(f"reshape(slice({steps}, axes = [5], begin = [{n - 1}], end = [{n}]), shape = [{cr}], axis_start = 4, "
              "axis_count = 2)")
    chunked.write_y(x, y, variant.head_major, cr, variant.heads)
    return x.lines


def channel_decay_pairs(x: Body, e: str, q: str, k: str, gamma: str, c: int) -> tuple[str, str]:
    """A and P for a per-channel decay ``gamma [.., G, c, K]``, exactly and without overflow.

    ``exp(G_i - G_j)`` is a [c, c, K] tensor; factoring it as ``exp(G_i) exp(-G_j)`` overflows as soon as the
    decay inside a chunk passes ~88. So the chunk is cut into blocks of s = SUB_BLOCK tokens:
    - inside a diagonal block, ``exp(G_i - G_j)`` is formed elementwise ([s, s, K] per block, masked before exp);
    - for block row I against the earlier tokens j, with ``R_I`` the cumulative decay just before block I:
      ``exp(G_i - G_j) = exp(G_i - R_I) * exp(R_I - G_j)``, both factors <= 1 since i >= start(I) > j, so one
      matmul per block row of ``e_i exp(G_i - R_I)`` against ``k_j exp(R_I - G_j)`` (masked to j < start(I)).
    An underflowing factor bounds the true product below the same tiny value: exact to f32 rounding."""
    s, blocks = SUB_BLOCK, c // SUB_BLOCK
    cut = lambda t: x(f"reshape({t}, shape = [{blocks}, {s}], axis_start = 4, axis_count = 1)")  # noqa: E731
    g_blocks, k_blocks, e_blocks, q_blocks = cut(gamma), cut(k), cut(e), cut(q)  # [.., nb, s, K]
    rows = lambda t: x(f"reshape({t}, shape = [{s}, 1], axis_start = 5, axis_count = 1)")  # noqa: E731  [.., nb, s, 1, K]
    columns = lambda t: x(f"reshape({t}, shape = [1, {s}], axis_start = 5, axis_count = 1)")  # noqa: E731
    inside = x(f"{columns(k_blocks)} * exp({rows(g_blocks)} - {columns(g_blocks)} + sub_causal_log)")  # [.., nb, s, s, K]
    diagonal = {name: x(f"sum_reduce({rows(t)} * {inside}, axes = [7])") for name, t in (("a", e_blocks), ("p", q_blocks))}
    ends = x(f"slice({g_blocks}, axes = [5], begin = [{s - 1}], end = [{s}])")  # [.., nb, 1, K]
    start = x(f"slice({ends}, axes = [4], begin = [0], end = [1]) * 0.0")
    before = x(f"concat([{start}, slice({ends}, axes = [4], begin = [0], end = [{blocks - 1}])], axis = 4)")  # R_I
    left = x(f"exp({g_blocks} - {before})")  # [.., nb, s, K]
    whole = lambda t: x(f"reshape({t}, shape = [1, {c}], axis_start = 4, axis_count = 1)")  # noqa: E731  [.., 1, c, K]
    right = x(f"{whole(k)} * exp({before} - {whole(gamma)} + past_log)")  # [.., nb, c, K]
    found = []
    for name, t in (("a", e_blocks), ("p", q_blocks)):
        earlier = x(f"matmul({t} * {left}, {right}, transposeB = true)")  # [.., nb, s, c]
        placed = x(f"reshape({diagonal[name]}, shape = [1, {s}], axis_start = 6, axis_count = 2) * block_eye")
        both = x(f"{earlier} + reshape({placed}, shape = [{c}], axis_start = 6, axis_count = 2)")
        found.append(x(f"reshape({both}, shape = [{c}], axis_start = 4, axis_count = 2)"))  # [.., c, c]
    return found[0], found[1]


def scan_fragment(variant: Variant, scanned: dict[str, tuple[int, int]], masks: tuple[str, ...]) -> Fragment:
    return chunked.scan_over_chunks(variant.name, body(variant), scanned, masks, 2 if variant.head_major else 1,
                                    variant.tokens)
