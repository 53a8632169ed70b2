"""Exported gated delta-rule graphs run in tract and match the float64 oracle, for every lowering."""

import itertools

import numpy as np
import pytest
import torch

import gdn_export
from helpers import NAMES, GatedDeltaRuleModel, GatedDeltaScanModel, make_rule_inputs, slow_unless
from oracle import gated_delta_head_major, gated_delta_seq_major

TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-2}
HEADS = [(2, 2), (2, 4)]
WIDTHS = [(128, 128), (32, 32), (32, 16)]
CASES = list(itertools.product([1, 5, 64], HEADS, WIDTHS, [torch.float32, torch.float16], ["native", "scan", "auto"]))
# the fast tier: every lowering in both dtypes on one shape, the native refusal (K != V), both other lengths, K=V=128
FAST = {(5, (2, 4), (32, 32), dtype, lowering) for dtype in (torch.float32, torch.float16)
        for lowering in ("native", "scan", "auto")} | {
    (5, (2, 4), (32, 16), torch.float32, "native"), (1, (2, 2), (32, 16), torch.float32, "scan"),
    (64, (2, 4), (32, 16), torch.float32, "auto"), (1, (2, 2), (128, 128), torch.float32, "native")}


def assert_close(actual, expected, relative, what):
    expected = np.asarray(expected, dtype=np.float64)
    error = np.abs(np.asarray(actual, dtype=np.float64) - expected).max()
    bound = relative * np.abs(expected).max()
    assert error <= bound, f"{what}: max abs error {error:.3e} > {bound:.3e}"
    return error


def _id(case):
    seq, (hk, h), (wk, wv), dtype, lowering = case
    return f"T{seq}-Hk{hk}H{h}-K{wk}V{wv}-{str(dtype)[6:]}-{lowering}"


@pytest.mark.parametrize("case", [slow_unless(c in FAST, c, id=_id(c)) for c in CASES])
def test_gated_delta_rule_parity(case, tmp_path):
    seq, (key_heads, heads), (width_k, width_v), dtype, lowering = case
    inputs = make_rule_inputs(2, seq, key_heads, heads, width_k, width_v, dtype)
    path = tmp_path / "gdn.nnef.tgz"
    if lowering == "native" and width_k != width_v:
        with pytest.raises(gdn_export.LoweringError, match="K=32 != V=16"):
            gdn_export.export(GatedDeltaRuleModel(), inputs, path, lowering="native", **NAMES)
        assert not path.exists()
        return
    report = gdn_export.export(GatedDeltaRuleModel(), inputs, path, lowering=lowering, check=False, **NAMES)
    expected_lowering = "scan" if lowering == "scan" or width_k != width_v else "native"
    assert report.lowerings() == [expected_lowering]
    o, state = gdn_export.run_tract(path, [x.numpy() for x in inputs])
    ref_o, ref_state = gated_delta_seq_major(*[x.float().numpy() for x in inputs], use_qk_l2norm=True)
    assert o.dtype == inputs[0].numpy().dtype and state.dtype == np.float32
    assert_close(o, ref_o, TOLERANCE[dtype], "o")
    assert_close(state, ref_state, TOLERANCE[dtype], "state")


@pytest.mark.parametrize("seq,heads", [(1, (2, 2)), (5, (2, 4)), (64, (1, 4))])
def test_custom_op_scan_parity(seq, heads, tmp_path):
    """t2n_extra::gated_delta_scan takes q/k pre-normalized and head-major; auto lowers it to the scan."""
    key_heads, value_heads = heads
    q, k, v, g, beta, s0 = make_rule_inputs(2, seq, key_heads, value_heads, 32, 16)
    q, k = gdn_export.l2norm(q) / 32**0.5, gdn_export.l2norm(k)
    inputs = [x.transpose(1, 2).contiguous() for x in (q, k, v, g, beta)] + [s0]
    report = gdn_export.export(GatedDeltaScanModel(), inputs, tmp_path / "scan.nnef.tgz", **NAMES)
    assert report.lowerings() == ["scan"] and "already normalized" in report.decisions[0].reason
    o, state = gdn_export.run_tract(report.path, [x.numpy() for x in inputs])
    ref_o, ref_state = gated_delta_head_major(*[x.numpy() for x in inputs])
    assert_close(o, ref_o, 1e-4, "y")
    assert_close(state, ref_state, 1e-4, "s_final")


def test_module_extractor_parity(tmp_path):
    """GatedDeltaRule as a submodule reaches the same emitter through the module extractor."""

    class WithModule(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.rule = gdn_export.GatedDeltaRule(use_qk_l2norm=True)

        def forward(self, q, k, v, g, beta, s0):
            return self.rule(q, k, v, g, beta, s0)

    inputs = make_rule_inputs(2, 6, 2, 4, 32, 32)
    for lowering in ("native", "scan"):
        report = gdn_export.export(WithModule(), inputs, tmp_path / f"{lowering}.nnef.tgz", lowering=lowering, **NAMES)
        assert [(d.entry, d.lowering) for d in report.decisions] == [("GatedDeltaRule module", lowering)]
        o, state = gdn_export.run_tract(report.path, [x.numpy() for x in inputs])
        ref_o, ref_state = gated_delta_seq_major(*[x.numpy() for x in inputs], use_qk_l2norm=True)
        assert_close(o, ref_o, 1e-4, "o")
        assert_close(state, ref_state, 1e-4, "state")


def test_custom_scale_without_l2norm(tmp_path):
    """A node without in-kernel normalization, with its own scale, is never given to the fused op."""
    inputs = make_rule_inputs(1, 7, 2, 2, 32, 32)
    model = GatedDeltaRuleModel(use_qk_l2norm=False, scale=0.3)
    report = gdn_export.export(model, inputs, tmp_path / "m.nnef.tgz", **NAMES)
    assert report.lowerings() == ["scan"]
    o, _ = gdn_export.run_tract(report.path, [x.numpy() for x in inputs])
    ref_o, _ = gated_delta_seq_major(*[x.numpy() for x in inputs], scale=0.3)
    assert_close(o, ref_o, 1e-4, "o")
