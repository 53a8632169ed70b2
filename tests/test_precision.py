"""The float16 rule of hf/check.py: an export no worse than twice the reference framework's own float16 model,
judged on the typical position. It passes what f16 rounding does (isolated flips included) and fails an archive
whose weights were changed slightly."""

import io
import tarfile
from pathlib import Path

import numpy as np
import pytest

from helpers import FIXTURES, by_fixture, resealed
from gdn_export.cli import main as cli
from gdn_export.errors import GdnExportError
from gdn_export.hf.check import F16_MULTIPLE, check_against_transformers, compare_logits

DAT_HEADER = 128  # NNEF tensor file: magic 4E EF, version, data bytes, rank, 8 extents, bits per item, item type


# --- the rule on synthetic logits ------------------------------------------------------------------------------

EXPECTED = 1.2 * np.random.default_rng(0).standard_normal((2, 24, 128))  # reference logits [B, S, vocab]


def rounded(noise=3e-3, seed=1):
    """A 'float16 model' of EXPECTED: per-token noise of a given size."""
    return EXPECTED + noise * np.random.default_rng(seed).standard_normal(EXPECTED.shape)


def test_an_isolated_flip_passes_where_a_max_rule_fails():
    """A near-tied discrete choice (MoE routing, an indexer's top-k) flips in the export only: a large error at one
    position that carries on, decaying, to the next ones. The typical position is untouched."""
    expected, baseline, actual = EXPECTED, rounded(seed=1), rounded(seed=2)
    rng = np.random.default_rng(3)
    for offset, size in enumerate([0.9, 0.5, 0.3, 0.2, 0.1, 0.1, 0.05]):  # a flip at step 9 of the first sequence
        actual[0, 9 + offset] += size * rng.standard_normal(expected.shape[-1])
    check = compare_logits(actual, expected, "float16", baseline)
    assert check.ok, check
    assert check.max_abs_error > 5e-2 * max(1.0, check.max_abs_logit)  # the old rule, 5e-2 x max |logit|, fails it
    assert check.ambiguous > 0 and check.top1_agreement == 1.0  # where the error could reorder the top-2: not judged


@pytest.mark.parametrize("factor,ok", [(1.0, True), (1.5, True), (3.0, False)])
def test_an_error_at_every_position_is_judged_against_the_frameworks_own(factor, ok):
    expected, baseline, actual = EXPECTED, rounded(seed=1), rounded(noise=factor * 3e-3, seed=2)
    check = compare_logits(actual, expected, "float16", baseline)
    assert check.ok == ok, check
    assert check.ratio == pytest.approx(factor, rel=0.25)


def test_non_finite_logits_fail():
    expected, baseline = EXPECTED, rounded(seed=1)
    actual = baseline.copy()
    actual[1, 20, 7] = np.inf
    assert not compare_logits(actual, expected, "float16", baseline).ok
    assert not compare_logits(actual, expected, "float32").ok
    assert not compare_logits(expected, expected, "float16", actual).ok  # the framework's own overflows: no judgement


def test_float32_keeps_its_max_rule_and_float16_needs_the_baseline():
    expected = EXPECTED
    assert compare_logits(expected + 1e-4, expected, "float32").ok
    check = compare_logits(expected + 5e-4, expected, "float32")
    assert not check.ok and check.tolerance == pytest.approx(1e-4 * np.abs(expected).max())
    with pytest.raises(GdnExportError, match="reference's own float16 logits"):
        compare_logits(expected, expected, "float16")
    with pytest.raises(GdnExportError, match="different shapes"):
        compare_logits(expected[:, :3], expected, "float32")


def test_the_report_has_kl_and_top1_figures():
    expected, baseline, actual = EXPECTED, rounded(seed=1), rounded(seed=2)
    check = compare_logits(actual, expected, "float16", baseline)
    assert 0 < check.mean_kl < 1e-3 and 0 < check.baseline_mean_kl < 1e-3
    assert 0.9 <= check.top1_all <= 1 and 0.9 <= check.baseline_top1_all <= 1
    text = str(check)
    for words in ("typical |logit error|", "reference's own float16", "ratio", "mean KL", "top-1 agreement"):
        assert words in text, text
    assert "mean KL" in str(compare_logits(expected, expected, "float32"))


# --- the rule on the fixtures ----------------------------------------------------------------------------------
# (every fixture's correct float16 export passing at batch 1 and 2: test_hf_families.py, the float16 cases of
# test_prefill_and_decode_match_transformers)

def perturb_weight(src: Path, dst: Path, member: str, relative: float, seed: int = 0) -> None:
    """Copy the archive, multiplying each float16 weight of ``member`` by (1 + relative x N(0, 1))."""
    with tarfile.open(src) as tar:
        members = [(m, tar.extractfile(m).read() if m.isfile() else None) for m in tar.getmembers()]
    assert member in [m.name for m, _ in members], f"{member} not in {src.name}"
    with tarfile.open(dst, "w:gz") as out:
        for info, data in members:
            if info.name == member:
                header = np.frombuffer(data[:DAT_HEADER], "<u4")
                assert data[:2] == b"\x4e\xef" and header[11] == 16 and header[12] == 0, "not a float16 tensor"
                weights = np.frombuffer(data[DAT_HEADER:], np.float16).astype(np.float32)
                noise = np.random.default_rng(seed).standard_normal(weights.shape)
                data = data[:DAT_HEADER] + (weights * (1 + relative * noise)).astype(np.float16).tobytes()
                assert len(data) == info.size
            out.addfile(info, io.BytesIO(data) if data is not None else None)
    resealed(dst)  # weights a conversion could have written, not a damaged archive


# one MLP matrix of layer 0, each weight off by 1% (f16 rounds to 0.03%): the logits move ~4-5x the framework's f16
CORRUPTED = {name: "hf.model.layers.0.mlp.up_proj.weight.dat" for name in ("qwen3_5", "fla_kda")}


@pytest.mark.parametrize("name", by_fixture(*sorted(CORRUPTED)))
def test_a_slightly_wrong_float16_export_fails(name, converted, reference_model, tmp_path, capsys):
    bad = tmp_path / f"{name}-wrong.nnef.tgz"
    perturb_weight(converted(name, "float16"), bad, CORRUPTED[name], 0.01)
    for batch in (1, 2):
        check = check_against_transformers(bad, reference_model(name), batch=batch, seed=batch,
                                           half_model=reference_model(name, "float16"))
        assert not check.ok and check.ratio > 1.5 * F16_MULTIPLE, f"{name} batch {batch}: {check}"
    assert cli(["check", str(bad), str(FIXTURES / name)]) == 1  # `gdn-export check`: the same rule
    assert "does not match" in capsys.readouterr().err


@pytest.mark.xdist_group("qwen3_5")
def test_check_command_on_a_float16_export(converted, capsys):
    path = converted("qwen3_5", "float16")
    assert cli(["check", str(path), str(FIXTURES / "qwen3_5"), "--batch", "2"]) == 0
    text = capsys.readouterr().out
    assert "reference's own float16" in text and "mean KL" in text and "top-1 agreement" in text
