"""The torch side: the custom ops' contract, and the reference math against transformers' own kernels."""

import numpy as np
import pytest
import torch

import gdn_export
import gdn_export.run.runtime  # noqa: F401  (load_tract_model, run_tract)
from helpers import make_rule_inputs
from gdn_export.errors import GdnExportError
from gdn_export.parity import max_abs_error, tolerance_for
from gdn_export.ops.registration import define_or_reuse
from oracle import delta_rule_seq_major, gated_delta_head_major


def head_major_inputs(seq=5, key_heads=2, heads=4, width_k=16, width_v=8, dtype=torch.float32):
    q, k, v, g, beta, s0 = make_rule_inputs(2, seq, key_heads, heads, width_k, width_v, dtype)
    q, k = gdn_export.l2norm(q.float()).to(dtype) / width_k**0.5, gdn_export.l2norm(k.float()).to(dtype)
    return [x.transpose(1, 2).contiguous() for x in (q, k, v, g, beta)] + [s0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gated_delta_scan_passes_opcheck(dtype):
    torch.library.opcheck(torch.ops.t2n_extra.gated_delta_scan.default, head_major_inputs(dtype=dtype))


def test_gated_delta_scan_output_dtypes():
    y, state = gdn_export.gated_delta_scan(*head_major_inputs(dtype=torch.float16))
    assert y.dtype == torch.float32 and state.dtype == torch.float32  # promote(f16 q, f32 state)
    assert y.shape == (2, 4, 5, 8) and state.shape == (2, 4, 16, 8)


def test_gated_delta_rule_passes_opcheck():
    q, k, v, g, beta, s0 = make_rule_inputs(2, 3, 2, 4, 16, 8)
    torch.library.opcheck(torch.ops.t2n_extra.gated_delta_rule.default, (q, k, v, g, beta, None, None, s0, 0.25, True, 1))


@pytest.mark.parametrize("module", ["qwen3_next", "qwen3_5", "olmo_hybrid", "qwen4_exp", "lara_mini"])
def test_reference_matches_transformers_kernels(module):
    """gated_delta_rule(use_qk_l2norm=True) is transformers' torch_recurrent/chunk_gated_delta_rule."""
    import importlib

    hf = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    q, k, v, g, beta, s0 = make_rule_inputs(2, 70, 2, 4, 16, 8)
    o, state = gdn_export.gated_delta_rule(q, k, v, g, beta, s0, use_qk_l2norm=True)
    repeat = lambda x: x.repeat_interleave(2, dim=2)  # noqa: E731 - transformers repeats before its kernels
    for kernel in (hf.torch_recurrent_gated_delta_rule, hf.torch_chunk_gated_delta_rule):
        ref_o, ref_state = kernel(repeat(q), repeat(k), v, g, beta, initial_state=s0, output_final_state=True,
                                  use_qk_l2norm_in_kernel=True)
        assert (o - ref_o).abs().max() <= 1e-5 * max(1.0, ref_o.abs().max())
        assert (state - ref_state).abs().max() <= 1e-5 * max(1.0, ref_state.abs().max())


def test_gated_delta_rule_defaults():
    q, k, v, g, beta, _ = make_rule_inputs(1, 4, 1, 1, 8, 8, dtype=torch.float16)
    o, state = gdn_export.gated_delta_rule(q, k, v, g, beta)
    assert o.dtype == torch.float16 and state.dtype == torch.float32 and state.shape == (1, 1, 8, 8)
    explicit, _ = gdn_export.gated_delta_rule(q, k, v, g, beta, torch.zeros(1, 1, 8, 8), scale=8**-0.5)
    assert torch.equal(o, explicit)


def test_define_reuses_a_matching_op_and_refuses_a_different_one():
    # the same signature (argument names may differ) is reused silently
    define_or_reuse("t2n_extra::gated_delta_scan",
                    "(Tensor a, Tensor b, Tensor c, Tensor d, Tensor e, Tensor f) -> (Tensor, Tensor)",
                    lambda *a: None, lambda *a: None)
    with pytest.raises(GdnExportError, match="already defined by another package"):
        define_or_reuse("t2n_extra::gated_delta_scan", "(Tensor q) -> Tensor", lambda *a: None, lambda *a: None)
    # the reused op still computes the rule (the stand-in implementations above were not installed)
    operands = head_major_inputs()
    y, state = torch.ops.t2n_extra.gated_delta_scan(*operands)
    ref_y, ref_state = gated_delta_head_major(*operands)
    assert abs(y.double().numpy() - ref_y).max() <= 1e-5 and abs(state.double().numpy() - ref_state).max() <= 1e-5


class DeltaNetModule(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.rule = gdn_export.GatedDeltaRule(use_qk_l2norm=True)

    def forward(self, q, k, v, beta, s0):
        return self.rule(q, k, v, None, beta, s0)


def test_import_defines_the_ops_when_torch_is_already_imported():
    """A torch user's order (import torch, import gdn_export, call the op) works as with any custom-op package: the
    t2n_extra ops are defined by the import itself, and their result is the float64 recurrence's. A fresh process:
    this one registered the ops in conftest."""
    script = (
        "import sys, torch, gdn_export\n"
        "assert not any(m.startswith(('transformers', 'torch_to_nnef', 'onnx')) for m in sys.modules), 'heavy import'\n"
        "g = torch.Generator().manual_seed(0)\n"
        "q, k = (torch.nn.functional.normalize(torch.randn(1, 2, 5, 8, generator=g), dim=-1) for _ in range(2))\n"
        "v = torch.randn(1, 2, 5, 4, generator=g)\n"
        "gate = -torch.rand(1, 2, 5, generator=g)\n"
        "beta = torch.rand(1, 2, 5, generator=g)\n"
        "s0 = torch.randn(1, 2, 8, 4, generator=g)\n"
        "y, s = torch.ops.t2n_extra.gated_delta_scan(q, k, v, gate, beta, s0)\n"
        "for name in ('gated_delta_rule', 'causal_conv1d_update', 'moe_ffn'):\n"
        "    getattr(torch.ops.t2n_extra, name)\n"
        "torch.save({'args': (q, k, v, gate, beta, s0), 'y': y, 's': s}, sys.argv[1])\n")
    import subprocess
    import sys
    import tempfile
    with tempfile.TemporaryDirectory() as folder:
        out = f"{folder}/result.pt"
        done = subprocess.run([sys.executable, "-c", script, out], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        result = torch.load(out)
    y, s = gated_delta_head_major(*(t.double().numpy() for t in result["args"]))
    for actual, expected in ((result["y"].numpy(), y), (result["s"].numpy(), s)):  # float32 against float64
        assert max_abs_error(actual, expected) <= tolerance_for(expected.astype(np.float32))


def test_module_without_decay_is_delta_net(tmp_path):
    """GatedDeltaRule with g=None is the DeltaNet rule (no decay), eager and exported to tract."""
    q, k, v, _, beta, s0 = make_rule_inputs(1, 6, 2, 2, 8, 8)
    ref_o, ref_state = delta_rule_seq_major(q, k, v, s0, beta=beta, use_qk_l2norm=True)
    o, state = DeltaNetModule()(q, k, v, beta, s0)
    assert abs(o.double().numpy() - ref_o).max() <= 1e-5 and abs(state.double().numpy() - ref_state).max() <= 1e-5
    report = gdn_export.export(DeltaNetModule(), (q, k, v, beta, s0), tmp_path / "m.nnef.tgz", check=False,
                               input_names=["q", "k", "v", "beta", "s0"], output_names=["o", "state"])
    o, state = gdn_export.run_tract(report.path, [x.numpy() for x in (q, k, v, beta, s0)])
    assert abs(o - ref_o).max() <= 1e-5 and abs(state - ref_state).max() <= 1e-5


def test_channel_wise_decay_matches_transformers_kimi_kernels():
    """KDA: gated_delta_rule with a [B, T, H, K] decay is transformers' recurrent and chunked Kimi kernels."""
    from transformers.models.kimi_linear import modeling_kimi_linear as kimi

    q, k, v, _, beta, s0 = make_rule_inputs(2, 70, 4, 4, 16, 16)
    g = -torch.nn.functional.softplus(torch.randn(2, 70, 4, 16)) * torch.linspace(0.05, 3.0, 4)[:, None]
    o, state = gdn_export.gated_delta_rule(q, k, v, g, beta, s0, use_qk_l2norm=True)
    for kernel in (kimi.recurrent_kimi_delta_attention, kimi.chunk_kimi_delta_attention):
        ref_o, ref_state = kernel(q, k, v, g, beta, initial_state=s0, output_final_state=True,
                                  use_qk_l2norm_in_kernel=True)
        assert (o - ref_o).abs().max() <= 1e-5 * max(1.0, ref_o.abs().max()), kernel.__name__
        assert (state - ref_state).abs().max() <= 1e-5 * max(1.0, ref_state.abs().max()), kernel.__name__


class ShortConvModule(torch.nn.Module):
    """The short conv as a GDN layer calls it: in_proj's ``[B, S, C]`` transposed in, the output transposed back."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = torch.nn.Parameter(weight)

    def forward(self, x, state):
        from gdn_export.ops.causal_conv1d.op import causal_conv1d_update

        y, new_state = causal_conv1d_update(x.transpose(1, 2), self.weight, state)
        return y.transpose(1, 2), new_state


def conv_oracle(x: np.ndarray, weight: np.ndarray, state: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """float64 via torch's depthwise conv1d over state ++ x (x [B, S, C]): (y, new state, sum_i |w_i x_i|)."""
    full = torch.cat([torch.from_numpy(state), torch.from_numpy(x).transpose(1, 2)], dim=2).double()
    w = torch.from_numpy(weight).double()[:, None, :]
    conv = torch.nn.functional.conv1d(full, w, groups=w.shape[0])[..., 1:]  # S outputs: windows ending at x's
    magnitude = torch.nn.functional.conv1d(full.abs(), w.abs(), groups=w.shape[0])[..., 1:]
    y = torch.nn.functional.silu(conv).transpose(1, 2).numpy()
    return y, full[..., -weight.shape[1]:].numpy(), magnitude.transpose(1, 2).numpy()


@pytest.mark.slow  # exports a module: seconds
def test_short_conv_in_tract_matches_float64_conv(tmp_path):
    """The NNEF short conv (a scan over chunks of 16 tokens, any S from one graph) against a float64 depthwise conv:
    calls of 6 tokens (a partial chunk), 1 (a decode step), 21 (a whole chunk and a partial one) and 16 (whole), each
    fed the state the previous one returned."""
    channels, width = 40, 4
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(channels, width, generator=gen)
    traced = (torch.randn(2, 3, channels, generator=gen), torch.randn(2, channels, width, generator=gen))
    report = gdn_export.export(ShortConvModule(weight), traced, tmp_path / "conv.nnef.tgz", check=False,
                               input_names=["x", "state"], output_names=["y", "new_state"],
                               dynamic_axes={"x": {0: "B", 1: "S"}, "state": {0: "B"}})
    assert {d.lowering for d in report.decisions if "causal_conv1d" in d.entry} == {"chunks"}
    runnable = gdn_export.run.runtime.load_tract_model(report.path)
    x = torch.randn(2, 44, channels, generator=gen).numpy()
    state = np.zeros((2, channels, width), np.float32)
    for begin, end in [(0, 6), (6, 7), (7, 28), (28, 44)]:
        want_y, want_state, magnitude = conv_oracle(x[:, begin:end], weight.numpy(), state)
        y, state = gdn_export.run.runtime.run_tract(runnable, [x[:, begin:end], state])
        # f32: W products and W - 1 additions round once each, SiLU (|silu'| <= 1.1) a few ulps more
        bound = 2 * width * np.finfo(np.float32).eps * magnitude + 4 * np.finfo(np.float32).eps * np.abs(want_y)
        assert y.shape == want_y.shape and (np.abs(y - want_y) <= 1.1 * bound + 1e-30).all(), (begin, end)
        assert np.array_equal(state, want_state.astype(np.float32)), (begin, end)
