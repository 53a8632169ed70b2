"""Q4_0's scale rules (gdn_export.weights.q4_0): the search against the nearest rule, each block's error computed
here from the stored bytes, and the calibration's importance against transformers' own activations."""

import numpy as np
import pytest
import torch

from gdn_export.weights import q4_0
from helpers import FIXTURES
from oracle import decoded, nearest_blocks


def random_blocks(seed: int, rows: int = 256, cols: int = 256) -> np.ndarray:
    """Blocks of several shapes of distribution: Gaussian, heavy-tailed, one outlier, all-zero, tiny, huge."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, cols)) * rng.lognormal(0, 2, (rows, 1))
    x[rows // 4: rows // 2] = rng.standard_t(2, (rows // 2 - rows // 4, cols))
    x[rows // 2: rows // 2 + 8, ::32] *= 50  # an outlier in each block
    x[-4:, :64] = 0.0
    x[-8:-4] *= 1e-6
    x[-12:-8] = np.clip(x[-12:-8] * 3e4, -6e5, 6e5)  # scales beyond f16's range
    return x.astype(np.float32)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("weighted", [False, True])
def test_search_never_has_a_larger_block_error_than_nearest(seed, weighted):
    x = random_blocks(seed)
    importance = np.random.default_rng(100 + seed).lognormal(0, 2, x.shape[1]).astype(np.float32) if weighted else None
    w = np.ones_like(x) if importance is None else np.broadcast_to(importance, x.shape)
    w = w.reshape(-1, 32).astype(np.float64)
    truth = x.reshape(-1, 32).astype(np.float64)
    searched = decoded(q4_0.quantize(x, "search", importance)).astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        nearest = nearest_blocks(x).astype(np.float64)
    assert np.isfinite(searched).all()
    err_search = (w * (searched - truth) ** 2).sum(1)
    err_nearest = (w * (nearest - truth) ** 2).sum(1)
    # per block, up to float32 rounding of the error sums the quantizer compares; where the nearest rule's scale
    # overflows f16 (an extreme beyond 8 * 65504) its blocks decode to nan, the search's never
    finite = np.isfinite(err_nearest)
    assert np.isfinite(err_search).all()
    assert (err_search[finite] <= err_nearest[finite] * (1 + 1e-5) + 1e-30).all()
    assert err_search[finite].sum() < 0.95 * err_nearest[finite].sum()  # and it does search: lower in aggregate


def test_calibrated_weighting_lowers_the_weighted_error():
    """Weighted by a channel importance, the search lowers the error in that weighting compared with the unweighted
    search (the quantity the calibrated export minimizes: the expected squared error of the layer's output)."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((512, 256)).astype(np.float32)
    importance = rng.lognormal(0, 1.5, 256).astype(np.float32)
    truth = x.reshape(-1, 32).astype(np.float64)
    w = np.broadcast_to(importance, x.shape).reshape(-1, 32).astype(np.float64)

    def weighted_error(stored):
        return float((w * (decoded(stored) - truth) ** 2).sum())

    plain = weighted_error(q4_0.quantize(x, "search"))
    calibrated = weighted_error(q4_0.quantize(x, "search", importance))
    nearest = float((w * (nearest_blocks(x) - truth) ** 2).sum())
    assert calibrated < 0.95 * plain < nearest


def test_nearest_rule_is_llama_cpp_q4_0():
    """Bit for bit, except where llama.cpp's scale overflows f16 (its block reads as nan; here f16's largest)."""
    x = random_blocks(11)
    with np.errstate(over="ignore", invalid="ignore"):
        expected = nearest_blocks(x)
    got = decoded(q4_0.quantize(x, "nearest"))
    finite = np.isfinite(expected).all(1)
    assert (~finite).sum() > 0 and np.isfinite(got).all()
    np.testing.assert_array_equal(got[finite], expected[finite])


@pytest.mark.slow
def test_the_importance_is_the_mean_squared_input_of_each_linear_layer(tmp_path):
    """The calibration's importance of a layer's input channels is the mean square of what transformers feeds that
    layer on the calibration tokens: here, the MLP's input read from the norm before it (the output of another
    module than the one calibration hooks), and the head's from the model's last hidden state, in one in-memory run."""
    from gdn_export.hf.calibration import calibrate, calibration_tokens
    from gdn_export.hf.checkpoint import model_in_memory, open_checkpoint

    fixture = FIXTURES / "qwen3_5"
    text = tmp_path / "calibration.txt"
    text.write_text("def f(x):\n    return [i * x for i in range(10)]\n" * 40)
    family, layout, _, weights = open_checkpoint(fixture)
    measured = calibrate(fixture, text, family, layout, weights, max_tokens=96, ctx=32)
    tokens, _ = calibration_tokens(text, fixture, 96, 32)
    assert measured.tokens == tokens.size == 96 and tokens.shape == (3, 32)
    model = model_in_memory(family, layout, weights)
    captured = {}
    norm = model.model.layers[0].post_attention_layernorm
    handle = norm.register_forward_hook(lambda module, args, out: captured.update(mlp_input=out))
    with torch.no_grad():
        out = model(input_ids=torch.from_numpy(tokens), use_cache=False, output_hidden_states=True)
    handle.remove()

    def mean_square(t: torch.Tensor) -> np.ndarray:
        return t.reshape(-1, t.shape[-1]).double().square().mean(0).numpy()

    np.testing.assert_allclose(measured.importance["model.layers.0.mlp.gate_proj.weight"],
                               mean_square(captured["mlp_input"]), rtol=1e-5)
    np.testing.assert_allclose(measured.importance["lm_head.weight"], mean_square(out.hidden_states[-1]), rtol=1e-5)
    linear = {f"{name}.weight" for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert set(measured.importance) == linear


def correlated_inputs(seed: int, inner: int = 128, count: int = 2048) -> np.ndarray:
    """Second moments E[a a^T] of inputs with correlated channels of unequal scales (as a layer's inputs are)."""
    rng = np.random.default_rng(seed)
    mixing = np.eye(inner) + 0.5 * rng.standard_normal((inner, inner)) / np.sqrt(inner)
    a = rng.standard_normal((count, inner)) @ mixing * rng.lognormal(0, 1, inner)
    return (a.T @ a / count).astype(np.float32)


def test_gptq_lowers_the_expected_output_error():
    """GPTQ minimizes E|(W - Q) a|^2 = tr((W - Q) G (W - Q)^T), computed here from the decoded bytes: lower than the
    search weighted by the diagonal of G alone, itself lower than nearest; and any slice of rows gives the same
    bytes (the converter writes a slice of rows at a time, the check's reference the whole)."""
    gram = correlated_inputs(3)
    w = (np.random.default_rng(4).standard_normal((96, gram.shape[0])) * 0.05).astype(np.float32)

    def output_error(stored: np.ndarray) -> float:
        error = decoded(stored).reshape(w.shape).astype(np.float64) - w
        return float(np.einsum("ij,jk,ik->", error, gram.astype(np.float64), error))

    gptq = q4_0.quantize(w, "gptq", gram=gram)
    searched = output_error(q4_0.quantize(w, "search", np.diag(gram).copy()))
    with np.errstate(over="ignore", invalid="ignore"):
        nearest = float(np.einsum("ij,jk,ik->", nearest_blocks(w).reshape(w.shape) - w, gram.astype(np.float64),
                                  nearest_blocks(w).reshape(w.shape) - w))
    assert output_error(gptq) < 0.9 * searched < 0.9 * nearest
    sliced = np.concatenate([q4_0.quantize(w[:37], "gptq", gram=gram), q4_0.quantize(w[37:], "gptq", gram=gram)])
    np.testing.assert_array_equal(sliced, gptq)
    with pytest.raises(ValueError, match="second moments"):
        q4_0.quantize(w, "gptq")


def test_rule_and_calibration_options_are_refused_when_they_cannot_apply(tmp_path, capsys):
    """Exit status 2 with the reason, before the checkpoint is read; the API refuses the same (GdnExportError)."""
    from gdn_export.cli import main as cli
    from gdn_export.errors import GdnExportError
    from gdn_export.pipeline.convert import convert

    text = tmp_path / "calibration.txt"
    text.write_text("x = 1\n")
    out = tmp_path / "m.nnef.tgz"
    for bad, reason in ((["--calibration", str(text)], "add --quantize q4_0"),
                        (["--q4-rule", "search"], "add --quantize q4_0"),
                        (["--quantize", "q4_0", "--q4-rule", "nearest", "--calibration", str(text)], "drop one"),
                        (["--quantize", "q4_0", "--q4-rule", "gptq"], "needs --calibration")):
        assert cli(["convert", str(tmp_path / "nowhere"), "-o", str(out), *bad]) == 2, bad
        assert reason in capsys.readouterr().err, bad
    with pytest.raises(GdnExportError, match="not a file"):
        convert(tmp_path / "nowhere", out, quantize="q4_0", calibration=tmp_path / "missing.txt")
    with pytest.raises(GdnExportError, match="needs calibration"):
        convert(tmp_path / "nowhere", out, quantize="q4_0", q4_rule="gptq")
    assert not out.exists()
