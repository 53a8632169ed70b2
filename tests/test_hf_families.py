"""Every Hugging Face family: the CLI converts its fixture, and tract's logits match transformers' eager model."""

import json
from pathlib import Path

import numpy as np
import pytest

import gdn_export

from gdn_export.cli import main as cli
from gdn_export.hf.check import compare_logits, session_logits, sample_tokens, transformers_logits
from gdn_export.hf.checkpoint import load_model, read_config
from gdn_export.hf.families import all_families, family_for
from gdn_export.session import Session

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
SUPPORTED = {t for f in all_families() for t in f.model_types}
CHECKPOINTS = sorted(
    p.name for p in FIXTURES.iterdir()
    if (p / "config.json").is_file() and json.loads((p / "config.json").read_text())["model_type"] in SUPPORTED
)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """CLI conversions, once per (fixture, dtype)."""
    cache = {}

    def get(name, dtype):
        if (name, dtype) not in cache:
            out = tmp_path_factory.mktemp(name) / f"{name}-{dtype}.nnef.tgz"
            assert cli(["convert", str(FIXTURES / name), "-o", str(out), "--dtype", dtype, "--no-check"]) == 0
            cache[name, dtype] = out
        return cache[name, dtype]

    return get


def reference_model(name):
    config = read_config(FIXTURES / name)
    return load_model(FIXTURES / name, family_for(config["model_type"]), config)


@pytest.mark.parametrize("name", CHECKPOINTS)
@pytest.mark.parametrize("dtype,batch", [("float32", 1), ("float32", 2), ("float16", 1), ("float16", 2)])
def test_prefill_and_decode_match_transformers(name, dtype, batch, converted):
    hf_model = reference_model(name)
    tokens = sample_tokens(hf_model.config.vocab_size, batch, 16 + 8, seed=batch)
    expected = transformers_logits(hf_model, tokens, 16)
    actual = session_logits(Session(converted(name, dtype)), tokens, 16)
    check = compare_logits(actual, expected, dtype)
    assert check.ok, f"{name} {dtype} batch {batch}: {check}"
    if dtype == "float32":
        assert check.max_abs_error <= 1e-4 * max(1.0, check.max_abs_logit)
    else:
        assert check.top1_agreement == 1.0 and check.max_abs_error <= 5e-2 * max(1.0, check.max_abs_logit)
        assert check.ambiguous <= expected[..., 0].size // 2, "too few decisive positions to judge top-1"


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_prefill_then_decode_equals_one_prefill(name, converted):
    session = Session(converted(name, "float32"))
    tokens = sample_tokens(session.metadata["vocab_size"], 2, 24, seed=3)
    stepwise = session_logits(session, tokens, 16)
    session.reset()
    whole = session.prefill(tokens)
    assert np.abs(stepwise - whole).max() <= 1e-4 * max(1.0, np.abs(whole).max())


@pytest.mark.parametrize("name", ["qwen3_5", "kimi_linear"])
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


def test_session_refuses_a_bad_prefill_piece(converted):
    with pytest.raises(gdn_export.GdnExportError, match="prefill_piece must be a positive number of tokens or None, "
                                                        "got 0"):
        Session(converted("qwen3_5", "float32"), prefill_piece=0)


def test_steady_allocator_applies_on_glibc():
    import platform

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("mallopt is glibc's")
    assert gdn_export.runtime.steady_allocator() is True


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_state_names_are_stable(name, converted):
    import tract

    model = tract.nnef().with_tract_transformers().load(str(converted(name, "float32")))
    metadata = Session(converted(name, "float32")).metadata
    inputs = [model.input_name(i) for i in range(model.input_count())]
    outputs = [model.output_name(i) for i in range(model.output_count())]
    assert inputs == metadata["inputs"] and inputs[0] == "input_ids"
    assert outputs == metadata["outputs"] and outputs[0] == "logits"
    assert all(o == "out_" + i.removeprefix("in_") for i, o in zip(inputs[1:], outputs[1:]))
