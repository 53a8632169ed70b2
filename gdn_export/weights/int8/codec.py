"""int8 linear layers on tract's integer matmul kernels: the weights, the activation rounding, the NNEF lowering.

The math (symmetric, no zero points):

- a weight ``W [N, K]`` (an ``nn.Linear``'s, one row per output channel) is stored as codes
  ``Wq = round_half_even(W / ws)`` in ``[-127, 127]`` (int8) with one float32 scale per output channel,
  ``ws[n] = max_k |W[n, k]| * f32(1/127)``;
- its input ``x [..., K]`` is quantized inside the graph, per row (the last axis):
  ``xs = max(max_k |x|, 1e-30) * f32(1/127)``, ``xq = round_half_even(x * (1 / xs))`` (int8);
- ``y = f32(xq @ Wq^T) * xs * ws`` with the products summed in int32 (``tract_core_einsum_q``).

In exact arithmetic that is ``(xq * xs) @ (Wq * ws)^T``: a float linear layer on the rounded input and the
dequantized weight, which is how the check's reference computes it (``round_activations`` as a pre-hook of
transformers' own ``nn.Linear``, ``round_trip`` on its weight). The integer sums are exact in both as long as they
stay below 2^24, so the float rule still catches a wrong graph.

tract 0.23.9 writes this form itself when it saves an ONNX ``MatMulInteger`` model (no zero points) to NNEF, and
plans it on its int8 kernels (AVX2 8x8, AVX-VNNI, AVX-512 VNNI, AMX on x86). The asymmetric form (zero points)
would recompute a weight-sum correction on every call. ``lower_linears`` rewrites torch-to-nnef's ``linear`` of
each int8 weight into it, on torch-to-nnef's graph before it is written (a graph pass of the export's target,
``backends.nnef.target.OfflineTractTarget``); the codes are an int8 ``.dat`` (NNEF item type 4, 8 bits), the scales
a float32 one (``scale_writers``).
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Callable

import nnef
import numpy as np
import torch

from gdn_export.errors import GdnExportError
from gdn_export.weights.encoding import Encoding
from gdn_export.backends.nnef.builder import NnefBuilder, is_zero_literal, readers_left, table_gathers, variables

NAME = "int8"
INVERSE_127 = np.float32(1.0 / 127.0)  # written in the graph as its shortest decimal, read back to the same f32
INVERSE_254 = np.float32(1.0 / 254.0)  # the residual's scale over the row's: |residual| <= scale / 2 = 127 of them
SMALLEST_SCALE_INPUT = np.float32(1e-30)  # an all-zero row: scale 1e-30 / 127, codes 0, output 0 (no 0 * inf)
SCALE_SUFFIX = ".int8_scale"  # label of a weight's scales: the weight's label + this
CODE_LIMIT = 127


# x86 instructions tract's fast int8 kernels need (AVX-VNNI, AVX-512 VNNI, AMX); without them (AVX2 alone) tract
# 0.23.9's int8 matmul ran 30-300x slower than its f32 one (benchmarks/bench_int8_matmul.py, RESULTS.md 2026-12-03)
INT8_DOT_FLAGS = ("avx_vnni", "avx512_vnni", "amx_int8")


def slow_here_warning() -> str:
    """A line for the report when this machine is an x86 CPU without int8 dot-product instructions, else ""."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), None)
    if flags is None or "avx2" not in flags or any(f in flags for f in INT8_DOT_FLAGS):
        return ""
    return ("this CPU has AVX2 but none of " + ", ".join(INT8_DOT_FLAGS) + ": tract 0.23.9 runs these int8 matmuls "
            "30-300x slower than float32 here (benchmarks/RESULTS.md); the archive is for a host that has them")


def quantizable(shape: tuple[int, ...]) -> bool:
    """A matrix: one scale per row (output channel), any inner size."""
    return len(shape) == 2 and shape[0] > 0 and shape[1] > 0


def quantize(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``x [rows, K]`` (float) -> (int8 codes ``[rows, K]``, float32 scales ``[rows]``), symmetric per row."""
    values = np.ascontiguousarray(x, dtype=np.float32)
    scales = (np.abs(values).max(axis=1) * INVERSE_127).astype(np.float32)
    safe = np.where(scales > 0, scales, np.float32(1))
    codes = np.clip(np.rint(values / safe[:, None]), -CODE_LIMIT, CODE_LIMIT).astype(np.int8)
    return codes, scales


def dequantize(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    return codes.astype(np.float32) * scales[:, None]


def round_trip(x: torch.Tensor) -> torch.Tensor:
    """``x`` (a weight matrix) as tract computes with it once stored in int8 (same dtype as ``x``)."""
    values = x.detach().float().numpy()
    return torch.from_numpy(dequantize(*quantize(values))).to(x.dtype)


# The check's allowance for rounding flips: an input of the rounding within a few float32 roundings of a .5
# boundary rounds either way in two correct evaluations (tract's layers before it sum in another order than
# torch's), and a flipped code moves that output by one quantization step, which later layers (a recurrent state)
# carry on. The reference's own sensitivity to that is measured by rounding inputs perturbed by this relative
# amount (a few float32 roundings, 2^-20 ~ 8 ulp), and the export is judged against it as a float16 export is
# judged against the framework's float16 model (gdn_export/hf/check.py): typical per-position error.
ROUNDING_JITTER = 2.0 ** -20
# How many perturbed references make the baseline (rounding_envelope): each flips codes at other positions.
ROUNDING_SEEDS = 3


def rounding_envelope(expected: np.ndarray, runs: list[np.ndarray]) -> np.ndarray:
    """Per position ([B, S] of logits [B, S, V]), the perturbed run farthest from ``expected``: the baseline an int8
    export is judged against. One perturbed run understates the reference's own sensitivity where its first flip comes
    late (a recurrent state carries a flip on, and a trained model flips every few positions: on
    fixtures/qwen3_5_trained one seed was exact for 6 of 24 positions, so its first quartile of errors was 1e-5 while
    tract's, as correct, flipped at position 1); the envelope of several does not hang on where one seed's flip fell."""
    stacked = np.stack(runs)                                                  # [R, B, S, V]
    farthest = np.abs(stacked - expected[None]).max(-1).argmax(0)             # [B, S]
    return np.take_along_axis(stacked, farthest[None, ..., None], 0)[0]


def round_activations(x: torch.Tensor, jitter: torch.Generator | None = None, passes: int = 1) -> torch.Tensor:
    """``xq * xs``: ``x`` rounded per row (last axis) as the graph rounds it before its int8 matmul, in float32
    (the graph's order of operations: scale, its reciprocal, the product, round half to even). With ``passes`` 2,
    plus the residual ``x - xq * xs`` rounded the same way with the scale ``xs / 254`` (it is at most ``xs / 2``):
    ``xq * xs + rq * rs``, which the graph multiplies as two int8 rows (an int8 input of ~16 bits).
    ``jitter``: perturb ``x`` first by up to ``ROUNDING_JITTER`` (relative, uniform) drawn from it: the check's
    baseline."""
    values = x.float()
    if jitter is not None:
        noise = torch.rand(values.shape, generator=jitter, dtype=torch.float64) * 2 - 1
        values = (values.double() * (1 + ROUNDING_JITTER * noise)).float()
    scale = values.abs().amax(dim=-1, keepdim=True).clamp_min(float(SMALLEST_SCALE_INPUT)) * float(INVERSE_127)
    rounded = torch.round(values * (1.0 / scale))
    if passes == 1:
        return (rounded * scale).to(x.dtype)
    residual_scale = scale * float(INVERSE_254)
    residual = torch.round((values - rounded * scale) * (1.0 / residual_scale))
    return (rounded * scale + residual * residual_scale).to(x.dtype)


def nbytes(shape: tuple[int, ...]) -> int:
    """Codes and scales."""
    return int(np.prod(shape, dtype=np.int64)) + 4 * int(shape[0])


def write_header(file: BinaryIO, shape: tuple[int, ...], dtype: np.dtype = np.dtype(np.int8)) -> None:
    """The 128-byte NNEF header of an int8 tensor (item type 4, 8 bits: what ``nnef.write_tensor`` writes) or of a
    float32 one (item type 0)."""
    dtype = np.dtype(dtype)
    header = np.zeros(32, np.uint32)
    header[0] = np.frombuffer(bytes([0x4E, 0xEF, 1, 0]), np.uint32)[0]
    header[1], header[2] = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize, len(shape)
    header[3 : 3 + len(shape)] = shape
    header[11], header[12] = dtype.itemsize * 8, 4 if dtype == np.int8 else 0
    file.write(header.tobytes())


def write_nnef(file: BinaryIO, shape: tuple[int, ...], read_rows: Callable[[int, int], np.ndarray],
               slice_bytes: int = 64 << 20, negated: bool = False) -> np.ndarray:
    """The int8 ``.dat`` of a weight of ``shape`` read a slice of rows at a time (``read_rows(start, stop)``: float32);
    returns its scales (memory: one slice). ``negated`` (an int8 archive's table, see ``Int8Weights``): the codes
    and the scales both negated, the same products."""
    shape = tuple(shape)
    write_header(file, shape)
    step = max(1, slice_bytes // max(1, shape[1] * 4))
    scales = np.empty(shape[0], np.float32)
    for start in range(0, shape[0], step):
        stop = min(shape[0], start + step)
        codes, scales[start:stop] = quantize(read_rows(start, stop))
        file.write((-codes if negated else codes).tobytes())  # -127..127: negation is exact
    return -scales if negated else scales


@dataclass
class Int8Weights:
    """The int8 weights of an export: their labels, and the scales their writers computed (label -> ``[N]``).

    ``negated`` (embedding tables of an int8 archive): codes and scales stored negated (their products unchanged).
    A tied head's int8 copy would otherwise hold the very bytes of its table's codes (the same rule per row), and
    tract 0.23.9 keeps one constant for equal values (also after folding a reshape: a table declared [1, V, K] was
    merged too): read by a gather as well, the head's weights were then packed on every call instead of once at
    load (272 ms of a 626 ms decode step of the 0.8B shape; ``tract_quirks.EQUAL_CONSTANTS_MERGED``)."""

    labels: frozenset
    scales: dict = field(default_factory=dict)
    negated: bool = False
    passes: int = 1  # linear layers: their inputs rounded in 1 or 2 passes (``round_activations``)
    scale_shapes: dict = field(default_factory=dict)  # label -> shape of its scales in the graph (the graph pass's)


def lower_linears(graph, weights: Int8Weights) -> None:
    """Rewrite every ``linear`` of torch-to-nnef's NNEF graph (``nnef_tools.model.Graph``, before it is written: a
    graph pass of the export's target) whose weight is a variable of ``weights.labels`` (read as it is, or through
    the ``unsqueeze`` torch-to-nnef adds to align its rank with the input's) into the int8 form of the module
    docstring (``weights.passes`` 2: with the residual's codes, ``round_activations``); record in
    ``weights.scale_shapes`` the shape of each weight's scales (``scale_writers`` writes them). An input read by
    several int8 layers (q, k and v projections) is rounded once. Refused: a weight read at two ranks, or read
    otherwise than by a linear layer (its float values would be needed)."""
    if weights.passes not in (1, 2):
        raise GdnExportError(f"int8 activation passes must be 1 or 2, got {weights.passes}")
    edit = NnefBuilder(graph)
    declared = variables(graph, weights.labels)
    linears = []
    for op in graph.operations:
        if op.type != "linear" or len(op.inputs) != 3:
            continue
        operand = op.inputs[1].producer
        unsqueeze = operand if operand is not None and operand.type == "unsqueeze" else None
        variable = unsqueeze.inputs[0].producer if unsqueeze is not None else operand
        if variable is not None and variable.type == "variable" and variable.attribs["label"] in weights.labels:
            linears.append((op, variable, unsqueeze))
    ranks: dict[str, int] = {}
    rounded: dict = {}  # input tensor -> (its scale, its codes, the residual's scale or None)
    zero = None
    for op, variable, unsqueeze in linears:
        x, _, bias = op.inputs
        y = edit.take_output(op)
        label, weight = variable.attribs["label"], variable.outputs[0]
        rank = 2 + (len(unsqueeze.attribs["axes"]) if unsqueeze is not None else 0)
        if ranks.setdefault(label, rank) != rank:
            raise GdnExportError(f"int8 weight {label} is read at two ranks ({ranks[label]} and {rank})")
        if zero is None:
            zero = edit.op("tract_core_cast", edit.literal(0, np.int64), "i8_zero", np.int32, to="i32")
        if x not in rounded:
            rounded[x] = _rounded_input(edit, x, rank, weights.passes)
        scale, codes, residual_scale = rounded[x]
        rows = rank - 2
        n = int(variable.attribs["shape"][0])
        scale_shape = (1,) * (rank - 1) + (n,)
        weights.scale_shapes[label] = scale_shape
        weight_scale = edit.variable(f"{y.name}__i8_weight_scale", f"{label}{SCALE_SUFFIX}", scale_shape)
        batch = "abcdefgh"[: rank - 1]
        zero_name = nnef.Identifier(zero.name)  # a tensor as a named argument: tract's signature of the op
        total = edit.op("tract_core_einsum_q", [codes, weight], f"{y.name}__i8_sum", np.int32,
                        expr=f"{batch}k,nk,,,,,,,->{batch}n", acc="i32", output="i32", bias=zero_name, a0=zero_name,
                        a_scale=1.0, b0=zero_name, b_scale=1.0, c0=zero_name, c_scale=1.0)
        if weights.passes == 1:
            by_input = edit.op("mul", (edit.cast(total, np.float32, name=f"{y.name}__i8_sum_f32"), scale),
                               f"{y.name}__i8_by_input")
        else:  # the sums of the codes' rows, then of the residual's: [.., 2, S, N]
            sums = edit.op("reshape", total, f"{y.name}__i8_sums", np.int32,
                           attribs={"shape": [2, -1], "axis_start": rows, "axis_count": 1})
            halves = []
            for i in (0, 1):
                part = edit.op("slice", sums, f"{y.name}__i8_sums{i}_slice", np.int32, axes=[rows], begin=[i],
                               end=[i + 1])
                part = edit.op("squeeze", part, f"{y.name}__i8_sums{i}", np.int32, axes=[rows])
                halves.append(edit.cast(part, np.float32, name=f"{y.name}__i8_sums{i}_f32"))
            by_input = edit.op("add", (edit.op("mul", (halves[0], scale), f"{y.name}__i8_codes_part"),
                                       edit.op("mul", (halves[1], residual_scale), f"{y.name}__i8_residual_part")),
                               f"{y.name}__i8_by_input")
        if is_zero_literal(bias):
            edit.op("mul", (by_input, weight_scale), out=y)
        else:
            product = edit.op("mul", (by_input, weight_scale), f"{y.name}__i8_product")
            edit.op("add", (product, bias), out=y)
        edit.replace(op, unsqueeze)  # the unsqueeze goes with its last reader
    read = readers_left(graph, declared, ("tract_core_einsum_q",))
    if read:
        raise GdnExportError(f"{len(read)} int8 weights are read by the graph otherwise than by a linear layer "
                             f"(e.g. {min(read)}): their float values would be needed")


def _rounded_input(edit: "NnefBuilder", x, rank: int, passes: int) -> tuple:
    """The operations rounding input ``x`` (rank ``rank``) per row: (``{x}__i8_scale``, ``{x}__i8_codes``, with two
    passes ``{x}__i8_residual_scale`` else None; the codes are then the rows' and the residual's: ``[.., 2 S, K]``)."""
    name = x.name
    largest = edit.op("max_reduce", edit.op("abs", x, f"{name}__i8_abs"), f"{name}__i8_max_abs", axes=[rank - 1])
    scale = edit.op("mul", (edit.op("max", (largest, edit.literal(SMALLEST_SCALE_INPUT)), f"{name}__i8_max_abs_safe"),
                            edit.literal(INVERSE_127)), f"{name}__i8_scale")
    rounded = _round(edit, x, scale, f"{name}__i8_rounded", f"{name}__i8")
    if passes == 1:
        return scale, edit.cast(rounded, np.int8, name=f"{name}__i8_codes"), None
    rows = rank - 2
    residual = edit.op("sub", (x, edit.op("mul", (rounded, scale), f"{name}__i8_dequantized")), f"{name}__i8_residual")
    residual_scale = edit.op("mul", (scale, edit.literal(INVERSE_254)), f"{name}__i8_residual_scale")
    residual_codes = _round(edit, residual, residual_scale, f"{name}__i8_residual_codes", f"{name}__i8_residual")
    parts = [edit.op("unsqueeze", edit.cast(codes, np.int8, name=f"{codes.name}_i8"), f"{codes.name}_i8_row", np.int8,
                     axes=[rows]) for codes in (rounded, residual_codes)]
    both = edit.op("concat", parts, f"{name}__i8_both_codes", np.int8, axis=rows)
    codes = edit.op("reshape", both, f"{name}__i8_codes", np.int8,
                    attribs={"shape": [-1], "axis_start": rows, "axis_count": 2})
    return scale, codes, residual_scale


def _round(edit: "NnefBuilder", x, scale, name: str, prefix: str):
    """``round_half_even(x * (1 / scale))`` (in float32)."""
    inverse = edit.op("recip", scale, f"{prefix}_inverse_scale")
    return edit.op("tract_core_round_even", edit.op("mul", (x, inverse), f"{prefix}_scaled"), name)


def lower_gathers(graph, weights: Int8Weights) -> None:
    """Rewrite every ``tract_core_gather`` of rows of an int8 table (a variable of ``weights.labels``) of
    torch-to-nnef's NNEF graph (a graph pass, as ``lower_linears``) into gathers of the codes and of the rows'
    scales (``[V, 1]``) multiplied in float32; record each table's scale shape in ``weights.scale_shapes``. Refused:
    a table read otherwise than by a gather."""
    edit = NnefBuilder(graph)
    declared = variables(graph, weights.labels)
    for op in table_gathers(graph, weights.labels):
        table, y = op.inputs[0], edit.take_output(op)
        label = table.producer.attribs["label"]
        weights.scale_shapes[label] = (int(table.producer.attribs["shape"][0]), 1)
        scale_table = edit.variable(f"{y.name}__i8_scale_table", f"{label}{SCALE_SUFFIX}", weights.scale_shapes[label])
        codes = edit.op("tract_core_gather", (table, *op.inputs[1:]), f"{y.name}__i8_codes", np.int8,
                        attribs=op.attribs)
        scales = edit.op("tract_core_gather", (scale_table, *op.inputs[1:]), f"{y.name}__i8_scales",
                         attribs=op.attribs)
        edit.op("mul", (edit.cast(codes, np.float32, name=f"{y.name}__i8_codes_f32"), scales), out=y)
        edit.replace(op)
    read = readers_left(graph, declared, ("tract_core_gather",))
    if read:
        raise GdnExportError(f"{len(read)} int8 tables are read by the graph otherwise than by a gather "
                             f"(e.g. {min(read)})")


def scale_writers(weights: Int8Weights) -> dict[str, Callable[[BinaryIO], None]]:
    """The writer of each int8 weight's scales (label: the weight's + ``SCALE_SUFFIX``): a float32 ``.dat`` of the
    scales its codes' writer computed, in the shape the graph pass gave them (``[1, .., 1, N]`` for a linear layer's
    output, ``[V, 1]`` for a table's gathered rows). The export writes them after torch-to-nnef's writer ran (they
    are ``deferrable``), once every weight's codes, hence scales, are written."""
    return {f"{label}{SCALE_SUFFIX}": functools.partial(_write_scales, weights, label) for label in weights.labels}


def _write_scales(weights: Int8Weights, label: str, file: BinaryIO) -> None:
    if label not in weights.scales:
        raise GdnExportError(f"the scales of int8 weight {label} are written before its codes")
    values = np.ascontiguousarray(weights.scales[label], dtype=np.float32).reshape(weights.scale_shapes[label])
    write_header(file, values.shape, values.dtype)
    file.write(values.tobytes())


def linear_weights(module: torch.nn.Module, passes: int = 1):
    """``gdn_export.export(module, ..., weights=linear_weights(module), check=False)`` exports every ``nn.Linear`` of
    an in-memory ``module`` on int8 weights (codes written from its values, the graph's linears lowered as above,
    inputs rounded in ``passes``): the same machinery as a checkpoint's int8 conversion, for a module of one's own
    (tests, benchmarks)."""
    from gdn_export.weights.streamed import StreamedWeights

    names = {id(m.weight): name for name, m in module.named_modules() if isinstance(m, torch.nn.Linear)}
    labels = frozenset(f"{name}.weight" if name else "weight" for name in names.values())
    weights = Int8Weights(labels, passes=passes)

    def writer(label: str, param: torch.Tensor) -> Callable[[BinaryIO], None]:
        values = param.detach().float().numpy()

        def write(file: BinaryIO) -> None:
            weights.scales[label] = write_nnef(file, values.shape, lambda a, b: values[a:b])
        return write

    writers = {label: writer(label, param) for label, param in module.named_parameters() if label in labels}
    scales = scale_writers(weights)
    return StreamedWeights({**writers, **scales}, deferrable=dict.fromkeys(scales, "f32"),
                           graph_passes=(functools.partial(lower_linears, weights=weights),))


def reference_hooks(model: torch.nn.Module, linear_names: frozenset, jitter_seed: int | None = None,
                    passes: int = 1) -> list:
    """Round the input of each ``nn.Linear`` of ``model`` named in ``linear_names`` as the graph does
    (``round_activations`` in ``passes``): the check's reference of an int8 export; with ``jitter_seed``, its
    baseline (inputs perturbed first, ``ROUNDING_JITTER``). Returns the hook handles."""
    jitter = torch.Generator().manual_seed(jitter_seed) if jitter_seed is not None else None
    handles = []
    for name in sorted(linear_names):
        module = model.get_submodule(name)
        handles.append(module.register_forward_pre_hook(
            lambda module, args: (round_activations(args[0], jitter, passes), *args[1:])))
    return handles


# -- the codec protocol (gdn_export.weights.encoding): what the conversion asks of the int8 format --------------------

ROUNDS_INPUTS = True  # the check's reference rounds the inputs of the int8 layers as the graph does (reference_hooks)


def select(chosen: set, candidates: set, reference_is_linear) -> tuple[set, dict]:
    """Only weights whose reference is transformers' own ``nn.Linear`` (the check rounds that layer's input)."""
    emulable = {key for key in chosen if reference_is_linear(key)}
    return emulable, {"whose reference is no nn.Linear of transformers' model, or re-laid beyond a choice of rows":
                      len(chosen - emulable)}


def expert_stacks_kept(shapes: list, fused: bool) -> str:
    return "expert stacks (tract_moe_ffn takes f32, f16 or Q4_0 stacks: no operand for int8 scales)"


class Int8Encoding(Encoding):
    """int8 codes with a scale per row: the linear layers' weights (their graph's linears lowered to the integer
    matmul) or the embedding tables (their gathers take codes and scales); the scales are written after the pass."""

    def __init__(self, labels: frozenset, passes: int = 1, negated: bool = False, tables: bool = False) -> None:
        self.weights = Int8Weights(labels, passes=passes, negated=negated)
        lower = lower_gathers if tables else lower_linears
        super().__init__(sys.modules[__name__], labels, graph_passes=(functools.partial(lower, weights=self.weights),),
                         extra=scale_writers(self.weights))
        self.table_words = "int8 (a scale per row, applied to the gathered rows"

    def write(self, file: BinaryIO, shape: tuple[int, ...], read_rows, label: str, aliases: tuple,
              source: str) -> None:
        scales = write_nnef(file, shape, read_rows, negated=self.weights.negated)
        self.weights.scales.update(dict.fromkeys(aliases, scales))


def weights_encoding(labels: frozenset, report) -> Int8Encoding:
    return Int8Encoding(labels, passes=report.int8_passes)


def table_encoding(labels: frozenset, negated: bool) -> Int8Encoding:
    return Int8Encoding(labels, negated=negated, tables=True)


def tables_encoding(dtype: str, pick) -> Int8Encoding:
    """An int8 archive's tables in int8 too, stored negated: a tied head's int8 copy would otherwise be the same
    constant as its table for tract (``Int8Weights``)."""
    return table_encoding(pick(sys.modules[__name__]), negated=True)


def describe(report) -> str:
    return "; inputs rounded in 2 passes (codes and residual)" if report.int8_passes == 2 else ""
