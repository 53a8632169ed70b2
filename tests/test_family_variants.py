"""Every variant of the delta-rule family exported and run in tract against the float64 oracle (docs/MATH.md)."""

import numpy as np
import pytest
import torch

import gdn_export
from helpers import VARIANTS, assert_close, graph_inputs, oracle, slow_unless, variant_inputs

TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-2}
LOWERINGS = ["auto", "recurrent"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_eager_reference_matches_oracle(variant):
    args, kwargs = variant_inputs(variant, seq=9)
    o, state = gdn_export.gated_delta_rule(*args, use_qk_l2norm=True, erase=kwargs.get("erase"),
                                           write=kwargs.get("write"), num_householder=kwargs["num_householder"])
    ref_o, ref_state = oracle(args, kwargs)
    assert_close(o, ref_o, 1e-5, "o")
    assert_close(state, ref_state, 1e-5, "state")


@pytest.mark.parametrize("lowering", LOWERINGS)
@pytest.mark.parametrize("seq", [slow_unless(False, 1, id="1"), 7, slow_unless(False, 100, id="100")])  # fast: 7
@pytest.mark.parametrize("variant", VARIANTS)
def test_variant_parity_in_tract(variant, seq, lowering, tmp_path):
    dtype = torch.float16 if seq == 7 and variant in ("kda", "gdn2", "product2") else torch.float32
    args, kwargs = variant_inputs(variant, seq=seq, dtype=dtype)
    module, tensors, names = graph_inputs(args, kwargs)
    report = gdn_export.export(module, tensors, tmp_path / "v.nnef.tgz", input_names=names,
                               output_names=["o", "state"], check=False, lowering=lowering)
    # K != V here, and only plain GDN could be fused anyway: auto takes the portable scan
    assert report.lowerings() == ["scan" if lowering == "auto" else lowering]
    o, state = gdn_export.run_tract(report.path, [t.numpy() for t in tensors])
    ref_o, ref_state = oracle(args, kwargs)
    assert_close(o, ref_o, TOLERANCE[dtype], f"{variant} o")
    assert_close(state, ref_state, TOLERANCE[dtype], f"{variant} state")


@pytest.mark.parametrize("lowering", [slow_unless(lowering == "auto", lowering, id=lowering) for lowering in LOWERINGS])
@pytest.mark.parametrize("variant", VARIANTS)
def test_symbolic_length_with_state_carried(variant, lowering, tmp_path):
    """One graph, prefill of 7 tokens then 3 single-token calls feeding back the state == one run of 10."""
    args, kwargs = variant_inputs(variant, seq=10, seed=4)
    module, tensors, names = graph_inputs(args, kwargs)
    n = kwargs["num_householder"]
    dynamic = {name: {1: "S" if name in ("q", "g", "erase", "write") or n == 1 else f"{n}*S"} for name in names[:-1]}
    traced_args, traced_kwargs = variant_inputs(variant, seq=3, seed=5)
    _, traced, _ = graph_inputs(traced_args, traced_kwargs)
    report = gdn_export.export(module, traced, tmp_path / "s.nnef.tgz", input_names=names,
                               output_names=["o", "state"], dynamic_axes=dynamic, lowering=lowering)
    runnable = gdn_export.run.runtime.load_tract_model(report.path)
    ref_o, ref_state = oracle(args, kwargs)
    state, outputs = tensors[-1].numpy(), []
    for begin, end in [(0, 7), (7, 8), (8, 9), (9, 10)]:
        step = [t[:, begin * (n if name in ("k", "v", "beta") else 1):end * (n if name in ("k", "v", "beta") else 1)]
                .numpy() for t, name in zip(tensors[:-1], names[:-1])]
        o, state = gdn_export.run_tract(runnable, step + [state])
        outputs.append(o)
    assert_close(np.concatenate(outputs, axis=1), ref_o, 1e-4, f"{variant} o")
    assert_close(state, ref_state, 1e-4, f"{variant} state")
