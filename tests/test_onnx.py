"""ONNX export (gdn_export/backends/onnx): per-node decisions, onnxruntime's contrib ops and the portable Scan against the
reference, every GDN family converted and checked in onnxruntime (prefill + decode, batch 1 and 2), the portable
form in tract's ONNX loader too, and the errors of bad inputs."""

import json

import numpy as np
import pytest
import torch

pytest.importorskip("onnxruntime")

import gdn_export  # noqa: E402
from gdn_export.cli import main as cli  # noqa: E402
from gdn_export.errors import GdnExportError, LoweringError  # noqa: E402
from gdn_export.ops.gated_delta_rule.naive import l2norm  # noqa: E402

from helpers import FIXTURES, by_fixture  # noqa: E402


# --- the op: contrib GatedDeltaNet and the portable Scan against the reference, per variant ----------------------

class Rule(torch.nn.Module):
    def __init__(self, **options):
        super().__init__()
        self.options = options

    def forward(self, q, k, v, g, beta, s0):
        return gdn_export.gated_delta_rule(q, k, v, g, beta, s0, **self.options)


def _operands(B=2, T=5, Hk=2, H=4, K=8, V=6, decay="head", n=1, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, Hk, K, generator=gen)
    k = torch.randn(B, T * n, Hk, K, generator=gen)
    v = torch.randn(B, T * n, H, V, generator=gen)
    g = {"head": -torch.rand(B, T, H, generator=gen), "key": -torch.rand(B, T, H, K, generator=gen), None: None}[decay]
    beta = 2 * torch.rand(B, T * n, H, generator=gen)  # beta in (0, 2): OLMo-Hybrid's negative eigenvalues
    s0 = torch.randn(B, H, K, V, generator=gen)
    return q, k, v, g, beta, s0


def _export_rule(tmp_path, runtime, options, operands, lowering="auto"):
    names = ["q", "k", "v", "g", "beta", "s0"]
    keep = [i for i, t in enumerate(operands) if t is not None]
    args = [operands[i] for i in keep]

    class Bound(torch.nn.Module):  # absent operands (DeltaNet's g) are None, not graph inputs
        def __init__(self):
            super().__init__()
            self.rule = Rule(**options)

        def forward(self, *given):
            full = [None] * 6
            for i, t in zip(keep, given):
                full[i] = t
            return self.rule(*full)

    n = options.get("num_householder", 1)
    steps = "T" if n == 1 else f"{n}*T"  # k, v, beta carry T*n steps: one symbol, or an expression of it
    axes = {"q": {0: "B", 1: "T"}, "k": {0: "B", 1: steps}, "v": {0: "B", 1: steps}, "g": {0: "B", 1: "T"},
            "beta": {0: "B", 1: steps}, "s0": {0: "B"}}
    input_names = [names[i] for i in keep]
    return gdn_export.export(Bound(), args, tmp_path / f"rule_{runtime}.onnx", format="onnx", runtime=runtime,
                             lowering=lowering, input_names=input_names, output_names=["o", "state"],
                             dynamic_axes={n: axes[n] for n in input_names}), Bound(), input_names


VARIANTS = {  # name: (gated_delta_rule options, operands)
    "gdn": ({"use_qk_l2norm": True}, {}),
    "gdn_scale": ({"use_qk_l2norm": True, "scale": 0.3}, {"Hk": 4}),
    "kda": ({"use_qk_l2norm": True}, {"decay": "key"}),
    "deltanet": ({"use_qk_l2norm": True}, {"decay": None}),
    "deltaproduct": ({"use_qk_l2norm": True, "num_householder": 2}, {"n": 2}),
    "unnormalized": ({}, {}),
}
CONTRIB = {"gdn", "gdn_scale", "kda", "deltanet"}


@pytest.mark.parametrize("lowering", ["auto", "native"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_rule_decision_and_parity(tmp_path, variant, lowering):
    """onnxruntime: the Scan for "auto" (the faster form there), the contrib op for "native" exactly where it computes
    the node (else the Scan, with the reason); the export's own check compares every output with torch (1e-4
    relative), then other shapes (T = 1 and a long prefill that runs the op's chunked path, batch 1) are run
    against the reference too."""
    options, shape = VARIANTS[variant]
    lowering = lowering if variant in CONTRIB else "auto"  # "native" is refused where inexact (tested below)
    report, module, names = _export_rule(tmp_path, "onnxruntime", options, _operands(**shape), lowering=lowering)
    [decision] = report.decisions
    assert decision.lowering == ("contrib" if lowering == "native" else "scan"), decision.reason
    if variant == "deltaproduct":
        assert "Householder" in decision.reason
    if variant == "unnormalized":
        assert "L2-normalized" in decision.reason
    from gdn_export.run.onnx_session import run_model

    for B, T in ((1, 1), (1, 130)):
        args = [t for t in _operands(B=B, T=T, seed=1, **{k: v for k, v in shape.items()}) if t is not None]
        with torch.no_grad():
            expected = module(*args)
        _, actual = run_model(report.path, [a.numpy() for a in args])
        for e, a in zip(expected, actual):
            assert np.abs(a - e.numpy()).max() <= 1e-4 * np.abs(e.numpy()).max(), (variant, B, T)


@pytest.mark.parametrize("variant", ["gdn", "kda", "deltaproduct"])
def test_rule_scan_in_tract(tmp_path, variant):
    """runtime tract-onnx: the portable Scan, checked in tract's ONNX loader against torch."""
    options, shape = VARIANTS[variant]
    report, _, _ = _export_rule(tmp_path, "tract-onnx", options, _operands(**shape))
    assert report.lowerings() == ["scan"]
    assert "onnxruntime's only" in report.decisions[0].reason
    assert report.parity.ok


def test_native_refused_where_inexact(tmp_path):
    options, shape = VARIANTS["deltaproduct"]
    with pytest.raises(LoweringError, match="Householder"):
        _export_rule(tmp_path, "onnxruntime", options, _operands(**shape), lowering="native")
    assert not list(tmp_path.iterdir())  # nothing left behind


def test_gated_delta_scan_entry(tmp_path):
    """The head-major op (q/k pre-normalized by the caller): contrib on onnxruntime, Scan on tract, both exact."""
    class Scan(torch.nn.Module):
        def forward(self, q, k, v, g, beta, s0):
            return gdn_export.gated_delta_scan(q, k, v, g, beta, s0)

    gen = torch.Generator().manual_seed(0)
    B, Hk, H, T, K, V = 2, 2, 4, 6, 8, 8
    args = (l2norm(torch.randn(B, Hk, T, K, generator=gen)) / K ** 0.5, l2norm(torch.randn(B, Hk, T, K, generator=gen)),
            torch.randn(B, H, T, V, generator=gen), -torch.rand(B, H, T, generator=gen),
            torch.rand(B, H, T, generator=gen), torch.randn(B, H, K, V, generator=gen))
    for runtime, lowering in (("onnxruntime", "contrib"), ("tract-onnx", "scan")):
        report = gdn_export.export(Scan(), args, tmp_path / f"scan_{runtime}.onnx", format="onnx", runtime=runtime,
                                   lowering="native" if lowering == "contrib" else "auto",
                                   input_names=["q", "k", "v", "g", "beta", "s0"], output_names=["y", "s"],
                                   dynamic_axes={n: {0: "B"} for n in ("q", "k", "v", "g", "beta", "s0")})
        assert report.lowerings() == [lowering] and report.parity.ok


# --- Hugging Face fixtures: convert to ONNX, check in onnxruntime (and tract's ONNX loader) ---------------------

@pytest.fixture(scope="module")
def onnx_converted(tmp_path_factory):
    """``onnx_converted(name, runtime="onnxruntime", dtype="float32", lowering="auto") -> Path``: converted once per module
    through the CLI, unchecked (the tests check)."""
    folder = tmp_path_factory.mktemp("onnx")
    done = {}

    def get(name, runtime="onnxruntime", dtype="float32", lowering="auto"):
        if (name, runtime, dtype, lowering) not in done:
            out = folder / f"{name}-{runtime}-{dtype}-{lowering}.onnx"
            status = cli(["convert", str(FIXTURES / name), "-o", str(out), "--runtime", runtime, "--dtype", dtype,
                          "--lowering", lowering, "--no-check"])
            assert status == 0
            done[name, runtime, dtype, lowering] = out
        return done[name, runtime, dtype, lowering]

    return get


def _metadata(path):
    from gdn_export.run.onnx_session import read_onnx_metadata

    return read_onnx_metadata(path)


GDN_FAMILIES = ["qwen3_5", "qwen3_next", "olmo_hybrid", "kimi_linear", "fla_gated_deltanet"]


@pytest.mark.parametrize("name", by_fixture(*GDN_FAMILIES))
def test_family_onnxruntime(onnx_converted, name):
    """Contrib ops on every gated delta-rule layer (``--lowering native``); the check against the reference (prefill
    16 + decode 8, the f32 rule) at batch 1 and 2, through ``gdn_export.check`` (what ``gdn-export check`` runs for
    a .onnx)."""
    path = onnx_converted(name, lowering="native")
    metadata = _metadata(path)
    rules = [d for d in metadata["decisions"] if d["entry"] == "t2n_extra::gated_delta_rule"]
    assert rules and all(d["lowering"] == "contrib" for d in rules), rules
    assert all(d["lowering"] == "contrib" for d in metadata["decisions"]
               if d["entry"] == "t2n_extra::causal_conv1d_update")
    for batch in (1, 2):
        result = gdn_export.check(path, FIXTURES / name, prompt_len=16, decode_steps=8, batch=batch)
        assert result.ok and result.dtype == "float32", (batch, str(result))


@pytest.mark.parametrize("name", by_fixture("qwen3_5", "kimi_linear", "fla_gated_deltaproduct", "qwen4_exp"))
def test_family_portable_scan_in_tract(onnx_converted, name):
    """runtime tract-onnx: portable Scan and Conv, no contrib op; checked in tract's ONNX loader and onnxruntime,
    batch 1 and 2 (Qwen4-Exp: its QSA indexer and hyper-connections too, whose reshapes stay symbolic in B and S:
    symbolics._unflatten)."""
    from gdn_export.hf.checkpoint import open_checkpoint
    from gdn_export.pipeline.convert import check_with
    from gdn_export.run.onnx_session import OnnxSession

    import onnx

    path = onnx_converted(name, "tract-onnx")
    model = onnx.load(str(path), load_external_data=False)
    assert not [n for n in model.graph.node if n.domain == "com.microsoft"]
    assert "Scan" in {n.op_type for n in model.graph.node}
    family, layout, _, weights = open_checkpoint(FIXTURES / name)
    for runtime in ("tract-onnx", "onnxruntime"):
        for batch in (1, 2):
            result = check_with("full", OnnxSession(path, runtime), family, layout, weights, 16, 8, batch)
            assert result.ok, (runtime, batch, str(result))


# every fixture family
ALL_FAMILIES = GDN_FAMILIES + ["qwen3_5_moe", "lara_mini", "fla_kda", "fla_delta_net", "fla_gated_deltaproduct",
                               "qwen4_exp"]


@pytest.mark.parametrize("name", by_fixture(*ALL_FAMILIES))
def test_every_family_float32_and_float16(onnx_converted, name):
    """The default ONNX export (``--runtime onnxruntime``, auto lowering) of every fixture family, f32 and f16, checked
    in onnxruntime against the reference at batch 1 and 2, prefill 16 + decode 8: f32 by the f32 rule, f16 by the
    project's reduced-precision rule (no worse than the reference's own float16, top-1 on decisive positions)."""
    for dtype in ("float32", "float16"):
        path = onnx_converted(name, dtype=dtype)
        for batch in (1, 2):
            result = gdn_export.check(path, FIXTURES / name, prompt_len=16, decode_steps=8, batch=batch)
            assert result.ok and result.dtype == dtype, (dtype, batch, str(result))
            assert result.need_top1 == (dtype == "float16")


@pytest.mark.parametrize("name", by_fixture("qwen3_5_moe"))
@pytest.mark.slow  # converts a fixture
def test_moe_dense_and_report(tmp_path, name):
    """convert(format="onnx") with its check: MoE dense (the decision says so), decisions in the report."""
    report = gdn_export.convert(FIXTURES / name, tmp_path / "moe.onnx", format="onnx")
    text = str(report)
    assert "moe (" in text and "dense - " in text and "GatedDeltaNet" in text and "check in onnxruntime" in text
    assert report.check.ok
    assert [p.name for p in tmp_path.iterdir()] == ["moe.onnx"]


@pytest.mark.xdist_group("qwen3_5")
def test_symbolic_dims_and_names(onnx_converted):
    """The same input/output names and state layout as the NNEF graph; B, S, P symbolic."""
    import onnx

    from gdn_export.hf.checkpoint import open_checkpoint
    from gdn_export.pipeline.convert import state_names

    path = onnx_converted("qwen3_5")
    model = onnx.load(str(path))
    family, _, hf_model, _ = open_checkpoint(FIXTURES / "qwen3_5")
    inputs, outputs, _ = state_names(family.exportable(hf_model, torch.float32))
    assert [i.name for i in model.graph.input] == inputs
    assert [o.name for o in model.graph.output] == outputs
    dims = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
    assert dims["input_ids"] == ["B", "S"]
    assert dims["in_key_1"][0] == "B" and dims["in_key_1"][2] == "P"
    assert dims["in_state_0"][0] == "B" and all(isinstance(d, int) for d in dims["in_state_0"][1:])
    assert json.loads(next(p.value for p in model.metadata_props if p.key == "gdn_export"))["container"] == "onnx"


@pytest.mark.slow  # converts a fixture
def test_external_data(tmp_path, monkeypatch):
    """Above the threshold the weights go to OUT.onnx.data (renamed in first); the file still runs and checks."""
    from gdn_export.backends.onnx import exporter

    monkeypatch.setattr(exporter, "EXTERNAL_DATA_BYTES", 1024)
    out = tmp_path / "ext.onnx"
    report = gdn_export.convert(FIXTURES / "qwen3_5", out, format="onnx", prompt_len=4, decode_steps=2)
    assert report.check.ok and (tmp_path / "ext.onnx.data").is_file()
    assert "external data" in str(report)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ext.onnx", "ext.onnx.data"]


# --- bad inputs ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv,message", [
    (["--format", "tflite"], "invalid choice"),
    (["--quantize", "q4_0"], "--quantize is not available with --format onnx"),
    (["--runtime", "cuda"], "--runtime cuda is tract's"),
    (["--lowering", "chunked"], "--lowering chunked is not available"),
    (["--core-dtype", "float16"], "--core-dtype is not available"),
])
def test_cli_usage_errors(tmp_path, capsys, argv, message):
    status = cli(["convert", str(FIXTURES / "qwen3_5"), "-o", str(tmp_path / "m.onnx"), *argv]) \
        if argv[0] != "--format" else None
    if status is None:
        with pytest.raises(SystemExit) as exit_info:
            cli(["convert", str(FIXTURES / "qwen3_5"), "-o", str(tmp_path / "m.onnx"), *argv])
        status = exit_info.value.code
    assert status == 2
    assert message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_cli_runtimes_are_the_back_ends():
    """The CLI's --runtime choices are every back-end's rule (one table, gdn_export.targets) and each back-end
    validates against it: the NNEF plan, the ONNX plan and the runner of .onnx files."""
    import argparse

    from gdn_export.backends.onnx.registry import RUNTIMES as ONNX
    from gdn_export.cli import parser
    from gdn_export.ops.gated_delta_rule.nnef.policy import RUNTIMES as NNEF
    from gdn_export.run.onnx_session import RUNTIMES as RUNNERS

    actions = [a for a in parser()._subparsers._group_actions if isinstance(a, argparse._SubParsersAction)]
    runtime = next(a for a in actions[0].choices["convert"]._actions if "--runtime" in a.option_strings)
    assert set(runtime.choices) == set(NNEF) | set(ONNX)
    assert set(RUNNERS) == set(ONNX) - {"any"}


def test_format_and_suffix_errors(tmp_path, capsys):
    assert cli(["convert", str(FIXTURES / "qwen3_5"), "-o", str(tmp_path / "m.nnef.tgz"), "--format", "onnx"]) == 2
    assert "writes a .onnx file" in capsys.readouterr().err
    assert cli(["convert", str(FIXTURES / "qwen3_5"), "-o", str(tmp_path / "m.nnef.tgz"), "--runtime",
                "onnxruntime"]) == 2
    assert "--runtime onnxruntime is for --format onnx" in capsys.readouterr().err
    with pytest.raises(GdnExportError, match="format 'tflite'"):
        gdn_export.convert(FIXTURES / "qwen3_5", tmp_path / "m.onnx", format="tflite")
    with pytest.raises(GdnExportError, match="quantize='q4_0' is an NNEF option"):
        gdn_export.convert(FIXTURES / "qwen3_5", tmp_path / "m.onnx", format="onnx", quantize="q4_0")
    with pytest.raises(GdnExportError, match="must end with .onnx"):
        gdn_export.convert(FIXTURES / "qwen3_5", tmp_path / "m.nnef.tgz", format="onnx")
    assert not list(tmp_path.iterdir())


@pytest.mark.xdist_group("qwen3_5")
def test_check_cli_accepts_onnx(onnx_converted, capsys):
    path = onnx_converted("qwen3_5")
    assert cli(["check", str(path), str(FIXTURES / "qwen3_5"), "--prompt-len", "4", "--decode-steps", "2"]) == 0
    assert "max |logit error|" in capsys.readouterr().out
    assert cli(["check", str(path), str(FIXTURES / "olmo_hybrid")]) == 1  # another model: refused


@pytest.mark.xdist_group("qwen4_exp")
def test_qwen4_exp_reshapes_are_symbolic(onnx_converted):
    """No Reshape of the Qwen4-Exp graph takes a constant shape holding the traced batch and length (1, 3): torch's
    own unflatten symbolic let the exporter fold every later x.shape to them."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(onnx_converted("qwen4_exp")), load_external_data=False)
    constants = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    constants.update({n.output[0]: numpy_helper.to_array(n.attribute[0].t) for n in model.graph.node
                      if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value"})
    baked = [(n.name, constants[n.input[1]].tolist()) for n in model.graph.node if n.op_type == "Reshape"
             and n.input[1] in constants and constants[n.input[1]].tolist()[:2] == [1, 3]]
    assert not baked, baked


@pytest.mark.slow
def test_both_runners_implement_one_protocol(onnx_converted, converted):
    """Session (.nnef.tgz) and OnnxSession (.onnx) are both ``Runner``s, opened by suffix (``open_runner``), and the
    check takes either: the same tokens give the same logits in both within the float32 rule."""
    from gdn_export.parity import max_abs_error
    from gdn_export.run.onnx_session import OnnxSession
    from gdn_export.run.runner import Runner, open_runner
    from gdn_export.run.session import Session

    onnx_file, archive = onnx_converted("qwen3_5"), converted("qwen3_5")
    runners = [open_runner(onnx_file), open_runner(archive)]
    assert [type(r) for r in runners] == [OnnxSession, Session]
    assert all(isinstance(r, Runner) for r in runners)
    ids = np.array([[3, 1, 4, 1, 5, 9, 2, 6]])
    logits = []
    for runner in runners:
        runner.reset()
        logits.append(np.concatenate([runner.prefill(ids[:, :6]), runner.decode(ids[:, 6:7]),
                                      runner.decode(ids[:, 7:8])], axis=1))
    assert max_abs_error(logits[0], logits[1]) <= 1e-4 * max(1.0, float(np.abs(logits[1]).max()))
