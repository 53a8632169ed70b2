"""What both chunk bodies share: sizes, names, the split of S, the chunk scan, the per-token tail, the outputs.

The first ``C * floor(S / C)`` tokens run through a ``tract_core_scan`` over chunks of C tokens (C: the
``chunk_size`` option, by default ``CHUNK``, or ``CHANNEL_CHUNK`` with per-channel decay; ``tokens_per_chunk``),
whose body (gdn.py or general.py) applies one chunk of the WY / UT chunk form (docs/MATH.md); the last
``S mod C`` tokens run from the state the chunks leave: with the GDN body, through a second scan of the same body
over short chunks of ``TAIL_CHUNK`` tokens (zero tokens pad the last; ``chunk_tail``), so that a decode step or a
speculative verify call of up to ``TAIL_CHUNK`` tokens costs one short chunk, two matrix products over the state
(measured at the 0.8B shape, int8: a 4-token call 1.17x a one-token call, against 1.74x when every token made its
own passes over the state); with the general body, through the elementwise per-token step of the scan lowering
(steps.py).

How the graph is shaped by tract 0.23.9 (read in its source, then measured, with C = 64):
- A binary op whose operands share a symbolic shape never gets tract's fast kernels (its "worth it" test
  cannot bound ``S/C`` away from 0) and runs ~10x slower; so does a big copy of a symbolic-length
  tensor. Every per-chunk computation is therefore inside the scan body, where shapes are concrete, and
  the scan slices the raw q, k, v C tokens at a time (scan chunk C: no reshape of a symbolic axis).
- tract pulls a body op out of the loop when its only non-constant input is a scan input (it then runs
  on the whole sequence, slowly), and fails to load a body where such an op is a matmul by a constant
  or reads the same scan input twice: the bodies first combine each scan input with another one.
- tract pulls the ops writing a "full" output after the loop unless that output's chunk is > 1: y leaves
  with chunk C, already in the node's layout.
- tract pushes slices of an axis back up through the ops that made it and splits matmuls that read a
  concat into per-piece matmuls (each packing its operands again); blocks are therefore cut on the block
  axis of reshaped views ``[.., n, s, ...]`` (body.py).
- A slice ending at ``(len / C) * C`` (``tract_core_shape_of``) keeps a symbolic length as ``C*(S/C)``;
  a scan counts its iterations on its first scan input, so a per-chunk input (length ``S/C``) goes first:
  counted on a per-token one the count is ``(C-1 + C*(S/C))/C``, which tract never simplifies, and the
  model around the node then cannot prove its lengths equal. The outputs' facts are exactly S.
- A scan of 0 iterations returns a scalar 0 for a "last" output: the chunk scan emits its states as a
  "full" output (the final state is the last of ``initial ++ states``), the tail scan always runs at
  least one step (a zero step when S is a multiple of C, which leaves the state exactly as it is).
- tract tries to remove every size-1 axis of every scan-body tensor, each in an axis-change search of its own
  over the body, in every optimizer round, at load and again when planning (``Scan::declutter_body_axes``): a
  unit axis every body tensor carries made that search ~40% of a start (issue 36). The bodies' tensors are
  therefore ``[B, H, C, X]`` (``[B, Hk, G, C, X]`` with grouped heads; ``scan_layout``), their states ``[B, H, K,
  V]``, and the chunk scan's states leave stacked along the key axis (``[B, H, N*K, V]``), not on an axis of
  their own. With no axis left to squeeze, tract reports the state output under the tail scan's name (a unit
  axis put on the state outside the body, or at its boundary, is pulled through the scan and the name lost the
  same way), and output_names.py re-declares it (a select: ~0.05 ms a layer per decode step, measured).

A body is a module with ``variant(node, dims, tokens)`` (a ``Variant`` with a ``name``, one fragment per
distinct one), ``scan_inputs(b, variant, heads, whole, dims)`` (the scan's inputs, per-chunk
ones first), ``masks(variant)`` (constants it reads whole), ``lines(variant)`` (its NNEF lines) and
``HEADS_READ`` (the operands whose cut heads ``scan_inputs`` reads; None: all of them).
"""

from __future__ import annotations

import dataclasses
from types import ModuleType

import numpy as np
from nnef_tools.model import Tensor as NTensor
from torch_to_nnef.op.fragment import Fragment

from gdn_export.ops.gated_delta_rule.nnef.capabilities import F32
from gdn_export.ops.gated_delta_rule.nnef.layout import step_operands, write_squeezed
from gdn_export.backends.nnef import scan as nnef_scan
from gdn_export.backends.nnef.builder import NnefBuilder
from gdn_export.ops.gated_delta_rule.nnef.steps import elementwise_step_fragment, step_inputs
from gdn_export.ops.gated_delta_rule.nnef.chunking import (CHANNEL_CHUNK, CHUNK, SOLVE_BLOCK,  # noqa: F401
                                                     chunk_size_error, tokens_per_chunk)
from gdn_export.ops.gated_delta_rule.operands import Dims

# sizes (CHUNK, CHANNEL_CHUNK, chunk_size_error, tokens_per_chunk): ops/gated_delta_rule/nnef/chunking.py, which the
# export's options validate with before any NNEF is written


# --- what a body computes, and its name -----------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class Variant:
    """What every chunk body's variant holds (each body adds its own fields); one fragment per distinct one."""

    tokens: int  # real tokens per chunk
    l2norm: bool
    scale: float | None
    head_major: bool
    key_heads: int
    heads: int  # value heads H = Hk * G, merged in the output layout
    width_k: int
    width_v: int

    @property
    def grouped(self) -> bool:
        """Whether the body's tensors carry a group axis (``[B, Hk, G, ...]``): with grouped heads only."""
        return self.heads != self.key_heads

    @property
    def token_axis(self) -> int:
        """The tokens' axis of the body's tensors ``[B, Hk, G, C, X]`` (grouped heads) or ``[B, H, C, X]``."""
        return 3 if self.grouped else 2

    @property
    def semantics(self) -> str:
        """The part of the fragment's name that the node's semantics and layout set."""
        scale = "none" if self.scale is None else repr(float(self.scale))
        scale = scale.replace(".", "p").replace("-", "m").replace("+", "")
        return f"{'_l2' if self.l2norm else ''}_s{scale}_{'hm' if self.head_major else 'sm'}"

    @classmethod
    def of(cls, node, dims: Dims, tokens: int, **fields) -> Variant:
        """The node's variant with ``tokens`` a chunk, plus the body's own ``fields``."""
        return cls(tokens=tokens, l2norm=node.use_qk_l2norm, scale=node.scale, head_major=node.head_major,
                   key_heads=dims.key_heads, heads=dims.heads, width_k=dims.width_k, width_v=dims.width_v, **fields)


# --- cutting S ------------------------------------------------------------------------------------
EXTENSIONS = ("tract_registry tract_core",)

CUT = """    length = squeeze(slice(tract_core_shape_of(like), axes = [0], begin = [axis], end = [axis + 1]), axes = [0]);
    total = squeeze(slice(tract_core_shape_of(input), axes = [0], begin = [axis], end = [axis + 1]), axes = [0]);
    cut = (length / chunk) * chunk;
"""  # where SPLIT and REST cut: after the whole chunks

SPLIT = Fragment(name="gdn_export_chunk_split", extensions=EXTENSIONS, definition=f"""fragment gdn_export_chunk_split(
    input: tensor<scalar>, like: tensor<scalar>, axis: integer, chunk: integer
) -> ( head: tensor<scalar>, tail: tensor<scalar> ) {{
    # the first chunk*floor(len(like)/chunk) entries of input's axis, and the rest; bounds are shape expressions
    # (a symbolic axis is cut into chunk*(S/chunk) and the rest), and every operand is cut where q's is, so
    # tract knows the parts' lengths equal
{CUT}    head = slice(input, axes = [axis], begin = [0], end = [cut]);
    tail = slice(input, axes = [axis], begin = [cut], end = [total]);
}}

""")

REST = Fragment(name="gdn_export_chunk_rest", extensions=EXTENSIONS, definition=f"""fragment gdn_export_chunk_rest(
    input: tensor<scalar>, like: tensor<scalar>, axis: integer, chunk: integer
) -> ( tail: tensor<scalar> ) {{
    # the rest of gdn_export_chunk_split alone, for an operand whose whole chunks the scan reads uncut: a head
    # nobody reads would still be a slice for tract's NNEF reader to wire, its bounds compared with every constant
{CUT}    tail = slice(input, axes = [axis], begin = [cut], end = [total]);
}}

""")

FINAL = Fragment(name="gdn_export_final_state", extensions=EXTENSIONS, definition="""fragment gdn_export_final_state(
    initial: tensor<scalar>, states: tensor<scalar>, axis: integer, rows: integer
) -> ( final: tensor<scalar> ) {
    # the last state of initial ++ states, states stacked along axis (rows entries each; initial when there are
    # none), copying two states at most; the last is sliced as [n - rows, n) so that its length simplifies to rows
    length = squeeze(slice(tract_core_shape_of(states), axes = [0], begin = [axis], end = [axis + 1]), axes = [0]);
    both = concat([initial, slice(states, axes = [axis], begin = [max(length - rows, 0)], end = [length])],
                  axis = axis);
    count = squeeze(slice(tract_core_shape_of(both), axes = [0], begin = [axis], end = [axis + 1]), axes = [0]);
    final = slice(both, axes = [axis], begin = [count - rows], end = [count]);
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


def split_like(b: NnefBuilder, x: NTensor, like: NTensor, axis: int, chunk: int,
               head_read: bool = True) -> tuple[NTensor, NTensor]:
    """Cut x's time axis where ``like``'s (q's) whole chunks end: ``chunk * floor(T / chunk)`` and the rest
    (either may be empty). Without ``head_read`` only the rest is written (REST); the head returned is then a
    traced tensor no operation writes, for its shape only."""
    whole = like.shape[axis] // chunk * chunk
    shape = list(x.shape)
    head = b.tensor("head", shape[:axis] + [whole] + shape[axis + 1:], x.dtype)
    tail = b.tensor("tail", shape[:axis] + [x.shape[axis] - whole] + shape[axis + 1:], x.dtype)
    attribs = {"axis": axis, "chunk": chunk}
    if head_read:
        b.multi_op(SPLIT.name, (x, like), (head, tail), attribs=attribs)
    else:
        b.multi_op(REST.name, (x, like), (tail,), attribs=attribs)
    return head, tail


def cut_operands(b: NnefBuilder, node, dims: Dims, tokens: int, heads_read: tuple[str, ...] | None = None):
    """The node's operands (``whole``), each cut into its whole chunks (``heads``) and the rest (``tails``);
    only the heads named in ``heads_read`` (None: all) are written, the others' are traced shapes.

    With n > 1 sub-steps, k, v and beta get their sub-steps on an axis of their own first (``[B, T, n, ...]``,
    head-major ``[B, H, T, n, ...]``): tract 0.23.9 gets the length of a reshape of a symbolic tail wrong
    (with n = 2 and C = 32: S - 64*(S/32) for (2S - 64*(S/32)) / 2)."""
    time_axis = 2 if node.head_major else 1
    raw = {"q": node.q, "k": node.k, "v": node.v, "beta": node.beta, "g": node.g, "erase": node.erase,
           "write": node.write}
    heads, whole, tails = {}, {}, {}
    for name, x in raw.items():
        if x is None:
            continue
        if dims.num_householder > 1 and name in ("k", "v", "beta"):
            x = b.split_axis(x, time_axis, [-1, dims.num_householder])
        whole[name] = x
        heads[name], tails[name] = split_like(b, x, node.q, time_axis, tokens,
                                              heads_read is None or name in heads_read)
    return heads, whole, tails


def final_state(b: NnefBuilder, start: NTensor, states: NTensor, axis: int) -> NTensor:
    """The last state of ``start ++ states``, the states stacked along ``axis`` (the key axis of ``[.., K, V]``),
    shaped as ``start``."""
    final = b.tensor("final_state", start.shape, F32)
    b.multi_op(FINAL.name, (start, states), (final,), attribs={"axis": axis, "rows": start.shape[axis]})
    return final


# --- the chunks -----------------------------------------------------------------------------------
def scan_layout(b: NnefBuilder, x: NTensor, head_major: bool, groups: int, grouped: bool,
                substeps: bool = False) -> NTensor:
    """``[B, T, H, X]`` (head-major ``[B, H, T, X]``; X absent for gates) -> f32 ``[B, H, T, X|1]``, or with
    ``grouped`` heads ``[B, Hk, G|1, T, X|1]`` (``groups``: G for a value-head operand, 1 for a key-head one); with
    ``substeps``, ``[B, T, n, H, X]`` (head-major ``[B, H, T, n, X]``) -> ``[B, H, T, n, X|1]`` or ``[B, Hk, G|1,
    T, n, X|1]``.

    No other size-1 axis: tract 0.23.9 tries to remove every size-1 axis of every scan-body tensor, each in a search
    of its own over the body, in every optimizer round (``Scan::declutter_body_axes``; issue 36)."""
    x = b.cast(x, F32)
    rank = 5 if substeps else 4
    if len(x.shape) == rank - 1:
        x = b.unsqueeze(x, [rank - 1])
    head_axis = 1 if head_major else rank - 2
    heads = 1
    if grouped:
        x, heads = b.split_axis(x, head_axis, [x.shape[head_axis] // groups, groups]), 2
    if not head_major:  # [B, Hk, (G,) T, (n,) X]
        x = b.transpose(x, [0, *range(head_axis, head_axis + heads), *range(1, head_axis), head_axis + heads])
    return x


def cumulative_log_decay(b: NnefBuilder, g: NTensor, chunk: int) -> tuple[NTensor, NTensor]:
    """``g [.., N*C, X]`` (scan_layout's; X = 1, or K for per-channel decay) -> the cumulative sums inside each
    chunk (same shape) and each chunk's total ``[.., N, X]``: a matmul by a lower-triangular constant."""
    t = len(g.shape) - 2
    lead, steps, width = g.shape[:t], g.shape[t], g.shape[t + 1]
    chunks = b.reshape(g, t, 1, [-1, chunk], (*lead, steps // chunk, chunk, width))
    lower = np.tril(np.ones((chunk, chunk), np.float32)).reshape((1,) * (t + 1) + (chunk, chunk))
    gamma = b.matmul(b.constant("cumsum", lower), chunks)  # [.., N, C, X]
    end = b.op("slice", gamma, shape=(*lead, steps // chunk, 1, width),
               attribs={"axes": [t + 1], "begin": [chunk - 1], "end": [chunk]})
    flat = lambda x: b.reshape(x, t, 2, [-1], (*lead, x.shape[t] * x.shape[t + 1], width))  # noqa: E731
    return flat(gamma), flat(end)


def chunk_ones(b: NnefBuilder, like: NTensor, chunk: int) -> NTensor:
    """Ones ``[.., N, 1]``, one per chunk, from ``like [.., N*C, 1]`` (scan_layout's; a tiny tensor)."""
    t = len(like.shape) - 2
    lead, steps = like.shape[:t], like.shape[t]
    chunks = b.reshape(like, t, 1, [-1, chunk], (*lead, steps // chunk, chunk, 1))
    first = b.op("slice", chunks, shape=(*lead, steps // chunk, 1, 1),
                 attribs={"axes": [t + 1], "begin": [0], "end": [1]})
    flat = b.reshape(first, t, 2, [-1], (*lead, steps // chunk, 1))
    return b.binary("add", b.binary("mul", flat, b.scalar(0.0, F32)), b.scalar(1.0, F32))


def chunk_scan(b: NnefBuilder, body: ModuleType, variant, heads: dict[str, NTensor], whole: dict[str, NTensor],
               s0: NTensor, dims: Dims, last: bool = False):
    """The chunk scan: (y ``[B, N*C, H, V]`` or head-major ``[B, H, N*C, V]``, state after the chunks, fragment).

    ``heads`` are the operands cut to their whole chunks, ``whole`` the uncut ones. q, k, v enter uncut: the
    scan runs as many steps as its first input (a per-chunk one, N = floor(T/C) entries) has, and reads nothing
    past them, so no copy of the first N*C tokens is made (a big symbolic-length copy runs ~10x slower in tract
    0.23.9 than the body's chunk reads)."""
    scanned = body.scan_inputs(b, variant, heads, whole, dims)
    masks = {name: b.constant(name, value) for name, value in body.masks(variant).items()}
    t = variant.token_axis  # the state's key axis: the states leave stacked along it
    fragment = scan_over_chunks(variant.name + ("_last" if last else ""), body.lines(variant),
                                {name: tuple(axis_chunk) for name, (_, *axis_chunk) in scanned.items()}, tuple(masks),
                                2 if variant.head_major else 1, variant.tokens, t, dims.width_k,
                                "last" if last else "full")
    batch, steps = heads["q"].shape[0], heads["q"].shape[2 if variant.head_major else 1]
    shape = (batch, dims.heads, steps, dims.width_v) if variant.head_major else (batch, steps, dims.heads, dims.width_v)
    y = b.tensor("chunk_y", shape, F32)
    states = list(s0.shape)
    states[t] *= 1 if last else steps // variant.tokens
    states = b.tensor("chunk_states", states, F32)
    b.multi_op(fragment.name, (*(x for x, *_ in scanned.values()), *masks.values(), s0), (y, states))
    return y, states if last else final_state(b, s0, states, t), fragment


def scan_over_chunks(name: str, body: list[str], scanned: dict[str, tuple[int, int]], masks: tuple[str, ...],
                     y_axis: int, y_chunk: int, state_axis: int, state_rows: int, state_output: str = "full") -> Fragment:
    """A chunk body and the ``tract_core_scan`` running it. ``scanned``: each scan input's (axis, chunk), C
    along the tokens, 1 for per-chunk inputs; ``masks`` are read whole every step. Outputs y (``y_chunk``
    tokens a step along ``y_axis``) and the state after every chunk (a "full" output: see the module doc),
    stacked along its key axis ``state_axis`` (``state_rows`` = K entries each): no axis of its own, which would
    be a size-1 axis in the body."""
    return nnef_scan.scan_fragment(
        f"{name}_scan", f"{name}_step", body, params=[*scanned, *masks, "s_init"], results=("y", "states"),
        scan=[(f"{x}_t", x, axis, chunk) for x, (axis, chunk) in scanned.items()], full=[(m, m) for m in masks],
        state=[("s_prev", "s_init", "s_t")],
        output=[("y_t", "full", y_axis, y_chunk),
                ("s_t", state_output, *((state_axis, state_rows) if state_output == "full" else (0, 1)))],
    )


# --- the tail, token by token ---------------------------------------------------------------------
def tail_fragment(num_householder: int, has_decay: bool) -> Fragment:
    """The elementwise per-token step of the scan lowering under its own name; its state leaves as a "last"
    output, so the tail always runs at least one step (see ``pad_step``)."""
    return elementwise_step_fragment("chunk_tail", num_householder, has_decay)


def pad_step(b: NnefBuilder, x: NTensor) -> NTensor:
    """``[R, ...]`` -> the first ``max(R, 1)`` steps of ``x ++ 0``: one zero step when R = 0.

    A zero step (q = k = e = u = 0, log-decay 0) leaves the state exactly as it is; it lets the tail scan
    use a "last" state output, which tract gets wrong (a scalar 0) for a scan of no iteration."""
    out = b.tensor("padded", (max(x.shape[0], 1), *x.shape[1:]), F32)
    b.multi_op(PAD.name, (x,), (out,), attribs={"padding": [(0, 1)] + [(0, 0)] * (len(x.shape) - 1)})
    return out


def token_part(b: NnefBuilder, ops, state: NTensor, dims: Dims):
    """The last ``R = S mod C`` tokens from ``state [B, H, K, V]`` (or ``[B, Hk, G, K, V]``): (y ``[1, B, H, R,
    V]``, final state ``[1, B, H, K, V]``)."""
    operands = step_inputs(b, ops, dims.groups, lambda x: pad_step(b, x))  # the zero step's decay is exp(0) = 1
    count = max(ops.q.shape[0], 1)
    y = b.tensor("tail_y", (1, dims.batch, dims.heads, count, dims.width_v), F32)
    final = b.tensor("tail_state", (1, dims.batch, dims.heads, dims.width_k, dims.width_v), F32)
    b.multi_op(tail_fragment(len(ops.keys), ops.log_decay is not None).name, (*operands, b.unsqueeze(heads_merged(b, state), [0])),
               (final, y))
    taken = b.tensor("tail_y_taken", (*y.shape[:3], ops.q.shape[0], y.shape[4]), F32)
    b.multi_op(TAKE.name, (y, ops.q), (taken,))
    return taken, final


# --- the tail in short chunks (GDN, DeltaNet) ------------------------------------------------------
TAIL_PAD = Fragment(name="gdn_export_tail_pad", extensions=EXTENSIONS, definition="""fragment gdn_export_tail_pad(
    input: tensor<scalar>, axis: integer, chunk: integer, padding: (integer, integer)[]
) -> ( output: tensor<scalar> ) {
    # input's axis (R entries) padded with zeros to chunk * ceil(max(R, 1) / chunk) entries: whole chunks, one at
    # least (a scan of no iteration returns a scalar 0 as its last state)
    length = squeeze(slice(tract_core_shape_of(input), axes = [0], begin = [axis], end = [axis + 1]), axes = [0]);
    padded = pad(input, padding = padding, border = 'constant', value = 0.0);
    output = slice(padded, axes = [axis], begin = [0], end = [((max(length, 1) + chunk - 1) / chunk) * chunk]);
}

""")

TAIL_TAKE = Fragment(name="gdn_export_tail_take", extensions=EXTENSIONS, definition="""fragment gdn_export_tail_take(
    input: tensor<scalar>, like: tensor<scalar>, axis: integer
) -> ( output: tensor<scalar> ) {
    # the first len(like) entries of input's axis (the tail's real tokens)
    length = squeeze(slice(tract_core_shape_of(like), axes = [0], begin = [axis], end = [axis + 1]), axes = [0]);
    output = slice(input, axes = [axis], begin = [0], end = [length]);
}

""")


def pad_to_chunks(b: NnefBuilder, x: NTensor, axis: int, chunk: int) -> NTensor:
    """x's ``axis`` (R entries) padded with zero tokens to ``chunk * ceil(max(R, 1) / chunk)``.

    A zero token (q = k = v = 0, beta = 0, log-decay 0) leaves the state exactly as it is and its output is
    dropped (``take_tail``): the L2 norm of a zero key is 0, its decay factor exp(0) = 1."""
    shape = list(x.shape)
    shape[axis] = -(-max(x.shape[axis], 1) // chunk) * chunk
    out = b.tensor("tail_padded", shape, x.dtype)
    padding = [(0, 0)] * len(shape)
    padding[axis] = (0, chunk)
    b.multi_op(TAIL_PAD.name, (x,), (out,), attribs={"axis": axis, "chunk": chunk, "padding": padding})
    return out


def pad_together(b: NnefBuilder, tails: dict[str, NTensor], axis: int, chunk: int) -> dict[str, NTensor]:
    """Every tail padded as ``pad_to_chunks`` pads it, with one padding for all those of one type whose time axis is
    the second (seq-major ``[B, R, ...]``): their trailing axes merged, concatenated along them, padded, then cut
    back on static bounds. A padding's bounds are symbolic expressions of S (``((max(S mod C, 1) + c - 1) / c) * c``)
    that tract's NNEF reader compares with every constant before it: measured, five of them per layer were ~60%
    of its slice wiring (issue 36). The tails are at most C - 1 tokens: the concatenation copies little."""
    if axis != 1:
        return {name: pad_to_chunks(b, x, axis, chunk) for name, x in tails.items()}
    padded = {}
    for dtype in dict.fromkeys(x.dtype for x in tails.values()):
        group = {name: x for name, x in tails.items() if x.dtype == dtype}
        flat = {name: b.merge_axes(x, 2, len(x.shape) - 2) if len(x.shape) > 3 else x for name, x in group.items()}
        if len(flat) == 1 or any(len(x.shape) != 3 for x in flat.values()):
            padded.update({name: pad_to_chunks(b, x, axis, chunk) for name, x in group.items()})
            continue
        width = sum(x.shape[2] for x in flat.values())
        both = b.op("concat", list(flat.values()), shape=(*next(iter(flat.values())).shape[:2], width),
                    attribs={"axis": 2})
        joined, start = pad_to_chunks(b, both, axis, chunk), 0
        for name, x in group.items():
            end = start + flat[name].shape[2]
            cut = b.op("slice", joined, shape=(*joined.shape[:2], end - start),
                       attribs={"axes": [2], "begin": [start], "end": [end]})
            padded[name] = b.split_axis(cut, 2, x.shape[2:]) if len(x.shape) > 3 else cut
            start = end
    return padded


def take_tail(b: NnefBuilder, x: NTensor, like: NTensor, axis: int) -> NTensor:
    """The first ``len(like)`` entries of x's ``axis``."""
    shape = list(x.shape)
    shape[axis] = like.shape[axis]
    out = b.tensor("tail_y", shape, x.dtype)
    b.multi_op(TAIL_TAKE.name, (x, like), (out,), attribs={"axis": axis})
    return out


def chunk_tail(b: NnefBuilder, body: ModuleType, node, dims: Dims, tails: dict[str, NTensor], state: NTensor,
               chunk: int):
    """The last ``R = S mod C`` tokens in chunks of ``chunk`` tokens of the same body (zero tokens pad the last),
    from ``state [B, H, K, V]`` (``[B, Hk, G, K, V]``): (y in the node's layout, final state (same shape), fragment).
    The scan always runs one chunk at least (a zero chunk when R = 0), so its state is a "last" output."""
    time_axis = 2 if node.head_major else 1
    padded = pad_together(b, tails, time_axis, chunk)
    y, final, scan = chunk_scan(b, body, body.variant(node, dims, chunk), padded, padded, state, dims, last=True)
    return take_tail(b, y, tails["q"], time_axis), final, scan


# --- outputs --------------------------------------------------------------------------------------
def heads_merged(b: NnefBuilder, state: NTensor) -> NTensor:
    """A body's state ``[B, H, K, V]``, or ``[B, Hk, G, K, V]`` with grouped heads, as ``[B, H, K, V]``."""
    return b.merge_axes(state, 1, 2) if len(state.shape) == 5 else state


def write_outputs(b: NnefBuilder, node, dims: Dims, y_head: NTensor, y_tail: NTensor, state: NTensor) -> None:
    """Chunk outputs (already in the node's layout) ++ tail outputs over time (the per-token tail's ``[1, B, H,
    R, V]``, or the chunk tail's, in the node's layout already); the state ``[B, H, K, V]`` (the chunk tail's) or
    ``[1, B, H, K, V]`` (the per-token tail's)."""
    axis = 2 if node.head_major else 1
    tail = y_tail
    if len(y_tail.shape) == 5:  # the per-token tail's
        tail = b.squeeze(y_tail, [0])  # [B, H, R, V]
        if not node.head_major:
            tail = b.transpose(tail, [0, 2, 1, 3])  # [B, R, H, V]
    shape = list(y_head.shape)
    shape[axis] = dims.seq
    if np.dtype(node.y.dtype) == np.dtype(F32):  # the concat itself is the output: it keeps its name in tract,
        b.op("concat", [y_head, tail], shape=shape, attribs={"axis": axis}, out=node.y)  # no renaming copy
    else:
        b.cast(b.op("concat", [y_head, tail], shape=shape, attribs={"axis": axis}), node.y.dtype, out=node.y)
    if len(state.shape) == 5:
        write_squeezed(b, state, node.s_final)
    else:
        b.cast(state, node.s_final.dtype, out=node.s_final)


# --- the whole lowering ---------------------------------------------------------------------------
def lower(b: NnefBuilder, node, dims: Dims, body: ModuleType, tokens: int, tail_tokens: int | None = None) -> list:
    """Write the chunked lowering of ``node`` with ``body`` (gdn.py or general.py), ``tokens`` real tokens a
    chunk (``tokens_per_chunk``), the tail in chunks of ``tail_tokens`` (None: token by token); return the
    fragments it uses."""
    variant = body.variant(node, dims, tokens)
    heads, whole, tails = cut_operands(b, node, dims, tokens, body.HEADS_READ)
    cuts = [SPLIT] if body.HEADS_READ is None else [SPLIT, REST]
    s0 = b.cast(node.s0, F32)  # [B, H, K, V]; with grouped heads [B, Hk, G, K, V]
    s0 = b.split_axis(s0, 1, [dims.key_heads, dims.groups]) if variant.grouped else s0
    y_head, state, scan = chunk_scan(b, body, variant, heads, whole, s0, dims)
    if tail_tokens:
        y_tail, final, tail_scan = chunk_tail(b, body, node, dims, tails, state, tail_tokens)
        write_outputs(b, node, dims, y_head, y_tail, heads_merged(b, final))  # [B, H, K, V]
        return [*cuts, FINAL, TAIL_PAD, TAIL_TAKE, scan, tail_scan]
    tail_ops = step_operands(b, dataclasses.replace(node, **tails), dims, substeps_split=dims.num_householder > 1)
    y_tail, final = token_part(b, tail_ops, state, dims)
    write_outputs(b, node, dims, y_head, y_tail, final)
    return [*cuts, FINAL, PAD, TAKE, scan, tail_fragment(dims.num_householder, tail_ops.log_decay is not None)]
