"""The chunked (WY / UT-transform) lowering against the float64 oracle, for every variant of the family: one
symbolic-S graph for every length (no chunk, a partial chunk, exactly one, one plus a token, several plus a tail),
state carried across calls, grouped heads, K != V, correlated keys with beta near 2, strong decay, and the one
combination it refuses."""

import numpy as np
import pytest
import torch
from helpers import (NAMES, VARIANTS, GatedDeltaRuleModel, GatedDeltaScanModel, assert_close, graph_inputs,
                     make_rule_inputs, oracle, slow_unless, variant_inputs)
from oracle import gated_delta_head_major, gated_delta_seq_major

import gdn_export
from gdn_export.ops.gated_delta_rule.nnef.chunked import CHUNK, TAIL_CHUNK

LENGTHS = [1, CHUNK - 1, CHUNK, CHUNK + 1, 200]
F32_TOLERANCE = 1e-4


def symbolic_time(names, num_householder=1):
    """Dynamic axes: S tokens on q, g and the gates, n*S sub-steps on k, v and beta."""
    per_substep = "S" if num_householder == 1 else f"{num_householder}*S"
    return {name: {1: "S" if name in ("q", "g", "erase", "write") else per_substep} for name in names[:-1]}


def export_symbolic(module, tensors, names, path, num_householder=1, **kwargs):
    """Export with a symbolic time axis on every per-token operand; return the loaded runnable."""
    dynamic = symbolic_time(names, num_householder)
    report = gdn_export.export(module, tensors, path, input_names=names, output_names=["o", "state"],
                               dynamic_axes=dynamic, lowering="chunked", check=False, **kwargs)
    assert report.lowerings() == ["chunked"]
    return gdn_export.run.runtime.load_tract_model(report.path)


CASES = [("gdn", (32, 32)), ("deltanet", (32, 32))] + [(variant, (32, 16)) for variant in VARIANTS]


@pytest.mark.parametrize("variant,widths", [slow_unless((v, widths) == ("gdn", (32, 32)), v, widths,
                                                        id=f"{v}-K{widths[0]}V{widths[1]}")
                                            for v, widths in CASES])  # fast: the tuned body (GDN, K=V=32)
def test_one_symbolic_graph_for_every_length(variant, widths, tmp_path):
    width_k, width_v = widths
    traced_args, traced_kwargs = variant_inputs(variant, seq=3, width_k=width_k, width_v=width_v)
    module, traced, names = graph_inputs(traced_args, traced_kwargs)
    runnable = export_symbolic(module, traced, names, tmp_path / "c.nnef.tgz", traced_kwargs["num_householder"])
    for seq in LENGTHS:
        args, kwargs = variant_inputs(variant, seq=seq, width_k=width_k, width_v=width_v, seed=seq)
        _, tensors, _ = graph_inputs(args, kwargs)
        o, state = gdn_export.run_tract(runnable, [t.numpy() for t in tensors])
        ref_o, ref_state = oracle(args, kwargs)
        assert o.shape == ref_o.shape
        assert_close(o, ref_o, F32_TOLERANCE, f"{variant} S={seq} o")
        assert_close(state, ref_state, F32_TOLERANCE, f"{variant} S={seq} state")


@pytest.mark.parametrize("variant", ["gdn", "kda", "gdn2"])
@pytest.mark.slow  # a chunked export and runs: seconds
def test_prefill_then_decode_equals_one_run(variant, tmp_path):
    """Prefill of 2 chunks + 2 tokens, then single-token calls feeding the state back == one run of 133."""
    args, kwargs = variant_inputs(variant, seq=133, width_k=32, width_v=32, seed=7)
    module, tensors, names = graph_inputs(args, kwargs)
    traced_args, traced_kwargs = variant_inputs(variant, seq=3, width_k=32, width_v=32)
    _, traced, _ = graph_inputs(traced_args, traced_kwargs)
    runnable = export_symbolic(module, traced, names, tmp_path / "p.nnef.tgz")
    state, outputs = tensors[-1].numpy(), []
    for begin, end in [(0, 130), (130, 131), (131, 132), (132, 133)]:
        step = [t[:, begin:end].numpy() for t in tensors[:-1]]
        o, state = gdn_export.run_tract(runnable, step + [state])
        outputs.append(o)
    ref_o, ref_state = oracle(args, kwargs)
    assert_close(np.concatenate(outputs, axis=1), ref_o, F32_TOLERANCE, "o")
    assert_close(state, ref_state, F32_TOLERANCE, "state")


@pytest.mark.parametrize("variant,tail", [slow_unless(v == "gdn" and t is None, v, t, id=f"{v}-tail{t or TAIL_CHUNK}")
                                          for v, t in (("gdn", None), ("deltanet", None), ("gdn", 8), ("gdn", 1))])
def test_short_calls_after_a_context(variant, tail, tmp_path):
    """Speculative verify calls and decode steps: after a context of CHUNK + 3 tokens (a whole chunk and a tail),
    calls of 1 to 2 * tail + 1 tokens from the state it left run the tail's short chunks of ``tail`` tokens (the
    default TAIL_CHUNK, 8, or 1: token by token; a partial chunk, a whole one, several, the last padded with zero
    tokens); each call's outputs and state equal the float64 oracle's over the context and the call, grouped heads
    (2 key heads, 4 value heads)."""
    context, size = CHUNK + 3, tail or TAIL_CHUNK
    traced_args, traced_kwargs = variant_inputs(variant, seq=3, width_k=32, width_v=16)
    module, traced, names = graph_inputs(traced_args, traced_kwargs)
    path = tmp_path / "v.nnef.tgz"
    dynamic = symbolic_time(names, 1)
    report = gdn_export.export(module, traced, path, input_names=names, output_names=["o", "state"],
                               dynamic_axes=dynamic, lowering="chunked", check=False, tail_chunk=tail)
    form = "token by token" if size == 1 else f"in chunks of {size} tokens"
    assert all(form in d.reason for d in report.decisions), [d.reason for d in report.decisions]
    runnable = gdn_export.run.runtime.load_tract_model(report.path)
    for count in sorted({1, 2, size - 1, size, size + 1, 2 * size + 1} - {0}):
        args, kwargs = variant_inputs(variant, seq=context + count, width_k=32, width_v=16, seed=count)
        _, tensors, _ = graph_inputs(args, kwargs)
        _, state = gdn_export.run_tract(runnable, [t[:, :context].numpy() for t in tensors[:-1]] + [tensors[-1].numpy()])
        o, state = gdn_export.run_tract(runnable, [t[:, context:].numpy() for t in tensors[:-1]] + [state])
        ref_o, ref_state = oracle(args, kwargs)
        assert o.shape == ref_o[:, context:].shape
        assert_close(o, ref_o[:, context:], F32_TOLERANCE, f"{variant} {count} tokens after {context}: o")
        assert_close(state, ref_state, F32_TOLERANCE, f"{variant} {count} tokens after {context}: state")


def test_tail_chunk_is_validated():
    """A tail chunk the lowering has no form for is a one-line error naming what it takes, before anything is
    traced; an ONNX export refuses it (NNEF's chunked lowering only)."""
    from gdn_export.errors import LoweringError

    for bad in (3, 0, 32, True):
        with pytest.raises(LoweringError, match=r"tail_chunk .* is not one of 1, 2, 4, 8, 16"):
            gdn_export.export(torch.nn.Identity(), (torch.zeros(1),), "never.nnef.tgz", tail_chunk=bad)


def correlated_inputs(seq, heads=4, key_heads=2, width=32, noise=0.02, decay=True, seed=3):
    """Keys = one shared direction + small noise (cosine ~0.999), beta in [1.9, 2]: I + A is ill-conditioned
    (cond ~1e3), where a nilpotent-product inverse explodes."""
    gen = torch.Generator().manual_seed(seed)
    direction = torch.randn(width, generator=gen)
    k = direction + noise * torch.randn(2, seq, key_heads, width, generator=gen)
    q = torch.randn(2, seq, key_heads, width, generator=gen)
    v = torch.randn(2, seq, heads, width, generator=gen)
    g = -1e-3 * torch.rand(2, seq, heads, generator=gen) if decay else None
    beta = 1.9 + 0.1 * torch.rand(2, seq, heads, generator=gen)
    s0 = 0.5 * torch.randn(2, heads, width, width, generator=gen)
    return [q, k, v, g, beta, s0], {"num_householder": 1}


@pytest.mark.parametrize("decay", [True, False], ids=["gdn", "deltanet"])
@pytest.mark.slow  # a chunked export and runs: seconds
def test_correlated_keys_beta_near_two(decay, tmp_path):
    traced_args, traced_kwargs = correlated_inputs(3, decay=decay)
    module, traced, names = graph_inputs(traced_args, traced_kwargs)
    runnable = export_symbolic(module, traced, names, tmp_path / "s.nnef.tgz")
    args, kwargs = correlated_inputs(4 * CHUNK + 17, decay=decay, seed=11)
    _, tensors, _ = graph_inputs(args, kwargs)
    o, state = gdn_export.run_tract(runnable, [t.numpy() for t in tensors])
    ref_o, ref_state = oracle(args, kwargs)
    assert_close(o, ref_o, F32_TOLERANCE, "o")
    assert_close(state, ref_state, F32_TOLERANCE, "state")


@pytest.mark.slow  # a chunked export and runs: seconds
def test_static_length(tmp_path):
    """Without dynamic axes the same graph pieces run on a fixed S (2 chunks + 2 tokens)."""
    inputs = make_rule_inputs(2, 2 * CHUNK + 2, 2, 4, 32, 16)
    report = gdn_export.export(GatedDeltaRuleModel(), inputs, tmp_path / "t.nnef.tgz", lowering="chunked",
                               check=False, **NAMES)
    o, state = gdn_export.run_tract(report.path, [x.numpy() for x in inputs])
    ref_o, ref_state = gated_delta_seq_major(*[x.numpy() for x in inputs], use_qk_l2norm=True)
    assert_close(o, ref_o, F32_TOLERANCE, "o")
    assert_close(state, ref_state, F32_TOLERANCE, "state")


@pytest.mark.slow  # a chunked export and runs: seconds
def test_caller_normalized_q_and_custom_scale(tmp_path):
    """use_qk_l2norm=False: q, k are used as given and q is multiplied by the node's scale."""
    inputs = list(make_rule_inputs(2, CHUNK + 5, 2, 4, 32, 32))
    inputs[0], inputs[1] = gdn_export.l2norm(inputs[0]), gdn_export.l2norm(inputs[1])
    report = gdn_export.export(GatedDeltaRuleModel(use_qk_l2norm=False, scale=0.3), inputs,
                               tmp_path / "n.nnef.tgz", lowering="chunked", check=False, **NAMES)
    o, state = gdn_export.run_tract(report.path, [x.numpy() for x in inputs])
    ref_o, ref_state = gated_delta_seq_major(*[x.numpy() for x in inputs], scale=0.3)
    assert_close(o, ref_o, F32_TOLERANCE, "o")
    assert_close(state, ref_state, F32_TOLERANCE, "state")


@pytest.mark.slow  # a chunked export and runs: seconds
def test_head_major_custom_op(tmp_path):
    """t2n_extra::gated_delta_scan: head-major [B, H, T, K], q/k normalized and scaled by the caller."""
    def head_major(seq, seed):
        q, k, v, g, beta, s0 = make_rule_inputs(2, seq, 2, 4, 32, 16, seed=seed)
        q, k = gdn_export.l2norm(q) / 32**0.5, gdn_export.l2norm(k)
        return [x.transpose(1, 2).contiguous() for x in (q, k, v, g, beta)] + [s0]

    dynamic = {name: {2: "S"} for name in NAMES["input_names"][:5]}
    report = gdn_export.export(GatedDeltaScanModel(), head_major(3, 0), tmp_path / "h.nnef.tgz", lowering="chunked",
                               dynamic_axes=dynamic, check=False, **NAMES)
    assert report.lowerings() == ["chunked"]
    runnable = gdn_export.run.runtime.load_tract_model(report.path)
    for seq in (1, CHUNK, CHUNK + 6):
        inputs = head_major(seq, seq)
        o, state = gdn_export.run_tract(runnable, [x.numpy() for x in inputs])
        ref_o, ref_state = gated_delta_head_major(*[x.numpy() for x in inputs])
        assert_close(o, ref_o, F32_TOLERANCE, f"S={seq} o")
        assert_close(state, ref_state, F32_TOLERANCE, f"S={seq} state")


@pytest.mark.slow  # a chunked export and runs: seconds
def test_half_precision_operands(tmp_path):
    inputs = make_rule_inputs(2, CHUNK + 3, 2, 4, 32, 32, dtype=torch.float16)
    report = gdn_export.export(GatedDeltaRuleModel(), inputs, tmp_path / "f.nnef.tgz", lowering="chunked",
                               check=False, **NAMES)
    o, state = gdn_export.run_tract(report.path, [x.numpy() for x in inputs])
    assert o.dtype == np.float16 and state.dtype == np.float32
    ref_o, ref_state = gated_delta_seq_major(*[x.float().numpy() for x in inputs], use_qk_l2norm=True)
    assert_close(o, ref_o, 2e-2, "o")
    assert_close(state, ref_state, 2e-2, "state")


def test_refuses_channel_decay_with_householder_steps(tmp_path):
    """Per-channel decay and sub-steps together (in no layer of the family) have no chunked form: refused."""
    args, kwargs = variant_inputs("product2", seq=5)
    args[3] = -torch.rand(*args[3].shape, args[0].shape[-1])  # g [B, T, H, K]
    module, tensors, names = graph_inputs(args, kwargs)
    with pytest.raises(gdn_export.LoweringError, match="lowering='chunked' cannot be exact: per-channel decay with "
                                                       "Householder"):
        gdn_export.export(module, tensors, tmp_path / "r.nnef.tgz", input_names=names, output_names=["o", "state"],
                          lowering="chunked", check=False)


@pytest.mark.parametrize("variant", ["gdn2_neg_eig", "product2"])
@pytest.mark.slow  # a chunked export and runs: seconds
def test_correlated_keys_gates_near_two(variant, tmp_path):
    """The general body under the same stress: keys nearly parallel, erase gate or beta in [1.9, 2]."""
    def stressed(seq, seed):
        args, kwargs = variant_inputs(variant, seq=seq, width_k=32, width_v=32, seed=seed)
        gen = torch.Generator().manual_seed(seed)
        args[1] = torch.randn(32, generator=gen) + 0.02 * torch.randn(args[1].shape, generator=gen)
        if variant.startswith("gdn2"):
            kwargs["erase"] = 1.9 + 0.1 * torch.rand(kwargs["erase"].shape, generator=gen)
        else:
            args[4] = 1.9 + 0.1 * torch.rand(args[4].shape, generator=gen)
        return args, kwargs

    traced_args, traced_kwargs = stressed(3, 0)
    module, traced, names = graph_inputs(traced_args, traced_kwargs)
    runnable = export_symbolic(module, traced, names, tmp_path / "s.nnef.tgz", traced_kwargs["num_householder"])
    args, kwargs = stressed(2 * CHUNK + 17, 11)
    _, tensors, _ = graph_inputs(args, kwargs)
    o, state = gdn_export.run_tract(runnable, [t.numpy() for t in tensors])
    ref_o, ref_state = oracle(args, kwargs)
    assert_close(o, ref_o, F32_TOLERANCE, "o")
    assert_close(state, ref_state, F32_TOLERANCE, "state")


@pytest.mark.parametrize("variant", ["gdn", "kda"])
@pytest.mark.slow  # a chunked export and runs: seconds
def test_strong_decay_masks_before_exp(variant, tmp_path):
    """g down to -40 per token (per head, or per key channel): within a chunk gamma_i - gamma_j reaches +-2500,
    so exp of an unmasked upper entry would be inf (and inf * 0 = nan), as would the factored forms
    exp(gamma_i) exp(-gamma_j); masking before exp and the block references keep every output finite and exact."""
    args, kwargs = variant_inputs(variant, seq=2 * CHUNK + 9, width_k=32, width_v=32, seed=5)
    args[3] = -40.0 * torch.rand(args[3].shape, generator=torch.Generator().manual_seed(5))
    module, tensors, names = graph_inputs(args, kwargs)
    report = gdn_export.export(module, tensors, tmp_path / "d.nnef.tgz", input_names=names,
                               output_names=["o", "state"], lowering="chunked", check=False)
    o, state = gdn_export.run_tract(report.path, [t.numpy() for t in tensors])
    assert np.isfinite(o).all() and np.isfinite(state).all()
    ref_o, ref_state = oracle(args, kwargs)
    assert_close(o, ref_o, F32_TOLERANCE, "o")
    assert_close(state, ref_state, F32_TOLERANCE, "state")


@pytest.mark.slow  # a chunked export and runs: seconds
def test_symbolic_batch_and_exact_output_lengths(tmp_path):
    """Batch and time both symbolic: the outputs' facts are exactly [B, S, H, V] and [B, H, K, V], so a model
    around the node can prove its lengths equal (a chunk count of (63 + 64*(S/64))/64, with chunks of 64, would
    not simplify)."""
    import tract

    traced_args, traced_kwargs = variant_inputs("gdn", seq=3, width_k=32, width_v=16)
    module, traced, names = graph_inputs(traced_args, traced_kwargs)
    dynamic = {name: {0: "B", 1: "S"} for name in names[:-1]} | {"s0": {0: "B"}}
    report = gdn_export.export(module, traced, tmp_path / "b.nnef.tgz", input_names=names,
                               output_names=["o", "state"], dynamic_axes=dynamic, lowering="chunked", check=False)
    model = tract.nnef().with_tract_transformers().load(str(report.path))
    assert [str(model.output_fact(i)) for i in range(2)] == ["B,S,4,16,f32", "B,4,32,16,f32"]
    runnable = gdn_export.run.runtime.load_tract_model(report.path)
    for batch, seq in [(1, CHUNK + 3), (3, 2 * CHUNK)]:
        args, kwargs = variant_inputs("gdn", batch=batch, seq=seq, width_k=32, width_v=16, seed=seq)
        _, tensors, _ = graph_inputs(args, kwargs)
        o, state = gdn_export.run_tract(runnable, [t.numpy() for t in tensors])
        ref_o, ref_state = oracle(args, kwargs)
        assert_close(o, ref_o, F32_TOLERANCE, f"B={batch} S={seq} o")
        assert_close(state, ref_state, F32_TOLERANCE, f"B={batch} S={seq} state")


@pytest.mark.parametrize("variant", ["gdn", "kda", "product3"])
@pytest.mark.slow  # a chunked export and runs: seconds
def test_chunk_size_is_a_parameter(variant, tmp_path):
    """``chunk_size=16``: chunks of 16 tokens (48 sub-steps for n=3), the same exactness at lengths around them;
    the report says the size."""
    traced_args, traced_kwargs = variant_inputs(variant, seq=3, width_k=32, width_v=16)
    module, traced, names = graph_inputs(traced_args, traced_kwargs)
    report = gdn_export.export(module, traced, tmp_path / "c.nnef.tgz", input_names=names, output_names=["o", "state"],
                               dynamic_axes=symbolic_time(names, traced_kwargs["num_householder"]),
                               lowering="chunked", check=False, chunk_size=16)
    assert "chunks of 16 tokens" in report.decisions[0].reason
    runnable = gdn_export.run.runtime.load_tract_model(report.path)
    for seq in [15, 16, 17, 40]:
        args, kwargs = variant_inputs(variant, seq=seq, width_k=32, width_v=16, seed=seq)
        _, tensors, _ = graph_inputs(args, kwargs)
        o, state = gdn_export.run_tract(runnable, [t.numpy() for t in tensors])
        ref_o, ref_state = oracle(args, kwargs)
        assert_close(o, ref_o, F32_TOLERANCE, f"{variant} S={seq} o")
        assert_close(state, ref_state, F32_TOLERANCE, f"{variant} S={seq} state")


@pytest.mark.parametrize("size", [0, 24, 8])
def test_chunk_size_must_be_a_multiple_of_the_solve_block(size, tmp_path):
    args, kwargs = variant_inputs("gdn", seq=3)
    module, tensors, names = graph_inputs(args, kwargs)
    with pytest.raises(gdn_export.LoweringError, match=f"chunk_size: a chunk size must be a positive multiple of 16 "
                                                       f"tokens, got {size}"):
        gdn_export.export(module, tensors, tmp_path / "x.nnef.tgz", input_names=names, output_names=["o", "state"],
                          lowering="chunked", check=False, chunk_size=size)
    assert not (tmp_path / "x.nnef.tgz").exists()
