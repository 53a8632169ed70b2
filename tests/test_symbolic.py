"""One graph with a symbolic sequence axis serves prefill and decode; states carried across calls."""

import numpy as np
import pytest

import gdn_export
from helpers import NAMES, GatedDeltaRuleModel, make_rule_inputs
from oracle import gated_delta_seq_major


@pytest.mark.parametrize("lowering", ["native", "scan"])
def test_prefill_then_decode_equals_one_long_run(lowering, tmp_path):
    dynamic = {name: {1: "S"} for name in NAMES["input_names"][:5]}
    traced = make_rule_inputs(2, 3, 2, 4, 32, 32)
    report = gdn_export.export(GatedDeltaRuleModel(), traced, tmp_path / "s.nnef.tgz", lowering=lowering,
                               dynamic_axes=dynamic, **NAMES)
    assert report.lowerings() == [lowering]
    runnable = gdn_export.run.runtime.load_tract_model(report.path)

    q, k, v, g, beta, s0 = (x.numpy() for x in make_rule_inputs(2, 37 + 4, 2, 4, 32, 32, seed=7))
    whole_o, whole_state = gdn_export.run_tract(runnable, [q, k, v, g, beta, s0])
    ref_o, ref_state = gated_delta_seq_major(q, k, v, g, beta, s0, use_qk_l2norm=True)
    assert np.abs(whole_o - ref_o).max() <= 1e-4 * np.abs(ref_o).max()

    steps = [slice(0, 37)] + [slice(t, t + 1) for t in range(37, 41)]  # a T=37 prefill, then four T=1 decodes
    state, outputs = s0, []
    for step in steps:
        o, state = gdn_export.run_tract(runnable, [x[:, step] for x in (q, k, v, g, beta)] + [state])
        outputs.append(o)
    stitched = np.concatenate(outputs, axis=1)
    assert stitched.shape == whole_o.shape
    assert np.abs(stitched - whole_o).max() <= 1e-5 * np.abs(whole_o).max()
    assert np.abs(state - whole_state).max() <= 1e-5 * np.abs(whole_state).max()
    assert np.abs(state - ref_state).max() <= 1e-4 * np.abs(ref_state).max()
