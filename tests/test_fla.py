"""flash-linear-attention support: gdn_export.layers against a float64 re-reading of FLA's code, the FLA
checkpoints through the CLI and tract, and (when present) FLA's own logits from fixtures/fla_golden.npz."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from helpers import FIXTURES, FLA_CHECKPOINTS, by_fixture
from gdn_export.cli import main as cli
from gdn_export.hf.check import compare_logits, sample_tokens, session_logits, transformers_logits
from gdn_export.hf.checkpoint import CheckpointError, load_model, read_config
from gdn_export.hf.families import family_for
from gdn_export.hf.families.fla import FAMILY, build_model
from gdn_export.layers import DeltaNet, GatedDeltaNet, GatedDeltaNet2, GatedDeltaProduct, KimiDeltaAttention
from gdn_export.layers.common import GatedMLP

GOLDEN = FIXTURES / "fla_golden.npz"
GOLDEN_TOLERANCE = 1e-4  # x max(1, max |logit|): FLA on a GPU (TF32 off) against tract or torch on CPU


# --- a float64 reference written from FLA's layer code (fla/layers/*.py, fused_recurrent kernels) ------------

def ref_conv(x, weight):
    """ShortConvolution: depthwise nn.Conv1d with padding W-1, the first T outputs, SiLU. x [B, T, C]."""
    width = weight.shape[-1]
    y = F.conv1d(x.transpose(1, 2), weight, padding=width - 1, groups=weight.shape[0])[..., : x.shape[1]]
    return F.silu(y).transpose(1, 2)


def ref_l2(x):
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def ref_recurrence(q, k, v, *, g=None, beta=None, erase=None, write=None, l2=True):
    """FLA's fused_recurrent kernels with state_v_first (h [V, K]); all operands already on the value heads."""
    batch, seq, heads, width_k = q.shape
    h = torch.zeros(batch, heads, v.shape[-1], width_k, dtype=q.dtype)
    if l2:
        q, k = ref_l2(q), ref_l2(k)
    q = q * width_k ** -0.5
    out = []
    for t in range(seq):
        if g is not None:
            decay = g[:, t].exp()
            h = h * (decay[..., None, None] if decay.dim() == 2 else decay[:, :, None, :])
        kt = k[:, t]
        if erase is None:
            vt = (v[:, t] - torch.einsum("bhvk,bhk->bhv", h, kt)) * beta[:, t, :, None]
        else:
            vt = write[:, t] * v[:, t] - torch.einsum("bhvk,bhk->bhv", h, erase[:, t] * kt)
        h = h + vt[..., None] * kt[..., None, :]
        out.append(torch.einsum("bhvk,bhk->bhv", h, q[:, t]))
    return torch.stack(out, 1), h.transpose(-1, -2)  # state as [B, H, K, V]


def ref_heads(x, width):
    return x.reshape(*x.shape[:-1], -1, width)


def ref_rms(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def ref_output(layer, o, x, gate_act):
    if gate_act is None:
        o = ref_rms(o, layer.o_norm.weight, layer.o_norm.eps)
    else:
        gate = ref_heads(layer.g_proj(x), layer.head_v_dim)
        act = F.silu(gate) if gate_act == "swish" else gate.sigmoid()
        o = ref_rms(o, layer.o_norm.weight, layer.o_norm.eps) * act
    return layer.o_proj(o.flatten(-2))


def ref_qkv(layer, x):
    q, k, v = layer.q_proj(x), layer.k_proj(x), layer.v_proj(x)
    if layer.use_short_conv:
        return tuple(ref_conv(t, conv.weight) for t, conv in ((q, layer.q_conv1d), (k, layer.k_conv1d),
                                                             (v, layer.v_conv1d)))
    if getattr(layer, "qk_activation", "silu") == "relu":  # DeltaNet without convs: relu after the head split
        return q.relu(), k.relu(), F.silu(v)
    return F.silu(q), F.silu(k), F.silu(v)


def expand(x, heads):
    return x.repeat_interleave(heads // x.shape[2], dim=2)


def reference(layer, x):
    """The layer's output and final state on a whole sequence, in the dtype of layer and x."""
    q, k, v = ref_qkv(layer, x)
    hk, hv, kd, vd = layer.num_heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim
    if isinstance(layer, GatedDeltaProduct):
        n = layer.num_householder
        q = expand(ref_heads(q, kd), hv)
        k = expand(ref_heads(k, kd).reshape(x.shape[0], -1, hk, kd), hv)  # '... t (n h d) -> ... (t n) h d'
        v = ref_heads(v, vd).reshape(x.shape[0], -1, hv, vd)
        beta = layer.b_proj(x).sigmoid() * (2 if layer.allow_neg_eigval else 1)
        beta = beta.reshape(x.shape[0], -1, hv)
        g = None
        if layer.use_forget_gate:  # FLA's fused_recurrent mode: g at sub-step 0, q at sub-step n-1
            g = -layer.A_log.exp() * F.softplus(layer.a_proj(x) + layer.dt_bias)
            g = torch.stack([g] + [torch.zeros_like(g)] * (n - 1), 2).flatten(1, 2)
        q = torch.stack([torch.zeros_like(q)] * (n - 1) + [q], 2).flatten(1, 2)
        o, state = ref_recurrence(q, k, v, g=g, beta=beta)
        o = o.reshape(x.shape[0], -1, n, hv, vd)[:, :, -1]
        return ref_output(layer, o, x, "swish" if layer.output_gate else None), state
    q, k, v = ref_heads(q, kd), ref_heads(k, kd), ref_heads(v, vd)
    if isinstance(layer, GatedDeltaNet2):
        g = ref_heads(F.softplus(layer.f_proj(x) + layer.dt_bias), kd) * -layer.A_log.exp()[:, None]
        b, w = ref_heads(layer.b_proj(x).sigmoid(), kd), ref_heads(layer.w_proj(x).sigmoid(), vd)
        q, k, g, b = (expand(t, hv) for t in (q, k, g, b))
        b = b * (2 if layer.allow_neg_eigval else 1)
        o, state = ref_recurrence(q, k, v, g=g, erase=b, write=w)
        return ref_output(layer, o, x, "sigmoid"), state
    q, k = expand(q, hv), expand(k, hv)
    if isinstance(layer, DeltaNet):
        beta = layer.b_proj(x).sigmoid() if layer.use_beta else torch.ones_like(q[..., 0])
        if layer.qk_norm == "sum":
            q, k = q / q.sum(-1, keepdim=True), k / k.sum(-1, keepdim=True)
        o, state = ref_recurrence(q, k, v, beta=beta * (2 if layer.allow_neg_eigval else 1), l2=layer.qk_norm == "l2")
        return ref_output(layer, o, x, "swish" if layer.output_gate else None), state
    beta = layer.b_proj(x).sigmoid() * (2 if layer.allow_neg_eigval else 1)
    if isinstance(layer, KimiDeltaAttention):
        f = ref_heads(layer.f_proj(x), kd) + layer.dt_bias.view(hv, kd)
        if layer.lower_bound is None:
            g = -layer.A_log.exp()[:, None] * F.softplus(f)
        else:
            g = layer.lower_bound * torch.sigmoid(layer.A_log.exp()[:, None] * f)
        o, state = ref_recurrence(q, k, v, g=g, beta=beta)
        return ref_output(layer, o, x, "sigmoid"), state
    g = -layer.A_log.exp() * F.softplus(layer.a_proj(x) + layer.dt_bias)
    o, state = ref_recurrence(q, k, v, g=g, beta=beta)
    return ref_output(layer, o, x, "swish" if layer.output_gate else None), state


SMALL = dict(hidden_size=48, head_dim=8, num_heads=2)
LAYERS = {
    "gdn": (GatedDeltaNet, dict(SMALL, num_v_heads=4, expand_v=1.5)),
    "gdn_neg_eig_no_gate": (GatedDeltaNet, dict(SMALL, allow_neg_eigval=True, use_gate=False)),
    "gdn_no_conv": (GatedDeltaNet, dict(SMALL, use_short_conv=False, conv_size=3)),
    "kda": (KimiDeltaAttention, dict(SMALL, num_v_heads=4, expand_v=2)),
    "kda_lower_bound": (KimiDeltaAttention, dict(SMALL, safe_gate=True, lower_bound=-5.0, allow_neg_eigval=True)),
    "gdn2": (GatedDeltaNet2, dict(SMALL, num_v_heads=4, expand_v=0.5)),
    "gdn2_neg_eig": (GatedDeltaNet2, dict(SMALL, allow_neg_eigval=True)),
    "product2": (GatedDeltaProduct, dict(SMALL, num_v_heads=4, expand_v=1)),
    "product3_no_decay": (GatedDeltaProduct, dict(SMALL, num_householder=3, use_forget_gate=False,
                                                  allow_neg_eigval=False, use_output_gate=False)),
    "deltanet": (DeltaNet, dict(hidden_size=48, num_heads=4)),
    "deltanet_gated_expand": (DeltaNet, dict(hidden_size=48, num_heads=4, expand_v=2.0, use_gate=True,
                                             allow_neg_eigval=True)),
    "deltanet_sum_no_beta": (DeltaNet, dict(hidden_size=48, num_heads=4, qk_norm="sum", use_beta=False)),
    "deltanet_relu_no_conv": (DeltaNet, dict(hidden_size=48, num_heads=4, use_short_conv=False,
                                             qk_activation="relu")),
}


def random_layer(name: str, seed: int = 0):
    cls, kwargs = LAYERS[name]
    torch.manual_seed(seed)
    layer = cls(**kwargs)
    with torch.no_grad():  # spread every weight so a dropped term shows; keep decays and norms in range
        for pname, param in layer.named_parameters():
            if pname.endswith("norm.weight"):
                param.copy_(1 + 0.2 * torch.randn_like(param))
            elif pname.endswith(".bias") and pname != "dt_bias":
                param.copy_(0.3 * torch.randn_like(param))
            elif param.dim() >= 2 and "conv" not in pname:
                param.copy_(torch.randn_like(param) / math.sqrt(param.shape[-1]))
    return layer.double().eval()


@pytest.mark.parametrize("name", LAYERS)
def test_layer_prefill_and_decode_match_float64_reference(name):
    layer = random_layer(name)
    x = torch.randn(2, 13, layer.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected, expected_state = reference(layer, x)
        conv, state = layer.initial_states(2, torch.float64)
        state = state.double()
        outputs = []
        for begin, end in [(0, 10), (10, 11), (11, 12), (12, 13)]:  # prefill 10, then 3 single-token decodes
            out, conv, state = layer(x[:, begin:end], conv, state)
            outputs.append(out)
    actual = torch.cat(outputs, 1)
    assert actual.shape == expected.shape
    # the layer computes its gates and norms in float32 as FLA does, all else in float64 here
    scale = max(1.0, expected.abs().max().item())
    assert (actual - expected).abs().max().item() <= 2e-6 * scale, name
    assert (state - expected_state).abs().max().item() <= 2e-6 * max(1.0, expected_state.abs().max().item())
    if layer.use_short_conv:  # the conv caches hold the last W pre-conv inputs
        assert torch.allclose(conv[0], layer.q_proj(x[:, -layer.conv_size:]).transpose(1, 2), rtol=0, atol=1e-12)


def test_layer_float32_matches_float64():
    layer = random_layer("gdn")
    x = torch.randn(1, 9, layer.hidden_size, dtype=torch.float64)
    with torch.no_grad():
        expected, _ = reference(layer, x)
        single = layer.float()
        conv, state = single.initial_states(1)
        actual, _, _ = single(x.float(), conv, state)
    assert (actual.double() - expected).abs().max().item() <= 1e-5 * max(1.0, expected.abs().max().item())


class LayerGraph(torch.nn.Module):
    """One layer as a graph: x and its flat states in, output and new states out."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x, *states):
        out, conv, state = self.layer(x, tuple(states[:-1]), states[-1])
        return (out, *conv, state)


@pytest.mark.parametrize("name", ["gdn2", "gdn2_neg_eig", "kda_lower_bound", "product3_no_decay", "gdn_no_conv",
                                  "deltanet_relu_no_conv"])
@pytest.mark.slow  # exports a layer: seconds
def test_layer_exports_one_s_generic_graph(name, tmp_path):
    """Traced on S=3, run in tract as a prefill of 7 then 2 decode steps feeding the states back."""
    import gdn_export
    from gdn_export.run.runtime import load_tract_model, run_tract

    layer = random_layer(name)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 9, layer.hidden_size, generator=gen)
    with torch.no_grad():
        expected, _ = reference(layer, x.double())
    layer = layer.float()  # (export leaves the parameters wrapped: no dtype change after it)
    graph = LayerGraph(layer)
    conv, state = layer.initial_states(2)
    names = ["x"] + [f"conv_{p}" for p in "qkv"[: len(conv)]] + ["state"]
    dynamic = {"x": {0: "B", 1: "S"}, **{n: {0: "B"} for n in names[1:]}}
    traced = [torch.randn(2, 3, layer.hidden_size, generator=gen)] + [0.1 * torch.randn(t.shape, generator=gen)
                                                                       for t in (*conv, state)]
    report = gdn_export.export(graph, traced, tmp_path / "layer.nnef.tgz", input_names=names,
                               output_names=["out"] + [f"new_{n}" for n in names[1:]], dynamic_axes=dynamic)
    runnable = load_tract_model(report.path)
    states, outputs = [t.numpy() for t in (*conv, state)], []
    for begin, end in [(0, 7), (7, 8), (8, 9)]:
        out, *states = run_tract(runnable, [x[:, begin:end].numpy()] + states)
        outputs.append(out)
    error = np.abs(np.concatenate(outputs, 1) - expected.numpy()).max()
    assert error <= 1e-4 * max(1.0, float(expected.abs().max())), f"{name}: {error:.2e}"


# --- FLA's parameter names and shapes, read from fla/layers/*.py: load_state_dict(fla_layer.state_dict()) ------

def shapes(layer):
    return {k: tuple(v.shape) for k, v in layer.state_dict().items()}


QKV = lambda q, k, v, w=4: {  # noqa: E731
    "q_proj.weight": (q, 64), "k_proj.weight": (k, 64), "v_proj.weight": (v, 64),
    "q_conv1d.weight": (q, 1, w), "k_conv1d.weight": (k, 1, w), "v_conv1d.weight": (v, 1, w)}


def test_parameter_names_and_shapes_are_flas():
    gdn = GatedDeltaNet(hidden_size=64, head_dim=16, num_heads=2, num_v_heads=4)  # expand_v 2 -> V = 32
    assert shapes(gdn) == {**QKV(32, 32, 128), "a_proj.weight": (4, 64), "b_proj.weight": (4, 64), "A_log": (4,),
                           "dt_bias": (4,), "g_proj.weight": (128, 64), "o_norm.weight": (32,),
                           "o_proj.weight": (64, 128)}
    kda = KimiDeltaAttention(hidden_size=64, head_dim=16, num_heads=2, num_v_heads=4)
    assert shapes(kda) == {**QKV(32, 32, 64), "f_proj.0.weight": (16, 64), "f_proj.1.weight": (64, 16),
                           "b_proj.weight": (4, 64), "A_log": (4,), "dt_bias": (64,), "g_proj.0.weight": (16, 64),
                           "g_proj.1.weight": (64, 16), "g_proj.1.bias": (64,), "o_norm.weight": (16,),
                           "o_proj.weight": (64, 64)}
    gdn2 = GatedDeltaNet2(hidden_size=64, head_dim=16, num_heads=2, num_v_heads=4)
    assert shapes(gdn2) == {**QKV(32, 32, 64), "f_proj.0.weight": (16, 64), "f_proj.1.weight": (32, 16),
                            "b_proj.weight": (32, 64), "w_proj.weight": (64, 64), "A_log": (2,), "dt_bias": (32,),
                            "g_proj.0.weight": (16, 64), "g_proj.1.weight": (64, 16), "g_proj.1.bias": (64,),
                            "o_norm.weight": (16,), "o_proj.weight": (64, 64)}
    gdp = GatedDeltaProduct(hidden_size=64, head_dim=16, num_heads=2)  # layer defaults: n=2, forget gate, V = 32
    assert shapes(gdp) == {**QKV(32, 64, 128), "b_proj.weight": (4, 64), "a_proj.weight": (2, 64), "A_log": (2,),
                           "dt_bias": (2,), "g_proj.weight": (64, 64), "o_norm.weight": (32,),
                           "o_proj.weight": (64, 64)}
    delta = DeltaNet(hidden_size=64)  # num_heads 4, ungated
    assert shapes(delta) == {**QKV(64, 64, 64), "b_proj.weight": (4, 64), "o_norm.weight": (16,),
                             "o_proj.weight": (64, 64)}
    twin = DeltaNet(hidden_size=64)
    twin.load_state_dict(delta.state_dict())  # strict


def test_fla_layer_defaults():
    gdn = GatedDeltaNet(hidden_size=256)  # hidden 2048 by default: only the size of the projections changes
    assert (gdn.head_k_dim, gdn.head_v_dim, gdn.num_heads, gdn.num_v_heads) == (256, 512, 6, 6)
    assert gdn.o_norm.eps == 1e-5 and gdn.o_norm.activation == "swish" and not gdn.allow_neg_eigval
    kda = KimiDeltaAttention(hidden_size=256)
    assert (kda.head_k_dim, kda.head_v_dim, kda.num_heads, kda.o_norm.activation) == (128, 128, 16, "sigmoid")
    gdp = GatedDeltaProduct(hidden_size=256)
    assert (gdp.num_householder, gdp.allow_neg_eigval, gdp.use_forget_gate, gdp.head_v_dim) == (2, True, True, 512)
    assert DeltaNet(hidden_size=1024).head_k_dim == 256
    assert [GatedMLP(d).intermediate_size for d in (64, 96, 2048)] == [256, 256, 5632]  # 2/3 of 4x, up to 256k
    with pytest.raises(NotImplementedError, match="bias"):
        GatedDeltaNet(hidden_size=64, head_dim=16, num_heads=2, conv_bias=True)
    with pytest.raises(NotImplementedError, match="SiLU"):
        DeltaNet(hidden_size=64, qk_activation="relu")


# --- the FLA checkpoints through the CLI and tract --------------------------------------------------------

def eager_model(name):
    config = read_config(FIXTURES / name)
    return load_model(FIXTURES / name, family_for(config["model_type"]), config)


@pytest.mark.parametrize("name", by_fixture(*FLA_CHECKPOINTS))
def test_fixture_session_matches_eager_model(name, shared_session, reference_model):
    model = reference_model(name)
    tokens = sample_tokens(model.config.vocab_size, 2, 16 + 8, seed=7)
    expected = transformers_logits(model, tokens, 16)  # the eager model, called as transformers models are
    session = shared_session(name, "float32", 2)
    actual = session_logits(session, tokens, 16)
    check = compare_logits(actual, expected, "float32")
    assert check.max_abs_logit > 1.0, "fixture logits are too flat to test anything"
    assert check.max_abs_error <= 1e-4 * max(1.0, check.max_abs_logit), f"{name}: {check}"
    names = [s["name"] for s in session.metadata["states"]]
    layer0 = ["conv_q_0", "conv_k_0", "conv_v_0", "state_0"]
    assert names[:4] == layer0 and session.metadata["family"] == "FLA"
    if name == "fla_gated_deltanet":
        assert names[4:6] == ["key_1", "value_1"]


def test_eager_prefill_equals_stepwise():
    model = eager_model("fla_gated_deltanet")
    tokens = torch.from_numpy(sample_tokens(128, 2, 20, seed=3))
    with torch.no_grad():
        whole = model(tokens).logits
        stepwise = torch.from_numpy(transformers_logits(model, tokens.numpy(), 11))
    assert (whole - stepwise).abs().max().item() <= 1e-5 * max(1.0, whole.abs().max().item())


@pytest.mark.skipif(not GOLDEN.exists(), reason="fixtures/fla_golden.npz not found: it is written on a CUDA machine "
                    "with flash-linear-attention installed by `python fixtures/make_fla_golden.py`")
@pytest.mark.parametrize("name", by_fixture(*FLA_CHECKPOINTS))
def test_eager_model_matches_fla_golden(name, reference_model):
    golden = np.load(GOLDEN)
    if f"{name}/logits" not in golden.files:
        pytest.skip(f"{GOLDEN.name} has no logits for {name}")
    tokens, info = golden["tokens"], json.loads(str(golden["info"]))
    model = reference_model(name)
    actual = transformers_logits(model, tokens, info["prompt"])
    for key, got in ((f"{name}/logits", actual), (f"{name}/full_logits", None)):
        if key not in golden.files:
            continue
        if got is None:
            with torch.no_grad():
                got = model(torch.from_numpy(tokens)).logits.numpy()
        expected = golden[key]
        scale = max(1.0, float(np.abs(expected).max()))
        error = float(np.abs(got - expected).max())
        assert error <= GOLDEN_TOLERANCE * scale, f"{key}: max |logit error| {error:.2e} vs FLA {info}"
        print(f"{key}: eager vs FLA max |logit error| {error:.2e} (max |logit| {scale:.2f})")


# --- configs and weights that do not fit ------------------------------------------------------------------

def copy_fixture(tmp_path, name="fla_delta_net", **changes):
    folder = tmp_path / name
    shutil.copytree(FIXTURES / name, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))
    return folder, config


@pytest.mark.parametrize("changes,message", [
    (dict(hidden_size="64"), "hidden_size must be an integer >= 1"),
    (dict(use_gate=1), "'use_gate' must be true or false"),
    (dict(attnres_block_size=2), "attention residuals"),
    (dict(hidden_act="powlu"), "hidden_act 'powlu'"),
    (dict(qk_activation="relu"), "SiLU"),
    (dict(attn=dict(layers=[5], num_heads=4)), "out of range"),
    (dict(attn=dict(layers=[0])), "needs 'layers' and 'num_heads'"),
    (dict(num_heads=5), "divisible"),
])
def test_bad_configs_are_clear_errors(tmp_path, changes, message):
    folder, config = copy_fixture(tmp_path, **changes)
    with pytest.raises(CheckpointError, match=message):
        load_model(folder, FAMILY, config)


@pytest.mark.slow  # exports a layer: seconds
def test_weights_must_match_config(tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    folder, config = copy_fixture(tmp_path, num_hidden_layers=3)
    with pytest.raises(CheckpointError, match="missing from the checkpoint: model.layers.2"):
        load_model(folder, FAMILY, config)
    folder, config = copy_fixture(tmp_path / "b", "fla_kda", head_dim=8)
    with pytest.raises(CheckpointError, match="disagree with config.json sizes"):
        load_model(folder, FAMILY, config)
    folder, config = copy_fixture(tmp_path / "c")
    tensors = load_file(folder / "model.safetensors")
    save_file({**tensors, "model.layers.0.attn.extra": torch.zeros(2)}, folder / "model.safetensors")
    with pytest.raises(CheckpointError, match="does not describe: model.layers.0.attn.extra"):
        load_model(folder, FAMILY, config)
    assert cli(["convert", str(folder), "-o", str(tmp_path / "x.nnef.tgz")]) == 1
    assert "does not describe" in capsys.readouterr().err


def test_loading_ties_embeddings_and_casts_bfloat16():
    delta = eager_model("fla_delta_net")
    assert delta.lm_head.weight is delta.model.embeddings.weight
    kda = eager_model("fla_kda")
    assert all(p.dtype == torch.float32 for p in kda.parameters())
    assert build_model(read_config(FIXTURES / "fla_gated_deltanet")).config.layer_types == [
        "linear_attention", "full_attention", "linear_attention"]


@pytest.mark.parametrize("name", by_fixture(*FLA_CHECKPOINTS))
def test_converted_model_in_tract_matches_fla_golden(name, shared_session):
    """The CLI's .nnef.tgz, run by Session in tract, against FLA's own model classes (prefill 16 + decode 8)."""
    if not GOLDEN.exists():
        pytest.skip(f"{GOLDEN.name} not found: write it on a GPU with `python fixtures/make_fla_golden.py`")
    golden = np.load(GOLDEN)
    tokens, info = golden["tokens"], json.loads(str(golden["info"]))
    actual = session_logits(shared_session(name, "float32", tokens.shape[0]), tokens, info["prompt"])
    expected = golden[f"{name}/logits"]
    error = float(np.abs(actual - expected).max())
    assert error <= GOLDEN_TOLERANCE * max(1.0, float(np.abs(expected).max())), f"{name}: {error:.2e} vs FLA {info}"
