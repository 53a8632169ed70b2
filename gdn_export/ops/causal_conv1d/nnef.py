"""``t2n_extra::causal_conv1d_update`` in NNEF: a ``tract_core_scan`` over chunks of tokens in f32, else tract's fused op.

"chunks" (a conv computing in f32: f32 and int8 archives, every tract version): x ``[B, C, S]`` and the state
``[B, C, W]`` are moved to channels last (``[B, S, C]``, ``[B, W, C]``: the model feeds the op in_proj's ``[B, S, C]``
output transposed and transposes the output back, so tract cancels these transposes against the model's own), then
a ``tract_core_scan`` runs over chunks of ``CHUNK`` tokens. Its body sees concrete shapes: ``full = window ++ x_c``
(``[B, W + CHUNK, C]``), ``y_c = silu(sum_i full[:, 1 + i : 1 + i + CHUNK] * weight[:, i])`` summed in the
reference's order, and the next window ``full[:, CHUNK:]``. tract runs a last partial chunk padded (its rows past S
are never read: the conv is causal, so the first S rows of the scan's output depend on real inputs only) and the
output is cut to S; the new state is the last W of ``state ++ x[max(S - W, 0):]``, at most 2W rows copied.

Why a scan: over a symbolic S, tract 0.23.9 runs a binary op of two ``[B, S, C]`` tensors and a slice of one on
its slow generic path (~2 ms each for C = 6144, S = 128), while inside the body every op has its fast kernel.
Measured (benchmarks/bench_short_conv.py, C = 6144, W = 4, one thread, f32; RESULTS.md, 2026-12-03): S = 128 in
2.5-2.9 ms against 10-26 ms for tract's fused ``tract_transformers_causal_conv1d_update``, 6-12 ms for W shifted
slices over the symbolic S, 4.4 stacked and summed, 8 for a scan over single tokens and 80-130 ms for NNEF's
depthwise ``conv`` (tract makes it im2col + a matrix product over a symbolic S); S = 1 in 0.11 ms against 0.28.

An f16 conv keeps tract's fused op ("native", from 0.23.5; before it "portable", NNEF's depthwise ``conv`` over
``state[:, :, 1:] ++ x``): tract's f16 arithmetic makes the chunks ~3x slower than the fused op for one token
(1.2 against 0.4 ms, the decode step); at S = 128 they took 38-40 ms where the fused op took 11.5 ms in one run
and 270 ms in others (its time swings between runs, f32 too: 10-26 and 140-330 ms), and computed in f32 between
casts 136-144 ms. Not measured in a model yet: an f16 model keeps what it had.

The fused op's swing: in ``Runnable.run`` (a fresh state each call, as a Session runs) it was often 10x slower than
in ``profile_json`` (one state, many runs), so a model's profile understates it; compare prefill tokens/s.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from nnef_tools.model import Tensor as NTensor
from torch_to_nnef.op.fragment import Fragment

from gdn_export.backends.nnef import scan as nnef_scan
from gdn_export.backends.nnef.builder import NnefBuilder
from gdn_export.backends.nnef.registry import custom_op, output_tensors, positional, require_tract
from gdn_export.ops.causal_conv1d.op import ConvNode, check_conv_operands
from gdn_export.ops.options import policy_of
from gdn_export.ops.protocol import Decision, record

if TYPE_CHECKING:
    from gdn_export.ops.options import NnefOptions

FUSED_CONV_FIRST_VERSION = (0, 23, 5)
OP_NAME = "tract_transformers_causal_conv1d_update"
CHUNK = 4  # tokens per scan iteration (bench_short_conv.py, C = 6144: S = 128 in 2.5 ms at 4, 2.6 at 8 and 16, 3.3 at 64;
# a decode step computes one whole chunk: S = 1 in 0.11 ms at 4, 0.19 at 8, 0.3-1.8 at 16)


def fragment(width: int, chunk: int = CHUNK, bias: bool = False) -> Fragment:
    """The short conv of width ``width`` over chunks of ``chunk`` tokens: ``gdn_export_conv_w{W}_c{chunk}(x [B, S, C],
    window [B, W, C], weight [1, W, C]) -> (y [B, S, C], last [B, W, C])``, SiLU applied, in the operands' dtype;
    with ``bias`` (``..._bias``), a fourth operand ``bias [1, 1, C]`` added to the sum before the SiLU."""
    name = f"gdn_export_conv_w{width}_c{chunk}" + ("_bias" if bias else "")
    taps = [f"    t{i} = mul(slice(full, axes = [1], begin = [{1 + i}], end = [{1 + i + chunk}]), "
            f"slice(weight, axes = [1], begin = [{i}], end = [{i + 1}]));" for i in range(width)]
    total = "t0"
    for i in range(1, width):  # ((t0 + t1) + t2) + t3: the reference's order of the sum
        total = f"add({total}, t{i})"
    if bias:  # after the taps' sum, as the reference adds it
        total = f"add({total}, bias)"
    body = ["    full = concat([window_prev, x_c], axis = 1);", *taps, f"    acc = {total};", "    y_c = acc * sigmoid(acc);",
            f"    window_c = slice(full, axes = [1], begin = [{chunk}], end = [{chunk + width}]);"]
    return nnef_scan.scan_fragment(
        name, f"{name}_step", body, params=("x", "window", "weight") + (("bias",) if bias else ()), results=("y", "last"),
        bound=("unused", "padded"), scan=[("x_c", "x", 1, chunk)],
        full=[("weight", "weight")] + ([("bias", "bias")] if bias else []), state=[("window_prev", "window", "window_c")],
        output=[("window_c", "last", 1, 1), ("y_c", "full", 1, chunk)],
        before=["    # a last partial chunk runs padded: its window is never read, its rows past S are cut"],
        after=["    length = squeeze(slice(tract_core_shape_of(x), axes = [0], begin = [1], end = [2]), axes = [0]);",
               "    y = slice(padded, axes = [1], begin = [0], end = [length]);",
               "    # the last W of window ++ x, from at most 2W rows; the bounds are shape expressions, so its length is W",
               f"    both = concat([window, slice(x, axes = [1], begin = [max(length - {width}, 0)], end = [length])], "
               "axis = 1);",
               "    count = squeeze(slice(tract_core_shape_of(both), axes = [0], begin = [1], end = [2]), axes = [0]);",
               f"    last = slice(both, axes = [1], begin = [count - {width}], end = [count]);"],
    )


def decide(node: ConvNode, options: NnefOptions) -> Decision:
    """The short conv (``ops.protocol.Decide``): "chunks" where it computes in f32 (f32 and int8 archives; the
    module docstring) for a CPU (runtime "cpu" or "any"), else tract's fused op ("native", from 0.23.5), else NNEF's
    depthwise conv ("portable"); a conv with a bias never takes the fused op, which has none."""
    if node.dtype == "float32" and options.runtime != "cuda":
        return Decision(node.name, node.entry, "chunks", f"a tract_core_scan over chunks of {CHUNK} tokens, channels "
                        "last (f32: S = 128 ~4x and S = 1 ~2.5x faster than the fused op, benchmarks/"
                        "bench_short_conv.py)", None)
    why = (f"{node.dtype}: tract's f16 arithmetic makes the scan ~3x slower than the fused op for one token"
           if node.dtype != "float32" else
           # measured on CPU only; tract's CUDA runtime ran the GDN's scans at CPU speed (ops/gated_delta_rule/nnef/policy.py)
           "runtime cuda: the chunk scan is not measured there, the fused op is kept")
    if node.bias:
        return Decision(node.name, node.entry, "portable", f"a conv bias: {OP_NAME} has none ({why})", None)
    if options.tract_version >= FUSED_CONV_FIRST_VERSION:
        return Decision(node.name, node.entry, "native", f"{OP_NAME} exists on this tract ({why})", None)
    return Decision(node.name, node.entry, "portable", f"{OP_NAME} is not in tract before 0.23.5 ({why})", None)


def lower(builder: NnefBuilder, x: NTensor, weight: NTensor, state: NTensor, y: NTensor, new_state: NTensor,
          lowering: str, bias: NTensor | None = None) -> list:
    width = int(weight.shape[1])
    if lowering == "chunks":
        return _lower_chunks(builder, x, weight, state, y, new_state, bias)
    if lowering == "native":
        assert bias is None, "decide never gives a conv with a bias the fused op"
        weight = builder.cast(weight, x.dtype)
        state_in = builder.cast(state, x.dtype)
        out = builder.tensor("conv_y", x.shape, x.dtype)
        carried = builder.tensor("conv_state", state.shape, x.dtype)
        builder.multi_op(OP_NAME, (x, weight, state_in), (out, carried))
        builder.cast(out, y.dtype, out=y)  # see fused.py: outputs of a fused op share one name
        builder.cast(carried, new_state.dtype, out=new_state)
        return ["tract_transformers"]

    # state[:, :, 1:] ++ x holds S + W - 1 columns, so a valid depthwise conv of width W gives exactly S: tract
    # proves that length, where W shifted slices of state ++ x had lengths it could not equate with S
    dtype = np.dtype(weight.dtype)
    tail = builder.op("slice", builder.cast(state, x.dtype), shape=(x.shape[0], x.shape[1], width - 1),
                      attribs={"axes": [2], "begin": [1], "end": [width]}, what="conv_tail")
    full_shape = (x.shape[0], x.shape[1], x.shape[2] + width - 1)
    full = builder.op("concat", [tail, x], shape=full_shape, dtype=x.dtype, attribs={"axis": 2}, what="conv_full")
    full = builder.cast(full, dtype)
    kernel = builder.unsqueeze(weight, [1])  # [C, 1, W]: one input channel per group
    offset = builder.scalar(0.0, dtype) if bias is None else \
        builder.unsqueeze(builder.cast(bias, dtype), [0])  # NNEF conv's bias [1, C]
    total = builder.op("conv", (full, kernel, offset), shape=x.shape, dtype=dtype, what="conv",
                       attribs={"border": "constant", "padding": [(0, 0)], "stride": [1], "dilation": [1],
                                "groups": 0})
    activated = builder.binary("mul", total, builder.unary("sigmoid", total))
    builder.cast(activated, y.dtype, out=y)
    last = builder.op("dyn_slice_begin", full, shape=(x.shape[0], x.shape[1], width),
                      attribs={"axis": 2, "begin": -width, "stride": 1}, what="conv_last")
    builder.cast(last, new_state.dtype, out=new_state)
    # torch-to-nnef's fragment: a slice whose bound counts from the end of a symbolic axis
    return ["dyn_slice_begin", "within_bound_index"]


def _lower_chunks(builder: NnefBuilder, x: NTensor, weight: NTensor, state: NTensor, y: NTensor,
                  new_state: NTensor, bias: NTensor | None = None) -> list:
    batch, channels, seq = x.shape
    width = int(weight.shape[1])
    dtype = np.dtype(weight.dtype)  # the reference's arithmetic: (state ++ x) in the weight's dtype
    rows = builder.cast(builder.transpose(x, [0, 2, 1]), dtype)  # [B, S, C]: cancels the model's own transpose
    window = builder.transpose(builder.cast(state, dtype), [0, 2, 1])  # [B, W, C]
    taps = builder.unsqueeze(builder.transpose(weight, [1, 0]), [0])  # [1, W, C]
    conv = fragment(width, bias=bias is not None)
    out = builder.tensor("conv_y", (batch, seq, channels), dtype)
    last = builder.tensor("conv_last", (batch, width, channels), dtype)
    offset = () if bias is None else (builder.unsqueeze(builder.cast(bias, dtype), [0, 1]),)  # [1, 1, C]
    builder.multi_op(conv.name, (rows, window, taps, *offset), (out, last))
    builder.transpose(builder.cast(out, y.dtype), [0, 2, 1], out=y)
    builder.transpose(builder.cast(last, new_state.dtype), [0, 2, 1], out=new_state)
    return [conv]


@custom_op("causal_conv1d_update")
def handle_causal_conv1d_update(g, node, name_to_tensor, op_helper, inference_target, **kwargs):
    """The GDN short conv: a scan over chunks of tokens in f32, tract's fused op or a depthwise conv (``decide``)."""
    require_tract(inference_target, node.kind)
    x, weight, state, *rest = positional(op_helper, node)
    bias = rest[0] if rest else None
    check_conv_operands(x.shape, weight.shape, state.shape, None if bias is None else bias.shape)
    y, new_state = output_tensors(op_helper, node, name_to_tensor)
    target = policy_of(inference_target)
    dtype = np.dtype(weight.dtype)  # the dtype the conv computes in (the reference's)
    decision = record(decide, ConvNode(y.name, dtype=str(dtype), bias=bias is not None), target.gdn_options,
                      target.gdn_decisions)
    return lower(NnefBuilder(g, y.name), x, weight, state, y, new_state, decision.lowering, bias)
