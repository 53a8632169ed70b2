"""`gdn-export check` of quantized archives: the weights quantized again from the checkpoint by the rule the archive
records, checked as `convert` checked them (a damaged weight file fails), calibrated archives given their text."""

import tarfile
from pathlib import Path

import pytest

from gdn_export.errors import GdnExportError
from gdn_export.pipeline.convert import check, convert
from helpers import FIXTURES, damaged, rewritten

pytestmark = pytest.mark.slow  # converts fixtures

# a .dat header's item type (bytes 48-51): tract's Q4_0 is 0x4030 from vendor "RT"
Q40_ITEM_TYPE = bytes.fromhex("4030") + b"RT"


def test_q4_0_archive_is_checked_with_its_own_rule_and_a_damaged_weight_fails(tmp_path):
    out = tmp_path / "q.nnef.tgz"
    convert(FIXTURES / "qwen3_5", out, quantize="q4_0", quantize_embeddings=True, check=False)
    result = check(out, FIXTURES / "qwen3_5")
    assert result.ok, result
    assert result.quality is not None and result.quality.mean_kl > 0  # Q4_0 against the published float weights
    assert result.mtp is not None and result.mtp.ok, result.mtp  # its MTP head, quantized again as convert did
    with tarfile.open(out) as tar:
        q4 = sorted(m.name for m in tar.getmembers() if m.name.endswith(".dat")
                    and tar.extractfile(m).read(128)[48:52] == Q40_ITEM_TYPE)
    assert "hf.model.embed_tokens.weight.dat" in q4  # quantize_embeddings is re-applied, not assumed
    head = next(name for name in q4 if "lm_head" in name)
    broken = check(damaged(out, tmp_path / "broken.nnef.tgz", head), FIXTURES / "qwen3_5")
    assert not broken.ok, broken


def test_int8_archive_is_checked_with_the_same_rounding(tmp_path):
    out = tmp_path / "i8.nnef.tgz"
    convert(FIXTURES / "qwen3_5_vl", out, quantize="int8", int8_passes=2, check=False)
    result = check(out, FIXTURES / "qwen3_5_vl")
    assert result.ok, result
    assert result.quality is not None


def test_calibrated_archive_needs_its_text(tmp_path, capsys):
    text = tmp_path / "calibration.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 400, encoding="utf-8")
    other = tmp_path / "other.txt"
    other.write_text("Pack my box with five dozen liquor jugs. " * 400, encoding="utf-8")
    out = tmp_path / "c.nnef.tgz"
    convert(FIXTURES / "qwen3_5", out, quantize="q4_0", calibration=text, calibration_tokens=1000, check=False)
    with pytest.raises(GdnExportError, match=r"calibrated on calibration\.txt .*calibration=FILE"):
        check(out, FIXTURES / "qwen3_5")
    from gdn_export.cli import main as cli

    assert cli(["check", str(out), str(FIXTURES / "qwen3_5")]) == 1  # the command line's wording, one line
    err = capsys.readouterr().err.strip().splitlines()
    assert "pass --calibration FILE with that text" in err[-1] and len([e for e in err if "error" in e]) == 1, err
    with pytest.raises(GdnExportError, match="is not the text"):
        check(out, FIXTURES / "qwen3_5", calibration=other)
    result = check(out, FIXTURES / "qwen3_5", calibration=text)
    assert result.ok, result
    # the record comes from the archive: a malformed one is refused before any text is read with it
    bad = rewritten(out, tmp_path / "bad.nnef.tgz",
                    metadata={"calibration": {"file": "calibration.txt", "sha256": "0", "tokens": 10 ** 12}})
    with pytest.raises(GdnExportError, match="malformed calibration record"):
        check(bad, FIXTURES / "qwen3_5", calibration=text)
