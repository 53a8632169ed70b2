"""A streamed conversion with every weight matrix traced as a placeholder writes the in-memory archive
(tests/test_checkpoints.py covers real checkpoints: layouts, bad input, the checks, the tokenizer)."""

import pytest

from gdn_export.pipeline.convert import convert
from helpers import FIXTURES, archive_members

pytestmark = pytest.mark.slow  # every test converts a checkpoint


@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_5_vl", "lara_mini"])
def test_placeholder_matrices_stream_the_same_archive(tmp_path, monkeypatch, name):
    """The fixtures' weights are all under the 1 MiB above which real checkpoints trace placeholders: with the
    threshold at 4 KiB every matrix is one (Qwen3-Next's re-laid projections included, a tied table too), and the
    archive must still be the in-memory one."""
    import gdn_export.weights.streamed

    convert(FIXTURES / name, tmp_path / "m.nnef.tgz", check=False, streamed=False)
    monkeypatch.setattr(gdn_export.weights.streamed, "REAL_BYTES", 4096)
    convert(FIXTURES / name, tmp_path / "s.nnef.tgz", check=False)
    a, b = archive_members(tmp_path / "s.nnef.tgz"), archive_members(tmp_path / "m.nnef.tgz")
    assert sorted(a) == sorted(b) and [k for k in a if a[k] != b[k]] == []
