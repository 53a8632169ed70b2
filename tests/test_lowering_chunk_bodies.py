"""Each chunk body on exactly one chunk: the NNEF it writes, run in tract on a static S of one chunk, against an
independent numpy chunk form (``oracle.delta_rule_one_chunk``), itself checked against the token recurrence."""

import tarfile

import numpy as np
import pytest
import torch
from helpers import NAMES, VARIANTS, GatedDeltaScanModel, assert_close, graph_inputs, slow_unless, variant_inputs
from oracle import delta_rule_one_chunk, delta_rule_seq_major

import gdn_export

F32_TOLERANCE = 1e-4
# tokens in one chunk by default, and which body writes it: 64 for GDN and DeltaNet (tuned body), 32 with
# per-channel decay, and for n sub-steps the fewest tokens whose n*Cr sub-steps reach 64 on the solve's blocks
ONE_CHUNK = {"gdn": (64, "tuned"), "deltanet": (64, "tuned"), "kda": (32, "general"), "gdn2": (32, "general"),
             "gdn2_neg_eig": (32, "general"), "product2": (32, "general"), "product3": (32, "general"),
             "product2_no_decay": (32, "general")}
BODY_FRAGMENT = {"tuned": "fragment gdn_export_chunk_c{tokens}_",
                 "general": "fragment gdn_export_chunkg_c{tokens}_n{n}_"}


def exported(module, tensors, path, **kwargs):
    report = gdn_export.export(module, tensors, path, lowering="chunked", check=False, **kwargs)
    with tarfile.open(report.path) as archive:
        graph = archive.extractfile("graph.nnef").read().decode()
    return report, graph


def as_numpy(args, kwargs):
    q, k, v, g, beta, s0 = (None if x is None else x.double().numpy() for x in args)
    gates = {name: kwargs[name].double().numpy() for name in ("erase", "write") if name in kwargs}
    return (q, k, v, s0), dict(g=g, beta=beta, num_householder=kwargs["num_householder"], **gates)


def test_the_variants_cover_both_bodies():
    assert set(ONE_CHUNK) == {"gdn", "deltanet", *VARIANTS}
    assert {body for _, body in ONE_CHUNK.values()} == {"tuned", "general"}


@pytest.mark.parametrize("variant", [slow_unless(v == "kda", v, id=v) for v in ONE_CHUNK])  # fast: the general body
def test_one_chunk_against_the_numpy_chunk_form(variant, tmp_path):
    tokens, body = ONE_CHUNK[variant]
    args, kwargs = variant_inputs(variant, seq=tokens, width_k=32, width_v=16, seed=3)
    operands, options = as_numpy(args, kwargs)
    chunk_o, chunk_state = delta_rule_one_chunk(*operands, **options, use_qk_l2norm=True)
    token_o, token_state = delta_rule_seq_major(*operands, **options, use_qk_l2norm=True)
    assert_close(chunk_o, token_o, 1e-10, f"{variant} chunk form o")
    assert_close(chunk_state, token_state, 1e-10, f"{variant} chunk form state")

    module, tensors, names = graph_inputs(args, kwargs)
    report, graph = exported(module, tensors, tmp_path / "one.nnef.tgz", input_names=names, output_names=["o", "state"])
    assert f"chunks of {tokens} tokens" in report.decisions[0].reason
    assert BODY_FRAGMENT[body].format(tokens=tokens, n=kwargs["num_householder"]) in graph
    o, state = gdn_export.run_tract(report.path, [t.numpy() for t in tensors])
    assert_close(o, chunk_o, F32_TOLERANCE, f"{variant} o")
    assert_close(state, chunk_state, F32_TOLERANCE, f"{variant} state")


@pytest.mark.slow
def test_one_head_major_chunk_against_the_numpy_chunk_form(tmp_path):
    """The tuned body's head-major form (``t2n_extra::gated_delta_scan``: q/k normalized and scaled by the caller)."""
    args, kwargs = variant_inputs("gdn", seq=64, width_k=32, width_v=16, seed=4)
    q, k, v, g, beta, s0 = args
    q, k = gdn_export.l2norm(q) / 32**0.5, gdn_export.l2norm(k)
    head_major = [x.transpose(1, 2).contiguous() for x in (q, k, v, g, beta)] + [s0]
    report, graph = exported(GatedDeltaScanModel(), head_major, tmp_path / "hm.nnef.tgz", **NAMES)
    assert BODY_FRAGMENT["tuned"].format(tokens=64) in graph and "_hm_" in graph
    o, state = gdn_export.run_tract(report.path, [x.numpy() for x in head_major])
    chunk_o, chunk_state = delta_rule_one_chunk(*(x.double().numpy() for x in (q, k, v, s0)), g=g.double().numpy(),
                                                beta=beta.double().numpy(), scale=1.0)
    assert_close(np.swapaxes(o, 1, 2), chunk_o, F32_TOLERANCE, "o")
    assert_close(state, chunk_state, F32_TOLERANCE, "state")
    token_o, _ = delta_rule_seq_major(*(x.double().numpy() for x in (q, k, v, s0)), g=g.double().numpy(),
                                      beta=beta.double().numpy(), scale=1.0)
    assert_close(chunk_o, token_o, 1e-10, "chunk form o")


def test_chunk_form_oracle_handles_strong_decay():
    """The oracle masks before exp, as the bodies must: g down to -40 a token keeps it finite and exact."""
    args, kwargs = variant_inputs("kda", seq=32, width_k=16, width_v=8, seed=5)
    args[3] = -40.0 * torch.rand(args[3].shape, generator=torch.Generator().manual_seed(5))
    operands, options = as_numpy(args, kwargs)
    chunk_o, chunk_state = delta_rule_one_chunk(*operands, **options, use_qk_l2norm=True)
    token_o, token_state = delta_rule_seq_major(*operands, **options, use_qk_l2norm=True)
    assert np.isfinite(chunk_o).all() and np.isfinite(chunk_state).all()
    assert_close(chunk_o, token_o, 1e-10, "o")
    assert_close(chunk_state, token_state, 1e-10, "state")
