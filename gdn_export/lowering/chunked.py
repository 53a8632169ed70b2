"""Prefill lowering: the chunked (WY / UT-transform) form of the delta rule, plus a per-token tail.

The first ``C * floor(S / C)`` tokens run through a ``tract_core_scan`` over chunks of C (``CHUNK``)
tokens; the last ``S mod C`` tokens run through the elementwise per-token step of ``scan.py`` (a decode
step costs one token, never a padded chunk), from the state the chunks leave. Per chunk (FAMILY.md
section 1, "Chunked form"), with ``gamma`` the cumulative log-decay inside the chunk, q and k normalized:

    Gamma_ij = exp(gamma_i - gamma_j) for i >= j (masked BEFORE exp: no overflow), 0 above
    A = strictly_lower(diag(beta) k k^T * Gamma)                       P = tril(q k^T * Gamma)
    Delta = (I + A)^-1 diag(beta) (v - diag(exp(gamma)) k S)           (= U - W S of the WY form)
    Y = diag(exp(gamma)) q S + P Delta      S <- exp(gamma_C) S + k^T diag(exp(gamma_C - gamma)) Delta

Solving against the residual instead of forming U and W halves the triangular solve and the matmuls
before it. ``(I + A)^-1`` is never the nilpotent product (it explodes with correlated keys): block forward
substitution over blocks of ``SOLVE_BLOCK`` tokens, each diagonal block inverted by block doubling. With
beta near 2 and nearly parallel keys (cond(I + A) ~ 2e3), numpy f32 against the float64 oracle (16 seeds):
worst error 5e-5 of max|ref| (blocks of 16 or 32), 1.1e-4 with doubling over the whole chunk, 1.1e-4
when T is formed and then applied. Only ``exp`` of differences gamma_i - gamma_j, i >= j, is taken.

How the graph is shaped by tract 0.23.9 (read in its source, then measured):
- A binary op whose operands share a symbolic shape never gets tract's fast kernels (its "worth it" test
  cannot bound ``S/64`` away from 0) and runs ~10x slower; so does a big copy of a symbolic-length
  tensor. Every per-chunk computation is therefore inside the scan body, where shapes are concrete, and
  the scan slices the raw q, k, v 64 tokens at a time (scan chunk 64: no reshape of a symbolic axis).
- tract pulls a body op out of the loop when its only non-constant input is a scan input (it then runs
  on the whole sequence, slowly), and fails to load a body where such an op is a matmul by a constant
  or reads the same scan input twice. q and k are first concatenated (two inputs: stays in the loop).
- tract pulls the ops writing a "full" output after the loop unless that output's chunk is > 1: y leaves
  with chunk 64, already in the node's layout.
- tract pushes slices of an axis back up through the ops that made it and splits matmuls that read a
  concat into per-piece matmuls (each packing its operands again); blocks are therefore cut on the block
  axis of reshaped views ``[.., n, s, ...]``.
- A slice ending at ``(len / C) * C`` (``tract_core_shape_of``) keeps a symbolic length as ``64*(S/64)``;
  a scan counts its iterations on its first scan input, so a per-chunk input (length ``S/64``) goes first:
  counted on a per-token one the count is ``(63 + 64*(S/64))/64``, which tract never simplifies, and the
  model around the node then cannot prove its lengths equal. The outputs' facts are exactly S.
- A scan of 0 iterations returns a scalar 0 for a "last" output: the chunk scan emits its states as a
  "full" output (the final state is the last of ``initial ++ states[-1:]``), the tail scan always runs at
  least one step (a zero step when S is a multiple of C, which leaves the state exactly as it is).

Covered here: scalar per-head decay (GDN, beta in [0, 2]) and no decay (DeltaNet), seq- and head-major nodes,
any K, V, grouped heads, f16 or f32 operands (``covers``); ``chunked_general`` writes the rest of the family.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from nnef_tools.model import Tensor as NTensor
from torch_to_nnef.op.fragment import Fragment

from gdn_export.lowering.capabilities import F32
from gdn_export.lowering.layout import L2NORM_EPS, step_operands, write_state
from gdn_export.lowering.nnef_builder import NnefBuilder
from gdn_export.lowering.operands import Dims
from gdn_export.lowering.scan import elementwise_step_fragment, step_inputs

CHUNK = 64
SOLVE_BLOCK = 16  # tokens per forward-substitution block: 16 and 32 equally accurate in f32 (16 ~5% faster), 64 (pure doubling) 2x worse
MASKED = -1e30  # added to masked log-decay differences: exp gives exactly 0 for any finite difference
EXTENSIONS = ("tract_registry tract_core",)

SPLIT = Fragment(name="gdn_export_chunk_split", extensions=EXTENSIONS, definition="""fragment gdn_export_chunk_split(
    input: tensor<scalar>, like: tensor<scalar>, axis: integer, chunk: integer
) -> ( head: tensor<scalar>, tail: tensor<scalar> ) {
    # the first chunk*floor(len(like)/chunk) entries of input's axis, and the rest; bounds are shape expressions
    # (a symbolic axis is cut into chunk*(S/chunk) and the rest), and every operand is cut where q's is, so
    # tract knows the parts' lengths equal
    length = squeeze(slice(tract_core_shape_of(like), axes = [0], begin = [axis], end = [axis + 1]), axes = [0]);
    total = squeeze(slice(tract_core_shape_of(input), axes = [0], begin = [axis], end = [axis + 1]), axes = [0]);
    cut = (length / chunk) * chunk;
    head = slice(input, axes = [axis], begin = [0], end = [cut]);
    tail = slice(input, axes = [axis], begin = [cut], end = [total]);
}

""")

FINAL = Fragment(name="gdn_export_final_state", extensions=EXTENSIONS, definition="""fragment gdn_export_final_state(
    initial: tensor<scalar>, states: tensor<scalar>
) -> ( final: tensor<scalar> ) {
    # the last of initial ++ states (initial when there are none), copying two entries at most;
    # the last entry is sliced as [n - 1, n) so that its length simplifies to 1
    length = squeeze(slice(tract_core_shape_of(states), axes = [0], begin = [0], end = [1]), axes = [0]);
    both = concat([initial, slice(states, axes = [0], begin = [max(length - 1, 0)], end = [length])], axis = 0);
    count = squeeze(slice(tract_core_shape_of(both), axes = [0], begin = [0], end = [1]), axes = [0]);
    final = slice(both, axes = [0], begin = [count - 1], end = [count]);
}

""")


PAD = Fragment(name="gdn_export_pad_step", extensions=EXTENSIONS, definition="""fragment gdn_export_pad_step(
    input: tensor<scalar>, padding: (integer, integer)[]
) -> ( output: tensor<scalar> ) {
    # the first max(len, 1) steps of input ++ one zero step (pad keeps a symbolic batch symbolic)
    length = squeeze(slice(tract_core_shape_of(input), axes = [0], begin = [0], end = [1]), axes = [0]);
    padded = pad(input, padding = padding, border = 'constant', value = 0.0);
    output = slice(padded, axes = [0], begin = [0], end = [max(length, 1)]);
}

""")

TAKE = Fragment(name="gdn_export_take_steps", extensions=EXTENSIONS, definition="""fragment gdn_export_take_steps(
    input: tensor<scalar>, like: tensor<scalar>
) -> ( output: tensor<scalar> ) {
    # the first len(like) entries of input's axis 3 (the tail's time axis)
    length = squeeze(slice(tract_core_shape_of(like), axes = [0], begin = [0], end = [1]), axes = [0]);
    output = slice(input, axes = [3], begin = [0], end = [length]);
}

""")


def covers(dims: Dims) -> bool:
    """Whether this module's tuned body computes the node: scalar decay or none, beta, one step per token
    (GDN, DeltaNet). ``chunked_general`` computes the rest of the family."""
    return not dims.channel_decay and not dims.gated_writes and dims.num_householder == 1


@dataclasses.dataclass(frozen=True)
class Variant:
    """What the chunk body computes; one fragment per distinct variant."""

    chunk: int
    has_decay: bool
    l2norm: bool
    scale: float | None
    head_major: bool
    heads: int  # value heads H = Hk * G, merged in the output layout
    width_k: int
    width_v: int

    @property
    def name(self) -> str:
        scale = "none" if self.scale is None else repr(float(self.scale)).replace(".", "p").replace("-", "m").replace("+", "")
        return (f"gdn_export_chunk_c{self.chunk}{'_decay' if self.has_decay else ''}{'_l2' if self.l2norm else ''}"
                f"_s{scale}_{'hm' if self.head_major else 'sm'}_h{self.heads}_k{self.width_k}_v{self.width_v}")


def chunk_size_error(chunk: int) -> str | None:
    """Why ``chunk`` cannot be a chunk size (None: it can): the solve cuts chunks into blocks of SOLVE_BLOCK."""
    if not isinstance(chunk, int) or chunk < SOLVE_BLOCK or chunk % SOLVE_BLOCK:
        return f"a chunk size must be a positive multiple of {SOLVE_BLOCK} tokens, got {chunk!r}"
    return None


def lower(b: NnefBuilder, node, dims: Dims, chunk: int = CHUNK) -> list:
    """Write the chunked lowering of ``node`` (which ``covers``); return the fragments it uses."""
    if chunk_size_error(chunk):
        raise ValueError(chunk_size_error(chunk))
    time_axis = 2 if node.head_major else 1
    raw = {"q": node.q, "k": node.k, "v": node.v, "beta": node.beta, "g": node.g}
    heads, tails = {}, {}
    for name, x in raw.items():
        if x is not None:
            heads[name], tails[name] = split_like(b, x, node.q, time_axis, chunk)
    variant = Variant(chunk, node.g is not None, node.use_qk_l2norm, node.scale, node.head_major, dims.heads,
                      dims.width_k, dims.width_v)
    s0 = b.unsqueeze(b.split_axis(b.cast(node.s0, F32), 1, [dims.key_heads, dims.groups]), [0])  # [1, B, Hk, G, K, V]
    y_head, state, scan = chunk_part(b, variant, heads, raw, s0, dims)
    tail_ops = step_operands(b, dataclasses.replace(node, **tails), dims)
    y_tail, final = token_part(b, tail_ops, state, dims)
    write_outputs(b, node, dims, y_head, y_tail, final)
    return [SPLIT, FINAL, PAD, TAKE, scan, tail_fragment(1, tail_ops.log_decay is not None)]


def split_like(b: NnefBuilder, x: NTensor, like: NTensor, axis: int, chunk: int) -> tuple[NTensor, NTensor]:
    """Cut x's time axis where ``like``'s (q's) whole chunks end: ``chunk * floor(T / chunk)`` and the rest
    (either may be empty)."""
    whole = like.shape[axis] // chunk * chunk
    shape = list(x.shape)
    head = b.tensor("head", shape[:axis] + [whole] + shape[axis + 1:], x.dtype)
    tail = b.tensor("tail", shape[:axis] + [x.shape[axis] - whole] + shape[axis + 1:], x.dtype)
    b.multi_op(SPLIT.name, (x, like), (head, tail), attribs={"axis": axis, "chunk": chunk})
    return head, tail


def final_state(b: NnefBuilder, start: NTensor, states: NTensor) -> NTensor:
    """The last of ``start ++ states`` along axis 0, ``[1, ...]``."""
    final = b.tensor("final_state", start.shape, F32)
    b.multi_op(FINAL.name, (start, states), (final,))
    return final


# --- the chunks -----------------------------------------------------------------------------------
def scan_layout(b: NnefBuilder, x: NTensor, head_major: bool, groups: int, substeps: bool = False) -> NTensor:
    """``[B, T, H, X]`` (head-major ``[B, H, T, X]``; X absent for gates) -> f32 ``[1, B, Hk, G|1, T, X|1]``;
    with ``substeps``, ``[B, T, n, H, X]`` (head-major ``[B, H, T, n, X]``) -> ``[1, B, Hk, G|1, T, n, X|1]``."""
    x = b.cast(x, F32)
    rank = 5 if substeps else 4
    if len(x.shape) == rank - 1:
        x = b.unsqueeze(x, [rank - 1])
    head_axis = 1 if head_major else rank - 2
    x = b.split_axis(x, head_axis, [x.shape[head_axis] // groups, groups])
    if not head_major:  # [B, Hk, G, T, (n,) X]
        x = b.transpose(x, [0, head_axis, head_axis + 1, *range(1, head_axis), rank])
    return b.unsqueeze(x, [0])


def constants(chunk: int) -> dict[str, np.ndarray]:
    """Masks the body reads (full scan inputs), broadcastable against its tensors."""
    s = SOLVE_BLOCK
    lower = np.tril(np.ones((chunk, chunk)))
    index = np.arange(s)
    found = {
        "causal": lower,  # the readout's mask without decay
        "causal_log": np.where(lower > 0, 0.0, MASKED),  # added before exp: masked entries become exactly 0
        "identity": np.eye(s),
    }
    h = 1
    while h < s:  # the h x h blocks below the diagonal joined at doubling level h
        found[f"join{h}"] = ((index[:, None] // (2 * h) == index[None, :] // (2 * h))
                             & (index[:, None] // h % 2 == 1) & (index[None, :] // h % 2 == 0))
        h *= 2
    rank = {"identity": 7, **{f"join{2 ** i}": 7 for i in range(8)}}  # [.., n, s, s] blocks
    return {name: value.astype(np.float32).reshape((1,) * (rank.get(name, 6) - value.ndim) + value.shape)
            for name, value in found.items()}


def chunk_part(b: NnefBuilder, variant: Variant, heads: dict[str, NTensor], whole: dict[str, NTensor], s0: NTensor,
               dims: Dims):
    """The chunk scan: (y ``[B, N*C, H, V]`` or head-major ``[B, H, N*C, V]``, state after the chunks, fragment).

    ``heads`` are the operands cut to their whole chunks, ``whole`` the uncut ones. q, k, v enter uncut (seq-major
    ones as they are, [B, T, H, X], scanned 64 tokens at a time along T): the scan runs as many steps as its
    first input (per chunk, N = floor(T/64)) has, and reads nothing past them, so no copy of the first N*64
    tokens is made (a big symbolic-length copy runs ~10x slower in tract 0.23.9 than the body's chunk reads)."""
    c = variant.chunk
    f32 = lambda x: b.cast(x, F32)
    if variant.head_major:
        scanned = {name: (scan_layout(b, whole[name], True, 1), 4, c) for name in ("q", "k")}
        scanned["v"] = (scan_layout(b, whole["v"], True, dims.groups), 4, c)
    else:
        scanned = {name: (f32(whole[name]), 1, c) for name in ("q", "k", "v")}
        scanned["vbeta"] = (b.unsqueeze(f32(heads["beta"]), [3]), 1, c)
    beta = scan_layout(b, heads["beta"], variant.head_major, dims.groups)
    if variant.has_decay:
        gamma, end, left, right = cumulative_decay(b, scan_layout(b, heads["g"], variant.head_major, dims.groups), c)
        per_chunk = {"end": (end, 4, 1)}
        scanned.update(gamma=(gamma, 4, c), left=(left, 4, c), right=(right, 5, c))
    else:
        per_chunk = {"one": (chunk_ones(b, beta, c), 4, 1)}
    scanned["beta"] = (beta, 4, c)
    # a per-chunk input first: tract counts iterations on the first scan input, and N from it is S/64,
    # where 64 tokens at a time give (63 + 64*(S/64))/64, which tract does not simplify to S/64 (the model
    # around the node then fails to prove its lengths equal)
    scanned = {**per_chunk, **scanned}
    masks = {name: b.constant(name, value) for name, value in constants(c).items()}
    fragment = chunk_scan_fragment(variant, {name: tuple(axis_chunk) for name, (_, *axis_chunk) in scanned.items()},
                                   tuple(masks), dims.key_heads)
    batch, steps = heads["q"].shape[0], heads["q"].shape[2 if variant.head_major else 1]
    shape = (batch, dims.heads, steps, dims.width_v) if variant.head_major else (batch, steps, dims.heads, dims.width_v)
    y = b.tensor("chunk_y", shape, F32)
    states = b.tensor("chunk_states", (steps // c, *s0.shape[1:]), F32)
    b.multi_op(fragment.name, (*(x for x, *_ in scanned.values()), *masks.values(), s0), (y, states))
    return y, final_state(b, s0, states), fragment


def cumulative_decay(b: NnefBuilder, g: NTensor, chunk: int):
    """From ``g [1, B, Hk, G, N*C, 1]``: per-chunk cumulative sums ``gamma`` (same shape), each chunk's total
    ``[.., N, 1]``, and ``left = [gamma, 1]`` ``[.., N*C, 2]``, ``right = [1; -gamma^T]`` ``[.., 2, N*C]`` whose
    product in the body is ``gamma_i - gamma_j`` (one rounding, as a subtraction).

    Computed before the scan: tract 0.23.9 fails to load a body holding a matmul of a constant by a scan
    input (it tries to pull it out of the loop), and a broadcast difference in the body takes its slow
    path. Tiny tensors (one value per token and head): no speed concern here. Assumes finite g."""
    gamma, end = cumulative_log_decay(b, g, chunk)
    ones = b.binary("add", b.binary("mul", gamma, b.scalar(0.0, F32)), b.scalar(1.0, F32))
    left = b.op("concat", [gamma, ones], shape=(*gamma.shape[:5], 2), attribs={"axis": 5})  # [gamma_i, 1]
    right = b.op("concat", [ones, b.unary("neg", gamma)], shape=(*gamma.shape[:5], 2), attribs={"axis": 5})
    return gamma, end, left, b.transpose(right, [0, 1, 2, 3, 5, 4])  # [1; -gamma_j]


def cumulative_log_decay(b: NnefBuilder, g: NTensor, chunk: int) -> tuple[NTensor, NTensor]:
    """``g [1, B, Hk, G, N*C, X]`` (X = 1, or K for per-channel decay) -> the cumulative sums inside each chunk
    (same shape) and each chunk's total ``[.., N, X]``: a matmul by a lower-triangular constant."""
    lead, steps, width = g.shape[:4], g.shape[4], g.shape[5]
    chunks = b.reshape(g, 4, 1, [-1, chunk], (*lead, steps // chunk, chunk, width))
    lower = np.tril(np.ones((chunk, chunk), np.float32)).reshape((1,) * 5 + (chunk, chunk))
    gamma = b.matmul(b.constant("cumsum", lower), chunks)  # [1, B, Hk, G, N, C, X]
    end = b.op("slice", gamma, shape=(*lead, steps // chunk, 1, width),
               attribs={"axes": [5], "begin": [chunk - 1], "end": [chunk]})
    flat = lambda x: b.reshape(x, 4, 2, [-1], (*lead, x.shape[4] * x.shape[5], width))  # noqa: E731
    return flat(gamma), flat(end)


def chunk_ones(b: NnefBuilder, beta: NTensor, chunk: int) -> NTensor:
    """Ones ``[1, B, Hk, G, N, 1]``, one per chunk, from ``beta [1, B, Hk, G, N*C, 1]`` (a tiny tensor)."""
    lead, steps = beta.shape[:4], beta.shape[4]
    chunks = b.reshape(beta, 4, 1, [-1, chunk], (*lead, steps // chunk, chunk, 1))
    first = b.op("slice", chunks, shape=(*lead, steps // chunk, 1, 1), attribs={"axes": [5], "begin": [0], "end": [1]})
    flat = b.reshape(first, 4, 2, [-1], (*lead, steps // chunk, 1))
    return b.binary("add", b.binary("mul", flat, b.scalar(0.0, F32)), b.scalar(1.0, F32))


class Body:
    """NNEF lines of a scan body, one assignment per line, with fresh names."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.count = 0

    def __call__(self, expression: str, name: str | None = None) -> str:
        if name is None:
            name, self.count = f"x{self.count}", self.count + 1
        self.lines.append(f"    {name} = {expression};")
        return name

    def times(self, x: str, *factors: str | None) -> str:
        for factor in factors:
            if factor is not None:
                x = self(f"{x} * {factor}")
        return x


def chunk_body(variant: Variant, key_heads: int) -> list[str]:
    """One chunk. Inputs: ``q_t, k_t, v_t``, seq-major ``[B, C, Hk|H, K|V]`` with ``vbeta_t [B, C, H, 1]``, or
    head-major ``[1, B, Hk, 1|G, C, K|V]``; ``beta_t [1, B, Hk, G, C, 1]``; with decay ``gamma_t [.., G, C, 1]``,
    ``end_t [.., G, 1, 1]``, ``left_t [.., G, C, 2]``, ``right_t [.., G, 2, C]``; the masks;
    ``s_prev [1, B, Hk, G, K, V]``. Outputs ``s_t`` and ``y_t`` (in the node's layout).

    k and q are stacked along the tokens first, so one RMS norm normalizes both (``l2norm(x) =
    rms_norm(x, eps / K) / sqrt(K)``, exact scaling for power-of-two K) and one matmul reads the state for
    ``k S`` and ``q S``; the stack is cut on a block axis of a reshaped view (tract 0.23.9 pushes a slice of the
    token axis back through the norm onto the scan input and pulls it out of the loop). Every constant factor
    (1/sqrt(K), q's scale) rides on a per-token column or on the C x C decay matrix, so no [C, K] tensor is
    rescaled. Seq-major q, k are read in place by ``tract_core_einsum`` (its packing takes the strides)."""
    x = Body()
    seq_major, width, c = not variant.head_major, variant.width_k, variant.chunk
    token_axis = 1 if seq_major else 4
    stacked = x(f"concat([k_t, q_t], axis = {token_axis})")  # [B, 2C, Hk, K] or [1, B, Hk, 1, 2C, K]
    root = 1.0
    if variant.l2norm:
        stacked = x(f"tract_core_rms_norm({stacked}, axis = {3 if seq_major else 5}, eps = {L2NORM_EPS / width!r})")
        root = float(1.0 / np.sqrt(width))  # what rms_norm leaves to multiply: l2norm = rms_norm / sqrt(K)
    q_scale = root * float(variant.scale if variant.scale is not None else 1.0)
    view = x(f"reshape({stacked}, shape = [2, {c}], axis_start = {token_axis}, axis_count = 1)")

    def half(index: int) -> str:
        cut = x(f"slice({view}, axes = [{token_axis}], begin = [{index}], end = [{index + 1}])")
        return x(f"reshape({cut}, shape = [{c}], axis_start = {token_axis}, axis_count = 2)")

    k = half(0)  # q is only read stacked with k
    if seq_major:  # [B, C, Hk, K] read in place
        pairs = lambda a, b: x(f"reshape(reshape(tract_core_einsum([{a}, {b}], expr = \"bihk,bjhk->bhij\", "
                               "acc = \"f32\"), shape = [1, -1], axis_start = 0, axis_count = 1), "
                               f"shape = [{key_heads}, 1], axis_start = 2, axis_count = 1)")
        with_state = x(f"tract_core_einsum([{stacked}, s_prev], expr = \"bchk,zbhgkv->zbhgcv\", acc = \"f32\")")
        written_value = heads_first(x, x("v_t * vbeta_t"), key_heads, variant.heads // key_heads)
    else:  # [1, B, Hk, 1|G, C, X]
        pairs = lambda a, b: x(f"matmul({a}, {b}, transposeB = true)")
        with_state = x(f"matmul({stacked}, s_prev)")
        written_value = x("v_t * beta_t")
    # k k^T and q k^T in one product of the stacked [k; q] by k (k packed once), cut on a block axis
    both = x(f"reshape({pairs(stacked, k)}, shape = [2, {c}], axis_start = 4, axis_count = 1)")  # [.., 1, 2, C, C]
    key_products, readout = (x(f"reshape(slice({both}, axes = [4], begin = [{i}], end = [{i + 1}]), shape = [{c}], "
                               f"axis_start = 4, axis_count = 2)") for i in (0, 1))  # [1, B, Hk, 1, C, C]
    states = x(f"reshape({with_state}, shape = [2, {c}], axis_start = 4, axis_count = 1)")  # [.., G, 2, C, V]
    key_state, query_state = (x(f"reshape(slice({states}, axes = [4], begin = [{i}], end = [{i + 1}]), shape = [{c}], "
                                f"axis_start = 4, axis_count = 2)") for i in (0, 1))
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
    residual = x(f"{written_value} - {erase} * {key_state}")  # [1, B, Hk, G, C, V]
    delta = solve_unit_lower(x, a, residual, c)
    y = x(f"{x.times(query_state, q_factor)} + matmul({readout}, {delta})")  # [1, B, Hk, G, C, V]
    scaled = x.times(delta, key_factor)
    decayed = x.times("s_prev", x("exp(end_t)") if variant.has_decay else None)
    # written as update + s: tract fuses the add into the matmul's output (no extra pass over the state)
    if seq_major:
        update = x(f"tract_core_einsum([{k}, {scaled}], expr = \"bchk,zbhgcv->zbhgkv\", acc = \"f32\")")
    else:
        update = x(f"matmul({k}, {scaled}, transposeA = true)")
    x(f"{update} + {decayed}", "s_t")
    write_y(x, y, variant.head_major, c, variant.heads)
    return x.lines


def write_y(x: Body, y: str, head_major: bool, tokens: int, heads: int) -> None:
    """``y [1, B, Hk, G, C, V]`` into the body's output ``y_t`` in the node's layout, without the leading 1 (a
    reshape: a squeeze outside the loop would copy y again); -1 is the batch, which may be symbolic."""
    if head_major:  # [B, H, C, V]
        x(f"reshape({y}, shape = [-1, {heads}], axis_start = 0, axis_count = 4)", "y_t")
    else:  # [B, C, H, V]
        moved = x(f"transpose({y}, axes = [0, 1, 4, 2, 3, 5])")
        x(f"reshape({moved}, shape = [-1, {tokens}, {heads}], axis_start = 0, axis_count = 5)", "y_t")


def scaled_factor(x: Body, factor: str | None, constant: float) -> str | None:
    """``factor * constant`` as a body value or literal (None when it is 1)."""
    if constant == 1.0:
        return factor
    return repr(constant) if factor is None else x(f"{factor} * {constant!r}")


def heads_first(x: Body, value: str, key_heads: int, groups: int) -> str:
    """``[B, C, Hk*G, X]`` -> ``[1, B, Hk, G, C, X]`` (reshapes, not squeeze/unsqueeze: see recurrent.py)."""
    split = x(f"reshape({value}, shape = [{key_heads}, {groups}], axis_start = 2, axis_count = 1)")
    moved = x(f"transpose({split}, axes = [0, 2, 3, 1, 4])")
    return x(f"reshape({moved}, shape = [1, -1], axis_start = 0, axis_count = 1)")  # B may be symbolic


def solve_unit_lower(x: Body, a: str, rhs: str, chunk: int) -> str:
    """``(I + strictly_lower(A))^-1 rhs`` for ``A [1, B, Hk, G, C, C]``, ``rhs [.., C, F]``: block forward
    substitution, ``X_r = T_r (rhs_r - A[r, :r] X_{:r})`` with ``T_r`` the inverse of diagonal block r.
    Solving against rhs (not forming T, then T rhs) measured 3-5x more accurate in f32 with correlated keys.

    Blocks are cut from reshaped views ``[.., n, s, ...]`` (a slice and a concat on a block axis): tract
    0.23.9 pushes slices of the token axis itself up into the matmuls that made it (splitting k S into
    four matmuls that each pack the state) and splits matmuls that read a concat into per-block pieces."""
    s, n = SOLVE_BLOCK, chunk // SOLVE_BLOCK
    grid = x(f"reshape({a}, shape = [{n}, {s}, {n}, {s}], axis_start = 4, axis_count = 2)")  # [.., n, s, n, s]
    parts = x(f"reshape({rhs}, shape = [{n}, {s}], axis_start = 4, axis_count = 1)")  # [.., n, s, F]

    def block(r: int, columns: int, first: int = 0) -> str:
        """A's block row r, block columns [first, first + columns), as ``[.., 1, s, columns * s]``."""
        cut = x(f"slice({grid}, axes = [4, 6], begin = [{r}, {first}], end = [{r + 1}, {first + columns}])")
        return x(f"reshape({cut}, shape = [{columns * s}], axis_start = 6, axis_count = 2)")

    inverse = diagonal_inverses(x, x(f"concat([{', '.join(block(r, 1, r) for r in range(n))}], axis = 4)"))
    inverse = x(f"reshape({inverse}, shape = [{n * s}], axis_start = 4, axis_count = 2)")  # [.., n*s, s]
    rows: list[str] = []
    for r in range(n):
        part = x(f"slice({parts}, axes = [4], begin = [{r}], end = [{r + 1}])")  # [.., 1, s, F]
        if rows:
            done = x(f"reshape(concat([{', '.join(rows)}], axis = 4), shape = [1, {r * s}], axis_start = 4, "
                     f"axis_count = 2)") if r > 1 else rows[0]
            part = x(f"{part} - matmul({block(r, r)}, {done})")
        inverse_r = x(f"reshape(slice({inverse}, axes = [4], begin = [{r * s}], end = [{(r + 1) * s}]), shape = [1, {s}], "
                      f"axis_start = 4, axis_count = 1)")  # [.., 1, s, s]
        rows.append(x(f"matmul({inverse_r}, {part})"))
    return x(f"reshape(concat([{', '.join(rows)}], axis = 4), shape = [{chunk}], axis_start = 4, axis_count = 2)")


def diagonal_inverses(x: Body, blocks: str) -> str:
    """``(I + strictly_lower(A_rr))^-1`` of every diagonal block: ``T_1 = I``, ``T_2h = T_h - T_h (A * M_h) T_h``
    with ``M_h`` the lower off-diagonal h x h blocks joined at this level: exact, log2(s) levels."""
    inverse = x(f"identity - {blocks} * join1")
    h = 2
    while h < SOLVE_BLOCK:
        inverse = x(f"{inverse} - matmul(matmul({inverse}, {blocks} * join{h}), {inverse})")
        h *= 2
    return inverse


def chunk_scan_fragment(variant: Variant, scanned: dict[str, tuple[int, int]], masks: tuple[str, ...],
                        key_heads: int) -> Fragment:
    return scan_over_chunks(f"{variant.name}_hk{key_heads}", chunk_body(variant, key_heads), scanned, masks,
                            2 if variant.head_major else 1, variant.chunk)


def scan_over_chunks(name: str, body: list[str], scanned: dict[str, tuple[int, int]], masks: tuple[str, ...],
                     y_axis: int, y_chunk: int) -> Fragment:
    """A chunk body and the ``tract_core_scan`` running it. ``scanned``: each scan input's (axis, chunk), C
    along the tokens, 1 for per-chunk inputs; ``masks`` are read whole every step. Outputs y (``y_chunk``
    tokens a step along ``y_axis``) and the state after every chunk (a "full" output: see the module doc)."""
    step, scan = f"{name}_step", f"{name}_scan"
    inputs = [f"{name}_t" for name in scanned] + list(masks)
    definition = f"""fragment {step}(
    s_prev: tensor<scalar>, {", ".join(f"{name}: tensor<scalar>" for name in inputs)}
) -> ( s_t: tensor<scalar>, y_t: tensor<scalar> ) {{
{chr(10).join(body)}
}}

fragment {scan}(
    {", ".join(f"{name}: tensor<scalar>" for name in (*scanned, *masks))}, s_init: tensor<scalar>
) -> ( y: tensor<scalar>, states: tensor<scalar> ) {{
    (y, states) = tract_core_scan(
        body = "{step}",
        scan = [{", ".join(f'("{name}_t", {name}, {axis}, {step_})' for name, (axis, step_) in scanned.items())}],
        full = [{", ".join(f'("{name}", {name})' for name in masks)}],
        state = [("s_prev", s_init, "s_t")],
        output = [("y_t", "full", {y_axis}, {y_chunk}), ("s_t", "full", 0, 1)],
        skip = 0
    );
}}

"""
    return Fragment(name=scan, extensions=EXTENSIONS, definition=definition)


# --- the tail, token by token ---------------------------------------------------------------------
def tail_fragment(num_householder: int, has_decay: bool) -> Fragment:
    """The elementwise per-token step of ``scan.py`` under its own name; its state leaves as a "last" output,
    so the tail always runs at least one step (see ``pad_step``)."""
    return elementwise_step_fragment("chunk_tail", num_householder, has_decay)


def pad_step(b: NnefBuilder, x: NTensor) -> NTensor:
    """``[R, ...]`` -> the first ``max(R, 1)`` steps of ``x ++ 0``: one zero step when R = 0.

    A zero step (q = k = e = u = 0, log-decay 0) leaves the state exactly as it is; it lets the tail scan
    use a "last" state output, which tract gets wrong (a scalar 0) for a scan of no iteration."""
    out = b.tensor("padded", (max(x.shape[0], 1), *x.shape[1:]), F32)
    b.multi_op(PAD.name, (x,), (out,), attribs={"padding": [(0, 1)] + [(0, 0)] * (len(x.shape) - 1)})
    return out


def token_part(b: NnefBuilder, ops, state: NTensor, dims: Dims):
    """The last ``R = S mod C`` tokens from ``state [1, B, Hk, G, K, V]``: (y ``[B, Hk, G, R, V]``, final state
    ``[B, Hk, G, K, V]``)."""
    operands = step_inputs(b, ops, lambda x: pad_step(b, x))  # the zero step's decay is exp(0) = 1
    count = max(ops.q.shape[0], 1)
    y = b.tensor("tail_y", (dims.batch, dims.key_heads, dims.groups, count, dims.width_v), F32)
    final = b.tensor("tail_state", state.shape[1:], F32)
    b.multi_op(tail_fragment(len(ops.keys), ops.log_decay is not None).name, (*operands, b.squeeze(state, [0])), (y, final))
    taken = b.tensor("tail_y_taken", (*y.shape[:3], ops.q.shape[0], y.shape[4]), F32)
    b.multi_op(TAKE.name, (y, ops.q), (taken,))
    return taken, final


# --- outputs --------------------------------------------------------------------------------------
def write_outputs(b: NnefBuilder, node, dims: Dims, y_head: NTensor, y_tail: NTensor, state: NTensor) -> None:
    """Chunk outputs (already in the node's layout) ++ tail outputs ``[B, Hk, G, R, V]`` over time; the state
    ``[B, Hk, G, K, V]`` into ``[B, H, K, V]``."""
    if node.head_major:
        tail = b.merge_axes(y_tail, 1, 2)  # [B, H, R, V]
        axis = 2
    else:
        tail = b.merge_axes(b.transpose(y_tail, [0, 3, 1, 2, 4]), 2, 2)  # [B, R, H, V]
        axis = 1
    shape = list(y_head.shape)
    shape[axis] = dims.seq
    if np.dtype(node.y.dtype) == np.dtype(F32):  # the concat itself is the output: it keeps its name in tract,
        b.op("concat", [y_head, tail], shape=shape, attribs={"axis": axis}, out=node.y)  # no renaming copy
    else:
        b.cast(b.op("concat", [y_head, tail], shape=shape, attribs={"axis": axis}), node.y.dtype, out=node.y)
    write_state(b, dims, state, node.s_final)
