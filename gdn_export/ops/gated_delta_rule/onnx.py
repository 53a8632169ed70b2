"""Per-node decisions for the ONNX target: which ONNX form computes exactly a node's function.

The ONNX counterpart of ``emitter.decide`` (the NNEF one): the same ``Decision`` records, shown in the export and
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

from gdn_export.errors import LoweringError
from gdn_export.ops.gated_delta_rule.emitter import Decision
from gdn_export.ops.gated_delta_rule.operands import Dims

RUNTIMES = ("onnxruntime", "tract-onnx", "any")
# what lowering= may ask of the ONNX target: "native" is the contrib op (the fused form, as for NNEF)
LOWERINGS = ("auto", "native", "scan")
CONTRIB_VERIFIED = (1, 32)  # onnxruntime version whose contrib ops were measured exact (older ones: not used)

RULE_QUALNAMES = ("t2n_extra::gated_delta_rule", "t2n_extra::gated_delta_scan")
CONV_QUALNAME = "t2n_extra::causal_conv1d_update"
MOE_QUALNAME = "t2n_extra::moe_ffn"


def validate(runtime: str, lowering: str) -> None:
    if runtime not in RUNTIMES:
        raise LoweringError(f"runtime {runtime!r} is not one of {', '.join(RUNTIMES)} for an ONNX export")
    if lowering not in LOWERINGS:
        raise LoweringError(f"lowering {lowering!r} is not available for an ONNX export (one of "
                            f"{', '.join(LOWERINGS)}; 'native' is onnxruntime's contrib op)")


def _ort_version() -> tuple[int, int] | None:
    try:
        import onnxruntime
    except ImportError:
        return None
    try:
        major, minor = onnxruntime.__version__.split(".")[:2]
        return int(major), int(minor)
    except ValueError:
        return None


def contrib_refusal(dims: Dims, *, normalized_keys: bool, float64: bool, scale: float | None,
                    runtime: str) -> str | None:
    """Why ``com.microsoft::GatedDeltaNet`` does not compute exactly this node (None: it does)."""
    if runtime != "onnxruntime":
        return f"contrib op is onnxruntime's only (runtime {runtime!r})"
    version = _ort_version()
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


def decide_rule(name: str, entry: str, dims: Dims, *, normalized_keys: bool, float64: bool, scale: float | None,
                runtime: str, lowering: str) -> Decision:
    """The ONNX form of one gated delta-rule node: the contrib op where asked for (``lowering="native"``) and
    exact, else the portable Scan (also for "auto" on onnxruntime, where it measured faster)."""
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


def decide_conv(name: str, runtime: str, lowering: str) -> Decision:
    if runtime == "onnxruntime" and lowering != "scan":
        version = _ort_version()
        if version is not None and version >= CONTRIB_VERIFIED:
            return Decision(name, CONV_QUALNAME, "contrib", "com.microsoft::CausalConvWithState (activation silu) on "
                            "state[:, :, 1:] (its W-1 past inputs); the new state a slice of state ++ x", None)
    return Decision(name, CONV_QUALNAME, "portable", "depthwise ONNX Conv over state[:, :, 1:] ++ x, then SiLU", None)


def decide_moe(name: str, gate: str) -> Decision:
    return Decision(name, MOE_QUALNAME, "dense", "every expert on every token, mixed by the routing weights (the "
                    "op's torch kernel): ONNX has no routed-expert op, and onnxruntime's com.microsoft::MoE computes "
                    f"its own routing, not verified against this node's ({gate})", None)
