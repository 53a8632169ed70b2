"""The trained fixture's MTP head (fixtures/qwen3_5_trained, ``mtp.*``, made by fixtures/train_mtp_head.py): it reads
through the normal Hugging Face path (``gdn_export.hf.mtp.read_mtp_head``) and predicts held-out text better than a
trivial predictor, by a margin set by the number of positions compared.

The base model is transformers' float32 model, computed here. The head's task (what its drafts are checked
against): the base's greedy token t+2, from the base's hidden state at t (after ``model.norm``) and the text's token
t+1. The trivial predictor: the token that most often follows token t+1 in the held-out text itself (counted over
the very windows scored, which favours it). The comparison is paired (McNemar): of the positions where exactly one
of the two is right, the head must win more often than chance allows at 4 standard deviations, ``b - c > 4 sqrt(b +
c)`` (under equal accuracy ``b - c`` has mean 0 and variance ``b + c``).

Through tract (the f32 archive ``convert`` makes of the fixture, its MTP head included): ``--speculative mtp`` keeps
some of the trained head's drafts and rejects others, and the greedy tokens are plain decoding's.
"""

from __future__ import annotations

import json
import math
import sys

import numpy as np
import pytest
import torch

from gdn_export.hf.mtp import read_mtp_head
from helpers import FIXTURES, TRAINED

FOLDER = FIXTURES / TRAINED
WINDOWS, LENGTH = 8, 256  # held-out windows of 256 tokens: 8 x 254 positions scored
SIGMAS = 4.0

pytestmark = pytest.mark.skipif(not (FOLDER / "config.json").is_file(), reason="no fixtures/qwen3_5_trained")


@pytest.fixture(scope="module")
def base_model():
    sys.modules.setdefault("fla", None)  # transformers' torch gated delta rule (FLA's kernels need a GPU)
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(FOLDER, dtype=torch.float32).eval()


def most_frequent_successor(ids: np.ndarray, vocab: int) -> torch.Tensor:
    """For each token id, the id that most often follows it in ``ids`` (itself where none follows)."""
    counts: dict[int, dict[int, int]] = {}
    for prev, succ in zip(ids[:-1].tolist(), ids[1:].tolist()):
        row = counts.setdefault(prev, {})
        row[succ] = row.get(succ, 0) + 1
    best = torch.arange(vocab)
    for prev, row in counts.items():
        best[prev] = max(row.items(), key=lambda item: (item[1], -item[0]))[0]
    return best


def test_trained_head_reads_through_the_hf_path(base_model):
    config = json.loads((FOLDER / "config.json").read_text())
    assert config["mtp_num_hidden_layers"] == 1
    head = read_mtp_head(FOLDER)
    assert head is not None and head.config.hidden_size == config["hidden_size"]
    # the head shares the base's embedding and (untied) head, as transformers loads them
    assert torch.equal(head.embed_tokens.weight, base_model.model.embed_tokens.weight)
    assert torch.equal(head.lm_head.weight, base_model.lm_head.weight)


def test_trained_head_beats_the_bigram_predictor_on_held_out_text(base_model):
    from tokenizers import Tokenizer

    head = read_mtp_head(FOLDER)
    tok = Tokenizer.from_file(str(FOLDER / "tokenizer.json"))
    ids = np.asarray(tok.encode((FOLDER / "heldout.txt").read_text(encoding="utf-8")).ids)
    starts = np.linspace(0, ids.size - LENGTH, WINDOWS).astype(np.int64)
    windows = torch.as_tensor(np.stack([ids[s:s + LENGTH] for s in starts]))
    with torch.no_grad():
        hidden = base_model.model(input_ids=windows).last_hidden_state  # after model.norm
        greedy = base_model.lm_head(hidden).argmax(-1)  # [B, L]: the base's token t+1
        key, value = head.empty_cache(WINDOWS)
        drafted = head(hidden[:, :-2], windows[:, 1:-1], key, value)[0].argmax(-1)  # position t: token t+2
    target = greedy[:, 1:-1]
    trivial = most_frequent_successor(ids, base_model.config.vocab_size)[windows[:, 1:-1]]
    head_right, trivial_right = drafted == target, trivial == target
    b = int((head_right & ~trivial_right).sum())
    c = int((trivial_right & ~head_right).sum())
    n = target.numel()
    assert b - c > SIGMAS * math.sqrt(b + c), (
        f"MTP {int(head_right.sum())}/{n} right, most frequent successor {int(trivial_right.sum())}/{n}: "
        f"b={b}, c={c}")


def test_trained_head_drafts_are_kept_and_greedy_output_is_plain(converted):
    """``--speculative mtp`` with the trained head on a held-out prompt: the greedy tokens of plain decoding, token
    for token, while drafts are kept (the random heads of the other fixtures almost never have one kept, so this is
    where the accept path runs on real acceptance)."""
    from gdn_export.run.generation import SpeculativeConfig, generate
    from gdn_export.run.session import Session

    session = Session(converted(TRAINED))
    prompt = session.tokenizer.encode((FOLDER / "heldout.txt").read_text(encoding="utf-8")[:1200]).ids[:200]
    plain = [t.token_id for t in generate(session, prompt, 48, temperature=0, stop_token_ids=[],
                                          speculative=None)]
    for draft_max in (1, 3):
        tokens = generate(session, prompt, 48, temperature=0, stop_token_ids=[],
                          speculative=SpeculativeConfig("mtp", draft_max))
        assert [t.token_id for t in tokens] == plain, draft_max
        assert 0 < tokens.generation.accepted < tokens.generation.drafted, draft_max
