"""Which lowering auto picks per tract version, what 'native' refuses, and that gdn_export's handlers run."""

import tarfile

import pytest
import torch

import gdn_export
from helpers import NAMES, GatedDeltaRuleModel, GatedDeltaScanModel, make_rule_inputs

FUSED, SCAN = "tract_transformers_gdn_recurrent", "gdn_export_delta_scan"


def graph_text(path):
    with tarfile.open(path) as archive:
        return archive.extractfile("graph.nnef").read().decode()


def lowering_in(path):
    text = graph_text(path)
    assert (FUSED in text) != (SCAN in text), "exactly one lowering expected in the graph"
    return "native" if FUSED in text else "scan"


DECODE_F16 = dict(seq=1, heads=(2, 2), width=128, dtype=torch.float16, dynamic=False)
CASES = {
    # case name: (inputs, expected lowering on 0.23.4, 0.23.5, 0.23.7, 0.23.9)
    "decode f16 K=V=128": (DECODE_F16, ["scan", "native", "native", "native"]),
    "decode f32 K=V=128": ({**DECODE_F16, "dtype": torch.float32}, ["scan", "scan", "native", "native"]),
    "prefill T=5 f16": ({**DECODE_F16, "seq": 5}, ["scan", "scan", "native", "native"]),
    "symbolic T f16": ({**DECODE_F16, "dynamic": True}, ["scan", "scan", "native", "native"]),
    "grouped heads f16": ({**DECODE_F16, "heads": (1, 2)}, ["scan", "scan", "native", "native"]),
    "K=V=64 f16": ({**DECODE_F16, "width": 64}, ["scan", "scan", "native", "native"]),
}
VERSIONS = ["0.23.4", "0.23.5", "0.23.7", "0.23.9"]


@pytest.mark.parametrize("name", list(CASES))
def test_auto_picks_per_tract_version(name, tmp_path):
    spec, expected = CASES[name]
    key_heads, heads = spec["heads"]
    inputs = make_rule_inputs(1, spec["seq"], key_heads, heads, spec["width"], spec["width"], spec["dtype"])
    dynamic = {n: {1: "S"} for n in NAMES["input_names"][:5]} if spec["dynamic"] else None
    for version, want in zip(VERSIONS, expected):
        path = tmp_path / f"{version}.nnef.tgz"
        report = gdn_export.export(GatedDeltaRuleModel(), inputs, path, tract_version=version, dynamic_axes=dynamic,
                                   check=False, **NAMES)
        assert lowering_in(path) == want == report.lowerings()[0], (version, report)
        assert f'("tract_target_version", "{version}")' in graph_text(path)


def test_native_on_an_impossible_case_names_the_reason(tmp_path):
    inputs = make_rule_inputs(1, 5, 2, 2, 64, 64, torch.float16)
    path = tmp_path / "x.nnef.tgz"
    with pytest.raises(gdn_export.LoweringError, match=r"tract 0\.23\.5 runs the fused op only for S = 1.*K = V = 64"):
        gdn_export.export(GatedDeltaRuleModel(), inputs, path, tract_version="0.23.5", lowering="native", **NAMES)
    with pytest.raises(gdn_export.LoweringError, match="0.23.4 has no tract_transformers_gdn_recurrent"):
        gdn_export.export(GatedDeltaRuleModel(), inputs, path, tract_version="0.23.4", lowering="native", **NAMES)
    assert list(tmp_path.iterdir()) == []


def test_unknown_lowering_is_refused(tmp_path):
    with pytest.raises(gdn_export.LoweringError, match="'fast' is not one of auto, native, scan"):
        gdn_export.export(GatedDeltaRuleModel(), make_rule_inputs(1, 1, 1, 1, 8, 8), tmp_path / "x.nnef.tgz",
                          lowering="fast", **NAMES)


def test_report_says_why(tmp_path):
    inputs = make_rule_inputs(1, 5, 2, 2, 32, 16)
    report = gdn_export.export(GatedDeltaRuleModel(), inputs, tmp_path / "x.nnef.tgz", **NAMES)
    (decision,) = report.decisions
    assert decision.lowering == "scan" and "K=32 != V=16" in decision.reason
    assert "scan - fused op refused: K=32 != V=16" in str(report)


def test_gdn_export_handler_replaces_torch_to_nnef_handler(tmp_path):
    """torch-to-nnef registers its own gated_delta_scan handler; ours must be the one that runs, during an export
    only: torch-to-nnef's own is back afterwards."""
    from torch_to_nnef.op.extras import _T2N_EXTRA_REGISTRY

    from gdn_export.backends.compat.torch_to_nnef import conversion
    from gdn_export.backends.nnef.registry import CUSTOM_OPS
    from gdn_export.ops.gated_delta_rule.nnef.handlers import handle_gated_delta_scan

    theirs = _T2N_EXTRA_REGISTRY.get("gated_delta_scan")
    assert theirs is not handle_gated_delta_scan
    with conversion(CUSTOM_OPS):
        assert _T2N_EXTRA_REGISTRY.get("gated_delta_scan") is handle_gated_delta_scan
    assert _T2N_EXTRA_REGISTRY.get("gated_delta_scan") is theirs
    q, k, v, g, beta, s0 = make_rule_inputs(1, 3, 2, 2, 16, 16)
    inputs = [x.transpose(1, 2).contiguous() for x in (q, k, v, g, beta)] + [s0]
    path = tmp_path / "op.nnef.tgz"
    report = gdn_export.export(GatedDeltaScanModel(), inputs, path, **NAMES)
    text = graph_text(path)
    # torch-to-nnef's handler would call its own `gated_delta_scan` fragment and record no decision
    assert SCAN in text and "fragment gated_delta_scan" not in text
    assert [d.entry for d in report.decisions] == ["t2n_extra::gated_delta_scan"]


@pytest.mark.parametrize("runtime,dtype,core_dtype,expected", [
    pytest.param("cpu", torch.float32, None, "chunked", marks=pytest.mark.slow),  # a chunked export: seconds
    pytest.param("cpu", torch.float16, None, "chunked", marks=pytest.mark.slow),
    ("cuda", torch.float16, None, "native"),
    ("cuda", torch.float32, None, "native"),
    ("cuda", torch.float32, "float16", "native"),
    ("any", torch.float32, None, "native"),
])
def test_runtime_policy_picks_the_fastest_exact_lowering(runtime, dtype, core_dtype, expected, tmp_path):
    inputs = make_rule_inputs(1, 5, 2, 2, 32, 32, dtype)
    path = tmp_path / "p.nnef.tgz"
    dynamic = {n: {1: "S"} for n in NAMES["input_names"][:5]}
    report = gdn_export.export(GatedDeltaRuleModel(), inputs, path, runtime=runtime, core_dtype=core_dtype,
                               dynamic_axes=dynamic, check=core_dtype is None, **NAMES)
    (decision,) = report.decisions
    assert decision.lowering == expected, decision
    assert ("rounded to float16" in decision.reason) == (core_dtype is not None)


@pytest.mark.slow
def test_cpu_policy_picks_chunked_for_every_variant_and_falls_back_where_it_is_not_exact(tmp_path):
    q, k, v, _, beta, s0 = make_rule_inputs(1, 5, 2, 2, 32, 32)

    class Rule(torch.nn.Module):
        def __init__(self, num_householder=1):
            super().__init__()
            self.num_householder = num_householder

        def forward(self, q, k, v, g, beta, s0):
            return gdn_export.gated_delta_rule(q, k, v, g, beta, s0, use_qk_l2norm=True,
                                              num_householder=self.num_householder)

    dynamic = {n: {1: "S"} for n in NAMES["input_names"][:5]}
    kda = gdn_export.export(Rule(), [q, k, v, -torch.rand(1, 5, 2, 32), beta, s0], tmp_path / "k.nnef.tgz",
                            runtime="cpu", dynamic_axes=dynamic, **NAMES)
    assert kda.lowerings() == ["chunked"], kda.decisions
    twice = lambda x: torch.cat([x, x], dim=1)  # noqa: E731  two sub-steps per token
    dynamic = {n: {1: "2*S" if n in ("k", "v", "beta") else "S"} for n in NAMES["input_names"][:5]}
    odd = gdn_export.export(Rule(2), [q, twice(k), twice(v), -torch.rand(1, 5, 2, 32), twice(beta), s0],
                            tmp_path / "p.nnef.tgz", runtime="cpu", dynamic_axes=dynamic, **NAMES)
    (decision,) = odd.decisions
    assert decision.lowering == "scan" and "chunked refused: per-channel decay with Householder" in decision.reason
    static = gdn_export.export(GatedDeltaRuleModel(), [q, k, v, -torch.rand(1, 5, 2), beta, s0],
                               tmp_path / "s.nnef.tgz", runtime="cpu", **NAMES)
    assert static.lowerings() == ["scan"] and "static S=5 holds no chunk" in static.decisions[0].reason


def test_unknown_runtime_is_refused(tmp_path):
    with pytest.raises(gdn_export.LoweringError, match="runtime 'tpu' is not one of any, cpu, cuda"):
        gdn_export.export(GatedDeltaRuleModel(), make_rule_inputs(1, 1, 1, 1, 8, 8), tmp_path / "x.nnef.tgz",
                          runtime="tpu", **NAMES)


def test_every_op_decides_through_the_one_signature():
    """ops/protocol.py: every op's ``decide``, per back-end, is ``decide(node, plan) -> Decision``, whatever the op
    (found by walking gdn_export/ops, so a new op's is checked too)."""
    import importlib
    import inspect
    import pkgutil

    import gdn_export.ops as ops
    from gdn_export.ops.protocol import Decision

    found = {}
    for info in pkgutil.walk_packages(ops.__path__, "gdn_export.ops."):
        module = importlib.import_module(info.name)
        decide = getattr(module, "decide", None)
        if callable(decide) and decide.__module__ == info.name:
            found[info.name] = decide
    assert {"gated_delta_rule", "causal_conv1d", "moe_ffn"} <= {name.split(".")[2] for name in found}, found
    for name, decide in found.items():
        params = list(inspect.signature(decide).parameters.values())
        assert [p.kind for p in params] == [inspect.Parameter.POSITIONAL_OR_KEYWORD] * 2, name
        assert decide.__annotations__["return"] in ("Decision", Decision), name  # a string under PEP 563


@pytest.mark.parametrize("runtime,dtype,version,expected", [
    ("cpu", "float32", (0, 23, 9), "chunks"), ("any", "float32", (0, 23, 9), "chunks"),
    ("cuda", "float32", (0, 23, 9), "native"),  # the chunk scan is measured on CPU only
    ("cpu", "float16", (0, 23, 9), "native"), ("cpu", "float16", (0, 22, 1), "portable")])
def test_short_conv_decision(runtime, dtype, version, expected):
    from gdn_export.ops.causal_conv1d.nnef import decide
    from gdn_export.ops.causal_conv1d.op import ConvNode
    from gdn_export.ops.options import NnefOptions

    decision = decide(ConvNode("y", dtype=dtype), NnefOptions(tract_version=version, runtime=runtime))
    assert decision.lowering == expected, decision
    # a conv with a bias (Mamba2's) never takes tract's fused op, which has none: NNEF's conv takes the bias
    biased = decide(ConvNode("y", dtype=dtype, bias=True), NnefOptions(tract_version=version, runtime=runtime))
    assert biased.lowering == ("portable" if expected == "native" else expected), biased
