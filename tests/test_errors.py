"""Bad operands raise OperandError naming the operand, and no output is left behind."""

import re

import numpy as np
import pytest
import torch

import gdn_export
from helpers import NAMES, GatedDeltaRuleModel, GatedDeltaScanModel, make_rule_inputs


def _rule_inputs():
    return list(make_rule_inputs(1, 4, 2, 4, 16, 16))


def _bad(index, tensor):
    inputs = _rule_inputs()
    inputs[index] = tensor
    return inputs


BAD = {
    "g of rank 2": (_bad(3, torch.zeros(1, 4)), "g", "rank 3 or 4 [B, T, H] or [B, T, H, K]"),
    "q of rank 3": (_bad(0, torch.zeros(1, 4, 32)), "q", "rank 4 [B, T, Hk, K]"),
    "H not a multiple of Hk": (_bad(2, torch.zeros(1, 4, 3, 16)), "v", "multiple of q/k's Hk=2"),
    "beta with another T": (_bad(4, torch.zeros(1, 5, 4)), "beta", "T=4"),
    "k narrower than q": (_bad(1, torch.zeros(1, 4, 2, 8)), "k", "K=16 on axis 3"),
    "state of another width": (_bad(5, torch.zeros(1, 4, 16, 8)), "s0", "V=16"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_operands_name_the_operand(name, tmp_path):
    inputs, operand, expected = BAD[name]
    path = tmp_path / "bad.nnef.tgz"
    with pytest.raises(gdn_export.OperandError, match=f"operand '{operand}': expected .*{re.escape(expected)}") as err:
        gdn_export.export(GatedDeltaRuleModel(), inputs, path, **NAMES)
    assert err.value.operand == operand
    assert list(tmp_path.iterdir()) == [], "no output, no temporary file"


def test_custom_op_checks_its_operands_eagerly():
    q = torch.zeros(1, 2, 3, 8)
    with pytest.raises(gdn_export.OperandError, match="operand 'g': expected T=3 on axis 2 of \\[B, H, T\\]"):
        GatedDeltaScanModel()(q, q, torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 4), torch.zeros(1, 2, 3),
                              torch.zeros(1, 2, 8, 8))


def test_emitter_refuses_float64(tmp_path):
    inputs = [x.double() if i < 3 else x for i, x in enumerate(_rule_inputs())]
    with pytest.raises(gdn_export.OperandError, match="operand 'q': expected dtype float16 or float32, got float64"):
        gdn_export.export(GatedDeltaRuleModel(), inputs, tmp_path / "x.nnef.tgz", **NAMES)
    assert list(tmp_path.iterdir()) == []


def test_output_path_must_be_nnef_tgz(tmp_path):
    with pytest.raises(gdn_export.GdnExportError, match="must end with .nnef.tgz"):
        gdn_export.export(GatedDeltaRuleModel(), _rule_inputs(), tmp_path / "x.onnx", **NAMES)


def test_parity_failure_is_reported_per_output(tmp_path):
    """A module whose torch output differs from what it traces: the check must catch it."""

    class Drifting(GatedDeltaRuleModel):
        def forward(self, *args):
            o, state = super().forward(*args)
            return (o if torch.jit.is_tracing() else o + 1.0), state  # the graph lacks the + 1

    with pytest.raises(gdn_export.ParityError, match=r"o: max abs error 1\.000e\+00 .* <-- over"):
        gdn_export.export(Drifting(), _rule_inputs(), tmp_path / "x.nnef.tgz", **NAMES)
    assert list(tmp_path.iterdir()) == [], "a file that failed its check must not be left"
    # check=False runs no check at all: the same module exports (and the graph lacks the + 1)
    report = gdn_export.export(Drifting(), _rule_inputs(), tmp_path / "x.nnef.tgz", check=False, **NAMES)
    assert report.parity is None and report.path.is_file()


def test_dynamic_axes_naming_one_symbol_for_two_lengths(tmp_path):
    """A Householder k of length 2T named "T" like q's T: refused before export, naming both axes."""
    inputs = _rule_inputs()
    dynamic = {name: {1: "T"} for name in ("q", "k", "v", "g", "beta")}
    inputs[1] = torch.cat([inputs[1], inputs[1]], dim=1)
    with pytest.raises(gdn_export.GdnExportError, match=r"symbol 'T' names axis 1 of 'q' \(traced length 4\) and "
                                                        r"axis 1 of 'k' \(traced length 8\)"):
        gdn_export.export(GatedDeltaRuleModel(), inputs, tmp_path / "x.nnef.tgz", dynamic_axes=dynamic, **NAMES)
    with pytest.raises(gdn_export.GdnExportError, match=r"dynamic_axes\['q'\]: axis 4 does not exist on a rank-4"):
        gdn_export.export(GatedDeltaRuleModel(), _rule_inputs(), tmp_path / "x.nnef.tgz", dynamic_axes={"q": {4: "S"}},
                          **NAMES)
    with pytest.raises(gdn_export.GdnExportError, match=r"dynamic_axes names 'x', which is neither an input "
                                                        r"\(q, k, v, g, beta, s0\) nor an output \(o, state\)"):
        gdn_export.export(GatedDeltaRuleModel(), _rule_inputs(), tmp_path / "x.nnef.tgz", dynamic_axes={"x": {1: "S"}},
                          **NAMES)
    assert list(tmp_path.iterdir()) == []


def test_gate_errors_name_the_gate(tmp_path):
    q, k, v, g, beta, s0 = _rule_inputs()
    erase, write = torch.rand(1, 4, 4, 16), torch.rand(1, 4, 4, 16)
    with pytest.raises(gdn_export.OperandError, match="operand 'erase': expected no erase/write gate when beta"):
        gdn_export.gated_delta_rule(q, k, v, g, beta, s0, erase=erase, write=write)
    with pytest.raises(gdn_export.OperandError, match="operand 'write': expected erase and write given together"):
        gdn_export.gated_delta_rule(q, k, v, g, None, s0, erase=erase)
    with pytest.raises(gdn_export.OperandError, match=r"operand 'g': expected K=16 on axis 3"):
        gdn_export.gated_delta_rule(q, k, v, torch.zeros(1, 4, 4, 8), beta, s0)
    with pytest.raises(gdn_export.OperandError, match=r"operand 'beta': expected T\*n=8 on axis 1"):
        gdn_export.gated_delta_rule(q, torch.cat([k, k], 1), torch.cat([v, v], 1), g, beta, s0, num_householder=2)


def test_native_refuses_variants_the_fused_op_does_not_compute(tmp_path):
    q, k, v, _, beta, s0 = make_rule_inputs(1, 3, 2, 2, 32, 32)
    channel_g = -torch.rand(1, 3, 2, 32)

    class Kda(torch.nn.Module):
        def forward(self, q, k, v, g, beta, s0):
            return gdn_export.gated_delta_rule(q, k, v, g, beta, s0, use_qk_l2norm=True)

    with pytest.raises(gdn_export.LoweringError, match="scalar-gated GDN only; this node has channel-wise decay"):
        gdn_export.export(Kda(), [q, k, v, channel_g, beta, s0], tmp_path / "k.nnef.tgz", lowering="native", **NAMES)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
@pytest.mark.parametrize("format", ["nnef", "onnx"])
def test_dynamic_axes_may_name_outputs(tmp_path, format):
    """``dynamic_axes`` naming an output, as torch.onnx.export and torch-to-nnef accept: the graph exported at T=4
    runs at T=7 and matches the float64 oracle; an output name is checked against the traced outputs."""
    from oracle import gated_delta_seq_major

    dynamic = {**{name: {1: "T"} for name in ("q", "k", "v", "g", "beta")}, "o": {1: "T"}}
    path = tmp_path / ("x.nnef.tgz" if format == "nnef" else "x.onnx")
    report = gdn_export.export(GatedDeltaRuleModel(), _rule_inputs(), path, dynamic_axes=dynamic, format=format,
                               check=False, **NAMES)
    longer = [x.numpy() for x in make_rule_inputs(1, 7, 2, 4, 16, 16, seed=1)]
    if format == "nnef":
        o, state = gdn_export.run_tract(report.path, longer)
    else:
        from gdn_export.run.onnx_session import run_model

        names, (o, state) = run_model(report.path, longer)
        assert names == ["o", "state"]
    ref_o, ref_state = gated_delta_seq_major(*longer, use_qk_l2norm=True)
    assert o.shape == ref_o.shape == (1, 7, 4, 16)
    np.testing.assert_allclose(o, ref_o, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(state, ref_state, rtol=1e-4, atol=1e-4)


def test_dynamic_axes_naming_an_output_is_checked(tmp_path):
    model, inputs = GatedDeltaRuleModel(), _rule_inputs()
    with pytest.raises(gdn_export.GdnExportError, match=r"dynamic_axes\['state'\]: axis 4 does not exist on a "
                                                        r"rank-4 output"):
        gdn_export.export(model, inputs, tmp_path / "x.nnef.tgz", dynamic_axes={"state": {4: "S"}}, **NAMES)
    with pytest.raises(gdn_export.GdnExportError, match=r"symbol 'T' names axis 1 of 'q' \(traced length 4\) and "
                                                        r"axis 3 of 'o' \(traced length 16\)"):
        gdn_export.export(model, inputs, tmp_path / "x.nnef.tgz", dynamic_axes={"q": {1: "T"}, "o": {3: "T"}},
                          **NAMES)
    with pytest.raises(gdn_export.GdnExportError, match=r"dynamic_axes names output 'extra' \(output 2 of "
                                                        r"output_names\), but the module returns 2 outputs"):
        gdn_export.export(model, inputs, tmp_path / "x.nnef.tgz", input_names=NAMES["input_names"],
                          output_names=["o", "state", "extra"], dynamic_axes={"extra": {0: "B"}})
    with pytest.raises(gdn_export.GdnExportError, match=r"nor an output \(none named: pass output_names\)"):
        gdn_export.export(model, inputs, tmp_path / "x.nnef.tgz", input_names=NAMES["input_names"],
                          dynamic_axes={"o": {1: "T"}})
    assert list(tmp_path.iterdir()) == []
