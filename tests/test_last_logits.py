"""``convert(..., logits="last")``: the graph returns the last position's logits only, against transformers."""

import json
import tarfile

import numpy as np
import pytest

from gdn_export.errors import GdnExportError
from gdn_export.hf.check import sample_tokens
from gdn_export.pipeline.convert import convert
from gdn_export.run.session import Session

from helpers import FIXTURES, by_fixture


@pytest.mark.parametrize("name", by_fixture("qwen3_5", "fla_gated_deltanet"))
def test_last_position_logits_match_transformers(name, tmp_path, reference_model):
    out = tmp_path / "last.nnef.tgz"
    report = convert(FIXTURES / name, out, logits="last")
    assert report.check.ok, report.check  # prefill's last position and every decode step, against transformers
    assert json.loads(tarfile.open(out).extractfile("gdn_export.json").read())["logits"] == "last"
    model = reference_model(name)
    vocab = model.config.vocab_size
    tokens = sample_tokens(vocab, 2, 13, seed=3)
    import torch

    with torch.no_grad():
        expected = model(input_ids=torch.from_numpy(tokens)).logits[:, -1:].numpy()
    whole = Session(out, prefill_piece=None)
    pieces = Session.sharing_plan(whole, batch=2)  # tract's plan for batch 2 made once, states of its own
    pieces.prefill_piece = 5  # three calls: the last one's logits are the prompt's
    whole, pieces = whole.prefill(tokens), pieces.prefill(tokens)
    assert whole.shape == pieces.shape == (2, 1, vocab)
    tolerance = 1e-4 * max(1.0, float(np.abs(expected).max()))
    assert np.abs(whole - expected).max() <= tolerance
    assert np.abs(pieces - expected).max() <= tolerance


def test_unknown_logits_choice_is_refused(tmp_path):
    with pytest.raises(GdnExportError, match="logits 'first' is not one of all, last"):
        convert(FIXTURES / "qwen3_5", tmp_path / "x.nnef.tgz", logits="first")
    assert list(tmp_path.iterdir()) == []


def test_last_position_is_sliced_with_a_length_tract_knows(tmp_path, converted):
    """The decoder's last position is a gather at ``S - 1`` (``gdn_export_last_step``), not torch-to-nnef's clamped
    ``dyn_slice_begin``, which tract's optimizer pushes up through the model (seconds of every load:
    benchmarks/RESULTS.md); its logits are the every-position archive's last row at S = 1 (where the old clamp chose
    0), at a whole chunk and one past it."""
    last = tmp_path / "last.nnef.tgz"
    convert(FIXTURES / "qwen3_5", last, logits="last", check=False)
    graph = tarfile.open(last).extractfile("graph.nnef").read().decode()
    assert "= gdn_export_last_step(" in graph and "begin = -1" not in graph
    vocab = json.loads(tarfile.open(last).extractfile("gdn_export.json").read())["vocab_size"]
    # the every-position archive: the CLI's default conversion (conftest's); each archive planned once for batch 2
    sliced, every = Session(last, prefill_piece=None), Session(converted("qwen3_5"), prefill_piece=None)
    for length in (1, 64, 65):
        tokens = sample_tokens(vocab, 2, length, seed=length)
        sliced.reset()
        every.reset()
        got = sliced.prefill(tokens)
        expected = every.prefill(tokens)[:, -1:]
        assert got.shape == expected.shape == (2, 1, vocab)
        # the same float32 graph but for the head over 1 row or S rows (another matmul blocking): rounding only
        assert np.abs(got - expected).max() <= 1e-5 * max(1.0, float(np.abs(expected).max())), length
