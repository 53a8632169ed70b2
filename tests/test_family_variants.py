"""Every variant of the delta-rule family exported and run in tract against the float64 oracle (docs/MATH.md)."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import gdn_export
from oracle import delta_rule_seq_major

TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-2}
LOWERINGS = ["auto", "recurrent"]
VARIANTS = ["deltanet", "gdn", "kda", "gdn2", "gdn2_neg_eig", "product2", "product3", "product2_no_decay"]


def variant_inputs(variant, batch=2, seq=7, key_heads=2, heads=4, width_k=16, width_v=8, dtype=torch.float32,
                   seed=0):
    """Operands with gates from each variant's real formulas; returns (positional, keyword) arguments."""
    gen = torch.Generator().manual_seed(seed)
    n = int(variant[7]) if variant.startswith("product") else 1
    rand = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    q = rand(batch, seq, key_heads, width_k)
    k = rand(batch, seq * n, key_heads, width_k)
    v = rand(batch, seq * n, heads, width_v)
    s0 = 0.5 * rand(batch, heads, width_k, width_v)
    a_log = torch.linspace(0.02, 12.0, heads).log()
    kwargs = {}
    if variant in ("kda", "gdn2", "gdn2_neg_eig"):
        g = -a_log.exp()[:, None] * F.softplus(rand(batch, seq, heads, width_k) - 1.0)
    elif variant in ("deltanet", "product2_no_decay"):
        g = None
    else:
        g = -a_log.exp() * F.softplus(rand(batch, seq, heads) + 1.0)
    if variant.startswith("gdn2"):
        beta = None
        kwargs["erase"] = torch.sigmoid(rand(batch, seq, heads, width_k)) * (2 if variant.endswith("eig") else 1)
        kwargs["write"] = torch.sigmoid(rand(batch, seq, heads, width_v)).to(dtype)
        kwargs["erase"] = kwargs["erase"].to(dtype)
    else:
        beta = torch.sigmoid(rand(batch, seq * n, heads)) * (2 if variant.startswith("product") else 1)
        beta = beta.to(dtype)
    kwargs["num_householder"] = n
    return [q.to(dtype), k.to(dtype), v.to(dtype), g, beta, s0], kwargs


class Rule(torch.nn.Module):
    def __init__(self, erase=False, num_householder=1):
        super().__init__()
        self.erase, self.num_householder = erase, num_householder

    def forward(self, q, k, v, *rest):
        rest = list(rest)
        g = rest.pop(0) if self.has_g else None
        if self.erase:
            erase, write, s0 = rest
            return gdn_export.gated_delta_rule(q, k, v, g, None, s0, erase=erase, write=write, use_qk_l2norm=True)
        beta, s0 = rest
        return gdn_export.gated_delta_rule(q, k, v, g, beta, s0, num_householder=self.num_householder,
                                          use_qk_l2norm=True)


def graph_inputs(args, kwargs):
    """(module, flat tensor inputs, names) for one variant's operands."""
    q, k, v, g, beta, s0 = args
    module = Rule(erase="erase" in kwargs, num_householder=kwargs["num_householder"])
    module.has_g = g is not None
    tensors, names = [q, k, v], ["q", "k", "v"]
    if g is not None:
        tensors, names = tensors + [g], names + ["g"]
    if "erase" in kwargs:
        tensors, names = tensors + [kwargs["erase"], kwargs["write"]], names + ["erase", "write"]
    else:
        tensors, names = tensors + [beta], names + ["beta"]
    return module, tensors + [s0], names + ["s0"]


def oracle(args, kwargs):
    q, k, v, g, beta, s0 = args
    as_np = lambda x: None if x is None else x.float().numpy()  # noqa: E731
    return delta_rule_seq_major(as_np(q), as_np(k), as_np(v), as_np(s0), g=as_np(g), beta=as_np(beta),
                                erase=as_np(kwargs.get("erase")), write=as_np(kwargs.get("write")),
                                num_householder=kwargs["num_householder"], use_qk_l2norm=True)


def assert_close(actual, expected, relative, what):
    error = np.abs(np.asarray(actual, np.float64) - expected).max()
    assert error <= relative * np.abs(expected).max(), f"{what}: max abs error {error:.3e}"


@pytest.mark.parametrize("variant", VARIANTS)
def test_eager_reference_matches_oracle(variant):
    args, kwargs = variant_inputs(variant, seq=9)
    o, state = gdn_export.gated_delta_rule(*args, use_qk_l2norm=True, erase=kwargs.get("erase"),
                                           write=kwargs.get("write"), num_householder=kwargs["num_householder"])
    ref_o, ref_state = oracle(args, kwargs)
    assert_close(o, ref_o, 1e-5, "o")
    assert_close(state, ref_state, 1e-5, "state")


@pytest.mark.parametrize("lowering", LOWERINGS)
@pytest.mark.parametrize("seq", [1, 7, 100])
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


@pytest.mark.parametrize("lowering", LOWERINGS)
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
