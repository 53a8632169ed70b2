"""Every Hugging Face family: the CLI converts its fixture, and tract's logits match transformers' eager model."""

import json
import re
import tarfile

import numpy as np
import pytest

import gdn_export
from helpers import CHECKPOINTS as ALL_CHECKPOINTS
from helpers import FIXTURES, by_fixture
from gdn_export.hf.check import check_against_transformers, session_logits, sample_tokens
from gdn_export.hf.families import all_families
from gdn_export.run.session import Session

SUPPORTED = {t for f in all_families() for t in f.model_types}
# the fixtures of a family's own model_type (not the published wrappers, qwen3_5_vl and qwen3_5_moe_vl)
CHECKPOINTS = [name for name in ALL_CHECKPOINTS
               if json.loads((FIXTURES / name / "config.json").read_text())["model_type"] in SUPPORTED]


@pytest.mark.parametrize("name", by_fixture(*CHECKPOINTS))
@pytest.mark.parametrize("dtype,batch", [("float32", 1), ("float32", 2), ("float16", 1), ("float16", 2)])
def test_prefill_and_decode_match_transformers(name, dtype, batch, shared_session, reference_model):
    """The rule of `gdn-export check` and `convert` (hf/check.py): float32 within 1e-4 x max(1, max |logit|);
    float16 no worse than twice transformers' own float16 model on the same tokens."""
    half_model = reference_model(name, dtype) if dtype != "float32" else None
    check = check_against_transformers(shared_session(name, dtype, batch), reference_model(name), batch=batch,
                                       seed=batch, half_model=half_model)
    assert check.ok, f"{name} {dtype} batch {batch}: {check}"
    assert check.positions == batch * 24
    if dtype == "float32":
        assert check.max_abs_error <= 1e-4 * max(1.0, check.max_abs_logit)
    else:
        assert check.error <= 2 * check.baseline_error + 2 ** -11 * max(1.0, check.max_abs_logit)
        assert check.top1_agreement == 1.0


@pytest.mark.parametrize("name", by_fixture(*CHECKPOINTS))
def test_prefill_then_decode_equals_one_prefill(name, shared_session):
    session = shared_session(name, "float32", 2)
    tokens = sample_tokens(session.metadata["vocab_size"], 2, 24, seed=3)
    stepwise = session_logits(session, tokens, 16)
    session.reset()
    whole = session.prefill(tokens)
    assert np.abs(stepwise - whole).max() <= 1e-4 * max(1.0, np.abs(whole).max())


@pytest.mark.parametrize("name", by_fixture("qwen3_5", "kimi_linear"))
def test_prefill_in_pieces_and_replanning_for_another_batch(name, converted):
    """A prompt fed in pieces of 5 tokens (the states carried between calls) gives the logits of one call; after a
    reset to batch 1 (the model planned again for it), the first sequence's logits are those it had in batch 2."""
    path = converted(name, "float32")
    tokens = sample_tokens(Session(path).metadata["vocab_size"], 2, 37, seed=4)
    whole = Session(path, prefill_piece=None).prefill(tokens)
    pieces = Session(path, prefill_piece=5)
    in_pieces = pieces.prefill(tokens)
    tolerance = 1e-4 * max(1.0, np.abs(whole).max())
    assert in_pieces.shape == whole.shape and np.abs(in_pieces - whole).max() <= tolerance
    pieces.reset()
    alone = pieces.prefill(tokens[:1])
    assert alone.shape[0] == 1 and np.abs(alone - whole[:1]).max() <= tolerance


@pytest.mark.xdist_group("qwen3_5")
def test_session_refuses_a_bad_prefill_piece(converted):
    with pytest.raises(gdn_export.GdnExportError, match="prefill_piece must be a positive number of tokens or None, "
                                                        "got 0"):
        Session(converted("qwen3_5", "float32"), prefill_piece=0)


def test_steady_allocator_applies_on_glibc():
    import platform

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("mallopt is glibc's")
    assert gdn_export.run.runtime.steady_allocator() is True


@pytest.mark.parametrize("name", by_fixture(*CHECKPOINTS))
def test_state_names_are_stable(name, converted, shared_session):
    import tract

    model = tract.nnef().with_tract_transformers().load(str(converted(name, "float32")))
    metadata = shared_session(name, "float32", 1).metadata
    inputs = [model.input_name(i) for i in range(model.input_count())]
    outputs = [model.output_name(i) for i in range(model.output_count())]
    assert inputs == metadata["inputs"] and inputs[0] == "input_ids"
    assert outputs == metadata["outputs"] and outputs[0] == "logits"
    assert all(o == "out_" + i.removeprefix("in_") for i, o in zip(inputs[1:], outputs[1:]))


@pytest.mark.xdist_group("qwen3_5")
def test_each_constant_is_written_once(converted):
    """tract's NNEF reader compares every constant it reads with every node read before it (issue 36): the export
    writes each distinct constant once (backends/nnef/shared_constants.py), and every layer reads that one; the
    chunked lowering's masks, one per GDN layer before, are then one per chunk size (a 64-token and a tail chunk)."""
    with tarfile.open(converted("qwen3_5", "float32")) as tar:
        graph = tar.extractfile("graph.nnef").read().decode()
        constants = {label: tar.extractfile(f"{label}.dat").read() for name, label in re.findall(
            r"^\s*(\w+)\s*=\s*variable<scalar>\(label\s*=\s*'([^']+)'", graph, re.M) if name == label}
    assert len(set(constants.values())) == len(constants)
    layers = json.loads((FIXTURES / "qwen3_5" / "config.json").read_text())["layer_types"].count("linear_attention")
    assert layers > 1 and len([label for label in constants if label.endswith("_causal_log")]) == 2
