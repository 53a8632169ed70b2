"""A streamed conversion with every weight matrix traced as a placeholder writes the in-memory archive
(tests/test_checkpoints.py covers real checkpoints: layouts, bad input, the checks, the tokenizer)."""

import re
import tarfile
from pathlib import Path

import pytest

from gdn_export.pipeline.convert import convert

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def members(path: Path) -> dict[str, bytes]:
    with tarfile.open(path) as tar:
        out = {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}
    out["graph.nnef"] = re.sub(rb'\("export_date".*', b"", out["graph.nnef"])
    return out


@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_5_vl", "lara_mini"])
def test_placeholder_matrices_stream_the_same_archive(tmp_path, monkeypatch, name):
    """The fixtures' weights are all under the 1 MiB above which real checkpoints trace placeholders: with the
    threshold at 4 KiB every matrix is one (Qwen3-Next's re-laid projections included, a tied table too), and the
    archive must still be the in-memory one."""
    import gdn_export.weights.streamed

    convert(FIXTURES / name, tmp_path / "m.nnef.tgz", check=False, streamed=False)
    monkeypatch.setattr(gdn_export.weights.streamed, "REAL_BYTES", 4096)
    convert(FIXTURES / name, tmp_path / "s.nnef.tgz", check=False)
    a, b = members(tmp_path / "s.nnef.tgz"), members(tmp_path / "m.nnef.tgz")
    assert sorted(a) == sorted(b) and [k for k in a if a[k] != b[k]] == []
