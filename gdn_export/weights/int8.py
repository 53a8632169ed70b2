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
each int8 weight into it; the codes are an int8 ``.dat`` (NNEF item type 4, 8 bits), the scales a float32 one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Callable

import numpy as np
import torch

from gdn_export.errors import GdnExportError

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


def write_scales(path: Path, scales: np.ndarray, shape: tuple[int, ...]) -> None:
    """A weight's scales as a float32 ``.dat`` of ``shape`` (``[1, .., 1, N]`` for a linear layer's output,
    ``[V, 1]`` for a table's gathered rows)."""
    values = np.ascontiguousarray(scales, dtype=np.float32).reshape(shape)
    with open(path, "wb") as file:
        write_header(file, values.shape, values.dtype)
        file.write(values.tobytes())


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


LINEAR = re.compile(r"^(\s*)(\w+)\s*=\s*linear\((\w+),\s*(\w+),\s*([^;]*)\);\s*$")
VARIABLE = re.compile(r"^\s*(\w+)\s*=\s*variable<scalar>\(label\s*=\s*'([^']+)',\s*shape\s*=\s*\[([^\]]*)\]\);\s*$")
UNSQUEEZE = re.compile(r"^\s*(\w+)\s*=\s*unsqueeze\((\w+),\s*axes\s*=\s*\[([^\]]*)\]\);\s*$")


def lower_linears(graph: str, labels: frozenset, passes: int = 1) -> tuple[str, dict[str, int]]:
    """``graph`` (torch-to-nnef's text) with every ``linear`` whose weight is a variable of ``labels`` (read as it
    is, or through the ``unsqueeze`` torch-to-nnef adds to align its rank with the input's) rewritten into the int8
    form of the module docstring (``passes`` 2: with the residual's codes, ``round_activations``); returns the
    graph and, per label, the rank its scales must have. An input read by several int8 layers (q, k and v
    projections) is rounded once."""
    if passes not in (1, 2):
        raise GdnExportError(f"int8 activation passes must be 1 or 2, got {passes}")
    lines = graph.split("\n")
    variables, unsqueezed, uses = {}, {}, {}
    for line in lines:
        if m := VARIABLE.match(line):
            variables[m.group(1)] = (m.group(2), [int(d) for d in m.group(3).split(",") if d.strip()])
        elif m := UNSQUEEZE.match(line):
            unsqueezed[m.group(1)] = (m.group(2), len([a for a in m.group(3).split(",") if a.strip()]))
    for name in re.findall(r"(?<![\w.'])[A-Za-z_]\w*(?![\w'])", graph):
        uses[name] = uses.get(name, 0) + 1
    out, quantized_inputs, ranks, dropped = [], set(), {}, set()
    zero_declared = False
    for line in lines:
        m = LINEAR.match(line)
        weight = m and (unsqueezed[m.group(4)][0] if m.group(4) in unsqueezed else m.group(4))
        if not m or weight not in variables or variables[weight][0] not in labels:
            out.append(line)
            continue
        indent, y, x, operand, bias = m.groups()
        label, shape = variables[weight]
        rank = 2 + (unsqueezed[operand][1] if operand in unsqueezed else 0)
        if operand in unsqueezed and uses.get(operand, 0) == 2:  # defined, then read by this linear only
            dropped.add(operand)
        if ranks.setdefault(label, rank) != rank:
            raise GdnExportError(f"int8 weight {label} is read at two ranks ({ranks[label]} and {rank})")
        scale, codes = f"{x}__i8_scale", f"{x}__i8_codes"
        if not zero_declared:
            out.append(f"{indent}i8_zero = tract_core_cast(0, to = 'i32');")
            zero_declared = True
        if x not in quantized_inputs:
            quantized_inputs.add(x)
            out += _rounded_input(indent, x, rank, passes)
        batch = "abcdefgh"[: rank - 1]
        expr = f"{batch}k,nk,,,,,,,->{batch}n"
        shape_text = ", ".join(["1"] * (rank - 1) + [str(shape[0])])
        out.append(f"{indent}{y}__i8_weight_scale = variable<scalar>(label = '{label}{SCALE_SUFFIX}', "
                   f"shape = [{shape_text}]);")
        out.append(f"{indent}{y}__i8_sum = tract_core_einsum_q([{codes}, {weight}], expr = '{expr}', acc = 'i32', "
                   "output = 'i32', bias = i8_zero, a0 = i8_zero, a_scale = 1.0, b0 = i8_zero, b_scale = 1.0, "
                   "c0 = i8_zero, c_scale = 1.0);")
        if passes == 1:
            product = f"mul(mul(tract_core_cast({y}__i8_sum, to = 'f32'), {scale}), {y}__i8_weight_scale)"
        else:  # the sums of the codes' rows, then of the residual's: [.., 2, S, N]
            rows = rank - 2
            out.append(f"{indent}{y}__i8_sums = reshape({y}__i8_sum, shape = [2, -1], axis_start = {rows}, "
                       "axis_count = 1);")
            halves = [f"tract_core_cast(squeeze(slice({y}__i8_sums, axes = [{rows}], begin = [{i}], end = [{i + 1}]), "
                      f"axes = [{rows}]), to = 'f32')" for i in (0, 1)]
            product = (f"mul(add(mul({halves[0]}, {scale}), mul({halves[1]}, {x}__i8_residual_scale)), "
                       f"{y}__i8_weight_scale)")
        has_bias = bias.strip() not in ("0.0", "0")
        out.append(f"{indent}{y} = {'add(' + product + ', ' + bias.strip() + ')' if has_bias else product};")
    if dropped:
        out = [line for line in out if not ((m := UNSQUEEZE.match(line)) and m.group(1) in dropped)]
    # a weight the graph declares but reads otherwise than through a linear layer would need its float values (one it
    # does not declare at all, e.g. a checkpoint weight a family re-lays into others, is never written)
    declared = {label for label, _ in variables.values()}
    missing = (labels & declared) - set(ranks)
    if missing:
        raise GdnExportError(f"{len(missing)} int8 weights are read by the graph otherwise than by a linear layer "
                             f"(e.g. {min(missing)}): their float values would be needed")
    return "\n".join(out), ranks


def _rounded_input(indent: str, x: str, rank: int, passes: int) -> list[str]:
    """The lines rounding input ``x`` (rank ``rank``) per row: ``{x}__i8_scale`` and ``{x}__i8_codes`` (with two
    passes also ``{x}__i8_residual_scale``, and the codes are the rows' then the residual's: ``[.., 2 S, K]``)."""
    scale, codes = f"{x}__i8_scale", f"{x}__i8_codes"
    lines = [f"{indent}{scale} = mul(max(max_reduce(abs({x}), axes = [{rank - 1}]), "
             f"{_literal(SMALLEST_SCALE_INPUT)}), {_literal(INVERSE_127)});"]
    if passes == 1:
        return lines + [f"{indent}{codes} = tract_core_cast(tract_core_round_even(mul({x}, recip({scale}))), "
                        "to = 'i8');"]
    rows = rank - 2
    rounded, residual = f"{x}__i8_rounded", f"{x}__i8_residual"
    return lines + [
        f"{indent}{rounded} = tract_core_round_even(mul({x}, recip({scale})));",
        f"{indent}{residual} = sub({x}, mul({rounded}, {scale}));",
        f"{indent}{x}__i8_residual_scale = mul({scale}, {_literal(INVERSE_254)});",
        f"{indent}{x}__i8_residual_codes = tract_core_round_even(mul({residual}, recip({x}__i8_residual_scale)));",
        f"{indent}{codes} = reshape(concat([unsqueeze(tract_core_cast({rounded}, to = 'i8'), axes = [{rows}]), "
        f"unsqueeze(tract_core_cast({x}__i8_residual_codes, to = 'i8'), axes = [{rows}])], axis = {rows}), "
        f"shape = [-1], axis_start = {rows}, axis_count = 2);"]


def _literal(value: np.float32) -> str:
    return np.format_float_scientific(value, unique=True) if value < 1e-4 else \
        np.format_float_positional(value, unique=True)


GATHER = re.compile(r"^(\s*)(\w+)\s*=\s*tract_core_gather\((\w+),([^;]*)\);\s*$")


def lower_gathers(graph: str, labels: frozenset) -> tuple[str, dict[str, int]]:
    """``graph`` with every ``tract_core_gather`` of rows of an int8 table (a variable of ``labels``) gathering the
    codes and the rows' scales (``[V, 1]``) and multiplying them in float32; returns the graph and, per label, the
    rank of its scales (2)."""
    variables = {m.group(1): m.group(2) for m in map(VARIABLE.match, graph.split("\n")) if m}
    out, ranks = [], {}
    for line in graph.split("\n"):
        m = GATHER.match(line)
        if not m or variables.get(m.group(3)) not in labels:
            out.append(line)
            continue
        indent, y, table, rest = m.groups()
        label = variables[table]
        rows = re.search(rf"variable<scalar>\(label\s*=\s*'{re.escape(label)}',\s*shape\s*=\s*\[(\d+)", graph).group(1)
        ranks[label] = 2
        out += [f"{indent}{y}__i8_scale_table = variable<scalar>(label = '{label}{SCALE_SUFFIX}', shape = [{rows}, 1]);",
                f"{indent}{y}__i8_codes = tract_core_gather({table},{rest});",
                f"{indent}{y}__i8_scales = tract_core_gather({y}__i8_scale_table,{rest});",
                f"{indent}{y} = mul(tract_core_cast({y}__i8_codes, to = 'f32'), {y}__i8_scales);"]
    missing = (labels & set(variables.values())) - set(ranks)
    if missing:
        raise GdnExportError(f"{len(missing)} int8 tables are read by the graph otherwise than by a gather "
                             f"(e.g. {min(missing)})")
    return "\n".join(out), ranks


def lower_folder(folder: Path, weights: Int8Weights, gathers: bool = False) -> None:
    """Rewrite ``folder``'s graph.nnef (``lower_linears``, or ``lower_gathers`` for tables) and write each weight's
    scales beside its codes."""
    path = folder / "graph.nnef"
    graph, ranks = lower_gathers(path.read_text(), weights.labels) if gathers else \
        lower_linears(path.read_text(), weights.labels, weights.passes)
    for label, rank in ranks.items():
        shape = (-1, 1) if gathers else (1,) * (rank - 1) + (-1,)
        write_scales(folder / f"{label}{SCALE_SUFFIX}.dat", weights.scales[label], shape)
    path.write_text(graph)


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
