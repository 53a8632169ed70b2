"""Per-node decisions for the ONNX target: which ONNX form computes exactly a node's function.

The ONNX counterpart of ``emitter.decide`` (the NNEF one; ``decide`` here, of the same signature): the same ``Decision`` records, shown in the export and
convert reports. The ONNX graph itself is written by ``gdn_export.backends.onnx.rewrite``; this module only decides.

Gated delta rule (``t2n_extra::gated_delta_rule`` / ``gated_delta_scan``):

- ``contrib``: onnxruntime's ``com.microsoft::GatedDeltaNet`` (CPU provider), given float32 operands, a V-major
  state (``[B, H, V, K]``: the graph transposes ours, ``[B, H, K, V]``, in and out) and an explicit ``scale``
  (0.0 would mean 1/sqrt(K) to the op); q/k are L2-normalized by graph ops before it (the node's own eps 1e-6,
  added: the op's ``qk_l2_norm`` is never used, so its eps does not matter). Measured against
  ``ops.gated_delta_rule.reference`` on onnxruntime 1.32.0's CPU provider (``tests/test_onnx.py``): scalar decay
  (GDN, update_rule ``gated_delta``), per-key-channel decay ``[B, T, H, K]`` (KDA), no decay (DeltaNet,
  ``delta``), grouped heads (value head h reads key head h // (H/Hk): the op's "inverse GQA"), beta in (0, 2)
  (OLMo-Hybrid), T = 1..130 (the op's chunked prefill), batch 2: max error 2e-7 of max |output|. Not covered
  (the op has no such inputs): erase/write gates (GDN2), Householder sub-steps (Gated DeltaProduct). Refused too
  where the keys are not L2-normalized (the op's documentation: its chunked prefill needs unit keys) and for
  float64 operands (its state is float32 only). ``LinearAttention`` is not used: its grouping is the other way
  round (several query heads per key/value head and state), ours has several value heads per key head.
- ``scan``: a portable ONNX ``Scan`` over the reference recurrence (``ops/naive.py``), every variant; runs in
  onnxruntime and in tract's ONNX loader (tract runs ``Scan``, not ``Loop``). Its step reads the state with
  matmuls, or for runtime "tract-onnx" with elementwise multiply-reduces (measured 2-4x faster there, and
  1.4-1.7x slower in onnxruntime: ``benchmarks/bench_onnx.py``).

Short conv (``t2n_extra::causal_conv1d_update``): ``contrib`` is ``com.microsoft::CausalConvWithState`` with
``activation='silu'``, fed ``state[:, :, 1:]`` (the op keeps W-1 past inputs, our state W: the oldest never
reaches an output), the new state a slice of ``state ++ x`` as in the reference; ``portable`` a depthwise
``Conv`` over ``state[:, :, 1:] ++ x`` then SiLU.

MoE (``t2n_extra::moe_ffn``): always ``dense`` (every expert on every token, mixed by the routing weights: the
op's torch kernel), because no routed-expert op of standard ONNX exists, and onnxruntime's ``com.microsoft::MoE``
computes its own routing (softmax top-k) whose semantics were not verified against ours.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper

from gdn_export.backends.onnx.registry import (CONTRIB_VERIFIED, Context, OnnxOptions, ort_version, placeholder,
                                               symbolic)
from gdn_export.backends.onnx.symbolics import constant, is_none, placeholder_node, set_like
from gdn_export.backends.onnx.rewrite import Builder, MS_DOMAIN, DTYPES, operand_info
from gdn_export.errors import GdnExportError, LoweringError
from gdn_export.ops.gated_delta_rule.operands import Dims, validate_operands
from gdn_export.ops.protocol import Decision, record

RULE_QUALNAMES = ("t2n_extra::gated_delta_rule", "t2n_extra::gated_delta_scan")


def contrib_refusal(dims: Dims, *, normalized_keys: bool, float64: bool, scale: float | None,
                    runtime: str) -> str | None:
    """Why ``com.microsoft::GatedDeltaNet`` does not compute exactly this node (None: it does)."""
    if runtime != "onnxruntime":
        return f"contrib op is onnxruntime's only (runtime {runtime!r})"
    version = ort_version()
    if version is None or version < CONTRIB_VERIFIED:
        found = "not installed" if version is None else ".".join(map(str, version))
        return (f"GatedDeltaNet was verified on onnxruntime >= {'.'.join(map(str, CONTRIB_VERIFIED))} only "
                f"(here: {found})")
    if dims.gated_writes:
        return "erase/write gates (GDN2): GatedDeltaNet has only beta"
    if dims.num_householder != 1:
        return f"{dims.num_householder} Householder sub-steps per token (Gated DeltaProduct): GatedDeltaNet has one"
    if not normalized_keys:
        return "keys are not L2-normalized by the node: GatedDeltaNet's chunked prefill requires unit keys"
    if float64:
        return "float64 operands: GatedDeltaNet's state is float32 only"
    if scale == 0.0:
        return "scale 0: GatedDeltaNet reads scale=0 as 1/sqrt(K)"
    return None


@dataclass(frozen=True)
class RuleFacts:
    """One gated delta-rule placeholder as ``decide`` sees it (``ops.protocol.Node``): its validated sizes, and
    whether the node normalizes its keys, runs in float64, and the scale it gives q."""

    name: str
    entry: str
    dims: Dims
    normalized_keys: bool
    float64: bool
    scale: float | None


def decide(node: RuleFacts, plan: OnnxOptions) -> Decision:
    """The ONNX form of one gated delta-rule node (``ops.protocol.Decide``): the contrib op where asked for
    (``lowering="native"``) and exact, else the portable Scan (also for "auto" on onnxruntime, where it measured
    faster)."""
    name, entry, dims, runtime, lowering = node.name, node.entry, node.dims, plan.runtime, plan.lowering
    normalized_keys, float64, scale = node.normalized_keys, node.float64, node.scale
    why_not = contrib_refusal(dims, normalized_keys=normalized_keys, float64=float64, scale=scale, runtime=runtime)
    variant = ("per-channel decay (KDA)" if dims.channel_decay else "scalar decay (GDN)" if dims.has_decay
               else "no decay (DeltaNet)")
    if lowering == "native":
        if why_not is not None:
            raise LoweringError(f"{name}: lowering='native' (com.microsoft::GatedDeltaNet) cannot be exact: {why_not}")
        return Decision(name, entry, "contrib", f"requested (lowering='native') and exact: com.microsoft::"
                        f"GatedDeltaNet, {variant}, measured exact on onnxruntime 1.32 CPU", dims)
    if lowering == "scan":
        return Decision(name, entry, "scan", "requested (lowering='scan'): portable ONNX Scan over the reference "
                        "recurrence", dims)
    if runtime == "onnxruntime":
        # the fastest exact form, as for NNEF: on onnxruntime 1.32's CPU provider the Scan beat the contrib op
        contrib = ("com.microsoft::GatedDeltaNet would be exact too (lowering='native' takes it)" if why_not is None
                   else f"contrib op refused: {why_not}")
        return Decision(name, entry, "scan", f"portable ONNX Scan over the reference recurrence, the fastest exact "
                        f"form measured on onnxruntime 1.32's CPU provider (benchmarks/bench_onnx.py: 0.23 ms "
                        f"against GatedDeltaNet's 0.67 at S=1, 46-63 against 116-130 ms at S=128); {contrib}", dims)
    if runtime == "any":
        return Decision(name, entry, "scan", f"no runtime given: the portable ONNX Scan (runs in onnxruntime and "
                        f"tract's ONNX loader); {why_not}", dims)
    step = ("; step of elementwise multiply-reduces (faster in tract's ONNX loader than matmuls)"
            if runtime == "tract-onnx" else "")
    return Decision(name, entry, "scan", f"portable ONNX Scan over the reference recurrence; contrib op refused: "
                    f"{why_not}{step}", dims)


# --- the placeholder: what the TorchScript exporter writes for a node ----------------------------------
@symbolic(RULE_QUALNAMES[0])
def symbolic_rule(g, q, k, v, gate, beta, erase, write, s0, scale, use_qk_l2norm, num_householder):
    scale = float(constant(scale, "f"))
    norm = int(bool(constant(use_qk_l2norm, "b")))
    n = int(constant(num_householder, "i"))
    present = "".join("1" if not is_none(x) else "0" for x in (gate, beta, erase, write))
    operands = [q, k, v] + [x for x in (gate, beta, erase, write) if not is_none(x)] + [s0]
    y, state = placeholder_node(g, "GatedDeltaRule", operands, 2, scale_f=scale, use_qk_l2norm_i=norm,
                                num_householder_i=n, present_s=present, head_major_i=0)
    set_like(y, q, 4)
    set_like(state, s0, 4, torch.float32)
    return y, state


@symbolic(RULE_QUALNAMES[1])
def symbolic_scan(g, q, k, v, gate, beta, s0):
    y, state = placeholder_node(g, "GatedDeltaRule", [q, k, v, gate, beta, s0], 2, scale_f=1.0, use_qk_l2norm_i=0,
                                num_householder_i=1, present_s="1100", head_major_i=1)
    set_like(y, q, 4)
    set_like(state, s0, 4)
    return y, state


# --- the lowering: the placeholder replaced by the decided form ----------------------------------------
def _rule_parts(node, attrs, traced: list | None = None):
    """Operand names by role, their traced shapes and dtypes. ``traced``: the operands' shapes seen when the op ran
    on the example inputs (the graph's types can leave a head count symbolic); else the graph's static sizes."""
    shapes, dtypes = operand_info(attrs)
    if traced is not None:
        if len(traced) != len(shapes) or any(len(t) != len(s) or any(d not in (-1, e) for d, e in zip(s, t))
                                             for s, t in zip(shapes, traced)):
            raise GdnExportError(f"{node.name}: the operands' traced shapes {traced} disagree with the graph's {shapes}")
        shapes = [list(t) for t in traced]
    present = attrs["present"].decode() if isinstance(attrs["present"], bytes) else attrs["present"]
    roles = ["q", "k", "v"] + [r for r, p in zip(("g", "beta", "erase", "write"), present) if p == "1"] + ["s0"]
    if len(roles) != len(node.input) or len(shapes) != len(roles):
        raise GdnExportError(f"{node.name}: placeholder with {len(node.input)} operands, expected {roles}")
    # dynamic axes (-1: batch, time) get one stand-in length (time: 1 token, n sub-steps for k, v, beta) so that the
    # static sizes (heads, widths, sub-steps) are validated as the NNEF emitter validates them
    # a size the trace left symbolic besides B and T (a head count of a reshape to -1) is taken from an operand
    # that has it; validate_operands then checks them all as the NNEF emitter does
    n = int(attrs.get("num_householder", 1))
    head_major = bool(attrs.get("head_major", 0))
    layout = _HEAD_MAJOR if head_major else _SEQ_MAJOR
    known: dict[str, int] = {}
    for role, shape in zip(roles, shapes):
        for letter, d in zip(layout[role] if role != "g" or len(shape) == 4 else layout[role][:3], shape):
            if d != -1 and letter not in ("B", "T"):
                known.setdefault(letter, d)
    for role, shape in zip(roles, shapes):
        letters = layout[role] if role != "g" or len(shape) == 4 else layout[role][:3]
        for axis, (letter, d) in enumerate(zip(letters, shape)):
            if d == -1:
                stand_in = 1 if letter == "B" else (n if role in ("k", "v", "beta") else 1) if letter == "T" else None
                if stand_in is None and letter not in known:
                    raise GdnExportError(f"{node.name}: the size {letter} of operand {role} is not static in the trace")
                shape[axis] = stand_in if stand_in is not None else known[letter]
    return dict(zip(roles, node.input)), dict(zip(roles, shapes)), dict(zip(roles, dtypes))


# the axes of each operand (g: [.., H] or [.., H, K]); T is the time axis (T*n for k, v, beta)
_SEQ_MAJOR = {"q": "BTGK", "k": "BTGK", "v": "BTHV", "g": "BTHK", "beta": "BTH", "erase": "BTHK", "write": "BTHV",
              "s0": "BHKV"}
_HEAD_MAJOR = {"q": "BGTK", "k": "BGTK", "v": "BHTV", "g": "BHT", "beta": "BHT", "s0": "BHKV"}


def _l2norm(b: Builder, x: str) -> str:
    """x * 1/sqrt(sum(x^2) + 1e-6) over the last axis (ops/naive.py's l2norm: eps added)."""
    total = b.op("ReduceSum", [b.op("Mul", [x, x]), b.const([-1])], keepdims=1)
    eps = b.const(1e-6, np.float32)
    return b.op("Mul", [x, b.op("Reciprocal", [b.op("Sqrt", [b.op("Add", [total, eps])])])])


def _readout(b: Builder, state: str, x: str, elementwise: bool) -> str:
    """sum_k state[b, h, k, v] x[b, h, k]: [B, H, V]. ``elementwise``: Mul + ReduceSum (measured 2-4x faster in
    tract's ONNX loader, 1.4-1.7x slower in onnxruntime than the [1, K] x [K, V] MatMul; benchmarks/bench_onnx.py)."""
    if elementwise:
        return b.op("ReduceSum", [b.op("Mul", [state, b.unsqueeze(x, [3])]), b.const([2])], keepdims=0)
    return b.squeeze(b.op("MatMul", [b.unsqueeze(x, [2]), state]), [2])


def _scan_body(dims, roles: list[str], elementwise: bool = False) -> onnx.GraphProto:
    """One token: decay, then n delta sub-steps, then the readout (ops/naive.py's delta_rule_recurrence)."""
    b = Builder("body")
    H, K, V, n = dims.heads, dims.width_k, dims.width_v, dims.num_householder
    f = TensorProto.FLOAT
    shapes = {"q": [None, H, K], "k": [n, None, H, K], "v": [n, None, H, V],
              "g": [None, H, K] if dims.channel_decay else [None, H], "beta": [n, None, H],
              "erase": [None, H, K], "write": [None, H, V]}
    inputs = [helper.make_tensor_value_info("state_in", f, [None, H, K, V])]
    inputs += [helper.make_tensor_value_info(f"{r}_t", f, shapes[r]) for r in roles]
    state = "state_in"
    if "g" in roles:
        decay = b.op("Exp", ["g_t"])
        state = b.op("Mul", [state, b.unsqueeze(decay, [3] if dims.channel_decay else [2, 3])])
    for j in range(n):
        index = b.const(j)
        k_j = b.op("Gather", ["k_t", index], axis=0)
        v_j = b.op("Gather", ["v_t", index], axis=0)
        if "beta" in roles:
            beta_j = b.unsqueeze(b.op("Gather", ["beta_t", index], axis=0), [2])
            erase_key, written = b.op("Mul", [k_j, beta_j]), b.op("Mul", [v_j, beta_j])
        else:
            erase_key, written = b.op("Mul", [k_j, "erase_t"]), b.op("Mul", [v_j, "write_t"])
        retrieved = _readout(b, state, erase_key, elementwise)  # [B, H, V]
        update = b.op("Sub", [written, retrieved])
        state = b.op("Add", [state, b.op("Mul", [b.unsqueeze(k_j, [3]), b.unsqueeze(update, [2])])])
    b.op("Identity", [state], ["state_out"])
    b.op("Identity", [_readout(b, "state_out", "q_t", elementwise)], ["y_t"])
    outputs = [helper.make_tensor_value_info("state_out", f, [None, H, K, V]),
               helper.make_tensor_value_info("y_t", f, [None, H, V])]
    return helper.make_graph(b.nodes, "gated_delta_step", inputs, outputs)


def _lower_rule(b: Builder, node, decision, names, dims, attrs, dtypes, elementwise: bool = False) -> None:
    y_out, state_out = node.output
    head_major = bool(attrs.get("head_major", 0))
    f32 = TensorProto.FLOAT
    x = {role: b.cast(name, f32) for role, name in names.items()}
    if head_major:  # gated_delta_scan: [B, H, T, *] -> [B, T, H, *]
        for role in ("q", "k", "v"):
            x[role] = b.transpose(x[role], [0, 2, 1, 3])
        for role in ("g", "beta"):
            x[role] = b.transpose(x[role], [0, 2, 1])
    if attrs.get("use_qk_l2norm", 0):
        x["q"], x["k"] = _l2norm(b, x["q"]), _l2norm(b, x["k"])
    scale = float(attrs.get("scale", 1.0))
    out_dtype = DTYPES[dtypes["q"]]
    if head_major:  # y in promote_types(q, s0): at least float32 here
        out_dtype = TensorProto.DOUBLE if "Double" in (dtypes["q"], dtypes["s0"]) else f32
    state_dtype = DTYPES[dtypes["s0"]] if head_major else f32
    y_seq = b.name("y_seq") if head_major else y_out  # [B, T, H, V]; head-major entry: transposed at the end
    if head_major:
        b.nodes.append(helper.make_node("Transpose", [y_seq], [y_out], name=b.name("Transpose"), perm=[0, 2, 1, 3]))
        tail = b.nodes.pop()
    if decision.lowering == "contrib":
        s0 = b.transpose(x["s0"], [0, 1, 3, 2])  # V-major
        rule = "gated_delta" if "g" in x else "delta"
        y, s = b.op("GatedDeltaNet", [x["q"], x["k"], x["v"], "", x.get("g", ""), x["beta"], s0], 2,
                    domain=MS_DOMAIN, scale=scale, update_rule=rule)
        b.op("Cast", [y], [y_seq], to=out_dtype)
        b.op("Cast", [b.transpose(s, [0, 1, 3, 2])], [state_out], to=state_dtype)
        if head_major:
            b.nodes.append(tail)
        return

    q = b.op("Mul", [x["q"], b.const(scale, np.float32)]) if scale != 1.0 else x["q"]
    k = x["k"]
    if dims.groups > 1:  # value head h reads key head h // G (repeat_interleave)
        def grouped(t):
            expanded = b.op("Expand", [b.unsqueeze(t, [3]), b.const([1, 1, 1, dims.groups, 1])])
            return b.reshape(expanded, [0, 0, dims.heads, dims.width_k])
        q, k = grouped(q), grouped(k)
    n = dims.num_householder
    scanned, roles = [b.transpose(q, [1, 0, 2, 3])], ["q"]  # time-major [T, B, H, K]
    for role, t in (("k", k), ("v", x["v"])):  # [B, T*n, H, D] -> [T, n, B, H, D]
        width = dims.width_k if role == "k" else dims.width_v
        scanned.append(b.transpose(b.reshape(t, [0, -1, n, dims.heads, width]), [1, 2, 0, 3, 4]))
        roles.append(role)
    if "g" in x:
        scanned.append(b.transpose(x["g"], [1, 0, 2, 3] if dims.channel_decay else [1, 0, 2]))
        roles.append("g")
    if "beta" in x:
        scanned.append(b.transpose(b.reshape(x["beta"], [0, -1, n, dims.heads]), [1, 2, 0, 3]))
        roles.append("beta")
    for role in ("erase", "write"):
        if role in x:
            scanned.append(b.transpose(x[role], [1, 0, 2, 3]))
            roles.append(role)
    s_final, y_tm = b.op("Scan", [x["s0"], *scanned], 2, body=_scan_body(dims, roles, elementwise), num_scan_inputs=len(scanned))
    b.op("Cast", [b.transpose(y_tm, [1, 0, 2, 3])], [y_seq], to=out_dtype)
    b.op("Cast", [s_final], [state_out], to=state_dtype)
    if head_major:
        b.nodes.append(tail)


@placeholder("GatedDeltaRule", shaped=RULE_QUALNAMES)
def rewrite_rule(b: Builder, node, attrs: dict, context: Context) -> None:
    names, shapes, dtypes = _rule_parts(node, attrs, context.next_traced("GatedDeltaRule"))
    head_major = bool(attrs.get("head_major", 0))
    dims = validate_operands(shapes, head_major=head_major, num_householder=int(attrs.get("num_householder", 1)))
    entry = RULE_QUALNAMES[1 if head_major else 0]
    facts = RuleFacts(node.output[-1], entry, dims, normalized_keys=head_major or bool(attrs.get("use_qk_l2norm", 0)),
                      float64="Double" in dtypes.values(), scale=float(attrs.get("scale", 1.0)))
    decision = record(decide, facts, context.options, context.decisions)
    _lower_rule(b, node, decision, names, dims, attrs, dtypes, elementwise=context.options.runtime == "tract-onnx")
