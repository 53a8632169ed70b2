"""Speculative decoding (gdn_export/run/generation/speculative.py): prompt-lookup drafts, the speculative-sampling
rule, ``Session.verify``/``commit`` rolling back recurrent states and caches exactly, and greedy output identical to
plain decoding through real tract on every fixture family; sampled output tested against the distribution plain
decoding draws from (chi-square tests, alpha fixed in advance)."""

import numpy as np
import pytest
import torch

from helpers import FAMILIES, FIXTURES, TRAINED, by_fixture, rewritten

from gdn_export.errors import GdnExportError
from gdn_export.run.generation import Sampler, SamplingParams, SpeculativeConfig, SpeculativeError, generate
from gdn_export.run.generation.sampling import filtered_probabilities
from gdn_export.run.generation.speculative import MAX_DRAFT, MAX_MTP_DRAFT, propose_ngram

ALPHA = 1e-4  # the chance that a correct sampler fails a chi-square test below (each test's draws are seeded)
# seeded requests per sampled-distribution test through tract: outcomes expected fewer than 5 times are pooled, so the
# test stays valid at any count; 400 keeps the suite's time (1200 took 150 s with a draft archive, 600 86 s for two
# drafters) for a test whose power against a wrong rule is the rule-alone tests'
# (test_the_verify_rule_draws_what_plain_sampling_draws, 20,000 draws)
SAMPLED_REQUESTS = 400


def chi_square_p_value(counts: np.ndarray, probabilities: np.ndarray) -> float:
    """Pearson's chi-square test of ``counts`` against ``probabilities``, categories expected fewer than 5 times
    pooled into one (the rule of thumb under which the chi-square approximation holds); the upper-tail p-value."""
    counts, expected = np.asarray(counts, np.float64), np.asarray(probabilities, np.float64) * np.sum(counts)
    small = expected < 5
    if small.any():
        counts = np.append(counts[~small], counts[small].sum())
        expected = np.append(expected[~small], expected[small].sum())
    keep = expected > 0
    assert not (counts[~keep] > 0).any(), "a token drawn that has probability 0"
    statistic = float((((counts - expected) ** 2)[keep] / expected[keep]).sum())
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


def test_default_drafting_is_the_first_the_archive_can_run():
    """An archive without an MTP head falls back to the next method (never an error); none for one that returns the
    last position's logits only; the settings are SpeculativeConfig's defaults."""
    from gdn_export.run.generation.speculative import DEFAULT_METHODS, default_speculative

    assert default_speculative(True, False, ("mtp", "ngram")) == SpeculativeConfig("ngram")
    assert default_speculative(True, True, ("mtp", "ngram")) == SpeculativeConfig("mtp")
    assert default_speculative(True, False, ("mtp",)) is None
    assert default_speculative(False, True, ("mtp", "ngram")) is None
    assert default_speculative(True, False) == SpeculativeConfig(DEFAULT_METHODS[0])


def test_prompt_lookup_takes_the_longest_latest_match():
    history = [1, 2, 3, 9, 9, 2, 3, 4, 5, 1, 2, 3]
    assert propose_ngram(history, 3, longest=3) == [9, 9, 2]  # "1 2 3" occurred at 0: what followed it
    assert propose_ngram(history, 2, longest=2) == [4, 5]  # "2 3": the latest earlier occurrence (at 5)
    assert propose_ngram([5, 6, 7], 4, longest=3) == []  # nothing repeats
    assert propose_ngram([7, 7, 7, 7], 4, longest=2) == [7]  # the match runs into the suffix: what exists
    assert propose_ngram(history, 0, longest=3) == []
    assert propose_ngram([4, 1, 4], 2, longest=3, shortest=2) == []  # only 1-grams repeat


@pytest.mark.parametrize("bad, param", [(dict(method="medusa"), "method"), (dict(num_speculative_tokens=0),
                                        "num_speculative_tokens"), (dict(num_speculative_tokens=True),
                                        "num_speculative_tokens"), (dict(prompt_lookup_max=0), "prompt_lookup_max"),
                                        (dict(prompt_lookup_min=4, prompt_lookup_max=3), "prompt_lookup_min"),
                                        (dict(method="draft"), "model"), (dict(model="x.nnef.tgz"), "model"),
                                        (dict(method="mtp", num_speculative_tokens=MAX_MTP_DRAFT + 1),
                                         "num_speculative_tokens")])
def test_bad_options_name_themselves(bad, param):
    with pytest.raises(SpeculativeError) as err:
        SpeculativeConfig(**bad)
    assert err.value.param == param and param in str(err.value) and "\n" not in str(err.value)
    # an MTP head's drafts are capped lower than prompt lookup's (MAX_MTP_DRAFT: each is a chained head call)
    assert SpeculativeConfig("mtp", MAX_MTP_DRAFT).num_speculative_tokens == MAX_MTP_DRAFT < MAX_DRAFT
    assert SpeculativeConfig("ngram", MAX_DRAFT).num_speculative_tokens == MAX_DRAFT


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.7), SamplingParams(temperature=1.0, top_k=5),
                                    SamplingParams(temperature=1.3, top_p=0.8)], ids=["t0.7", "topk5", "topp0.8"])
@pytest.mark.parametrize("drafter", ["certain", "likely", "unlikely", "distribution"])
def test_the_verify_rule_draws_what_plain_sampling_draws(params, drafter):
    """The token at a drafted position is distributed as ``Sampler`` draws it, whatever the draft: one proposed
    with certainty (prompt lookup), a probable or an improbable one, or one drawn from another distribution q."""
    rng = np.random.default_rng(1)
    logits = rng.normal(0, 2, 12)
    p = filtered_probabilities(logits, params)
    q = None
    if drafter == "distribution":
        q = filtered_probabilities(logits + rng.normal(0, 1.5, 12), SamplingParams(temperature=1.0))
    sampler, draws = Sampler(SamplingParams(**{**params.__dict__, "seed": 3})), 20000
    counts = np.zeros(12)
    for _ in range(draws):
        draft = (int(np.argmax(p)) if drafter in ("certain", "likely") else int(np.argmin(p + (p == 0)))
                 if drafter == "unlikely" else int(sampler.rng.choice(12, p=q)))
        counts[sampler.verify(logits, draft, q).token_id] += 1
    assert chi_square_p_value(counts, p) > ALPHA


def test_greedy_verify_keeps_the_argmax():
    logits = np.array([0.0, 3.0, 1.0])
    sampler = Sampler(SamplingParams(temperature=0.0))
    assert sampler.verify(logits, 1).token_id == 1 and sampler.verify(logits, 2).token_id == 1


# --- through real tract ----------------------------------------------------------------------------------------

def context(vocab: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, (1, 70))  # past 64: the chunked path and its tail


@pytest.mark.parametrize("name", by_fixture(*FAMILIES))
def test_commit_keeps_exactly_the_prefix(name, converted):
    """After ``verify`` of k tokens and ``commit(j)``, the states are bitwise those of a session that ran the j tokens
    alone (recurrent states, short-conv windows, attention caches cut by length), and the next call's logits are
    bitwise those of a session that ran the kept tokens with it."""
    from gdn_export.run.session import Session

    path = converted(name)
    session, alone = Session(path), Session(path)
    ids = context(session.metadata["vocab_size"])
    prompt, verified, after = ids[:, :60], ids[:, 60:65], ids[:, 65:67]
    for kept in (0, 2, 5):
        for s in (session, alone):
            s.reset()
            s.prefill(prompt)
        logits = session.verify(verified)
        assert logits.shape[1] == 5
        session.commit(kept, recompute=True)
        if kept:
            alone.prefill(verified[:, :kept])
        assert session.position == alone.position == 60 + kept
        for mine, theirs in zip(session.states, alone.states):
            assert np.array_equal(mine, theirs)
        # the pending form: the kept tokens run with the next call
        session.reset()
        session.prefill(prompt)
        session.verify(verified)
        session.commit(kept)
        assert session.pending == (kept if kept < 5 else 0) and session.position == 60 + kept
        alone.reset()
        alone.prefill(prompt)
        if kept == 5:  # all kept: the verify call's states, then the next call on its own
            alone.prefill(verified)
            expected = alone.prefill(after)
        else:
            expected = alone.prefill(np.concatenate([verified[:, :kept], after], axis=1))[:, kept:]
        assert np.array_equal(session.prefill(after), expected)


def test_verify_needs_every_position(converted, tmp_path):
    from gdn_export.run.session import Session

    last = rewritten(converted("qwen3_5"), tmp_path / "last.nnef.tgz", {"logits": "last"})
    session = Session(last)
    session.prefill(np.asarray([[1, 2, 3]]))
    with pytest.raises(GdnExportError, match="every position"):
        session.verify(np.asarray([[1, 2]]))
    with pytest.raises(GdnExportError, match="every position"):
        list(generate(session, [1, 2, 3], 4, speculative=SpeculativeConfig()))
    # the default drafting needs every position's logits: such an archive decodes plainly by default
    assert len(list(generate(session, [1, 2, 3], 4))) == 4
    fresh = Session(converted("qwen3_5"))
    with pytest.raises(GdnExportError, match="commit needs a verify"):
        fresh.commit(0)


def repetitive_prompt(vocab: int, seed: int) -> list[int]:
    """Random tokens with a stretch repeated: prompt lookup finds drafts, some right, some wrong (the random-weight
    fixtures rarely repeat two tokens in a row: the tests look up one-token matches too, to draft often)."""
    rng = np.random.default_rng(seed)
    stretch = rng.integers(0, vocab, 12).tolist()
    return rng.integers(0, vocab, 9).tolist() + stretch + rng.integers(0, vocab, 5).tolist() + stretch[:4]


@pytest.mark.parametrize("name", by_fixture(*FAMILIES, TRAINED))
def test_greedy_output_is_token_identical(name, converted):
    """Prompt lookup on prompts that repeat a stretch (drafts mostly rejected by the random-weight models: steps that
    go back and rerun their kept tokens), then the archive drafting for itself (drafts kept): the greedy tokens of
    plain decoding, token for token."""
    from gdn_export.run.session import Session

    session = Session(converted(name))
    vocab = session.metadata["vocab_size"]
    drafted = 0
    for seed, draft_max in ((0, 4), (1, 2), (2, 7)):
        prompt = repetitive_prompt(vocab, seed)
        plain = [t.token_id for t in generate(session, prompt, 40, temperature=0, stop_token_ids=[],
                                              speculative=None)]
        tokens = generate(session, prompt, 40, temperature=0, stop_token_ids=[],
                          speculative=SpeculativeConfig(num_speculative_tokens=draft_max, prompt_lookup_min=1))
        assert [t.token_id for t in tokens] == plain, (seed, draft_max)
        drafted += tokens.generation.drafted
        assert 0 <= tokens.generation.accepted <= tokens.generation.drafted
    assert drafted > 0  # the prompts made drafts: the verify path ran
    default = generate(session, prompt, 40, temperature=0, stop_token_ids=[])  # the default: prompt lookup
    assert default.generation.request.speculative == SpeculativeConfig()
    assert [t.token_id for t in default] == plain
    # the archive drafting for itself: its drafts are kept, so steps that keep every draft (and their bonus token) run
    tokens = generate(session, prompt, 40, temperature=0, stop_token_ids=[],
                      speculative=SpeculativeConfig("draft", 3, model=str(converted(name))))
    assert [t.token_id for t in tokens] == plain
    assert tokens.generation.accepted > tokens.generation.drafted / 2 > 0


@pytest.mark.parametrize("drafter", ["ngram", "draft", "mtp"])
def test_sampled_output_is_distributed_as_plain_sampling(converted, drafter):
    """The first three sampled tokens (top-k 4, temperature 0.7: at most 64 outcomes) of many seeded requests with
    drafts, against their exact distribution computed from plain calls' logits: a draft is verified at the second
    token (kept or replaced by the rule), the third is the replacement's successor or the bonus token. The trained
    fixture on a prompt that repeats itself: its drafts are often kept, not always. ``draft``: the same model in
    float16 drafts (its q close to p, not equal: the rule's min(1, p/q) and residual max(0, p - q) both run).
    ``mtp``: the qwen3_5 fixture's own (random) MTP head drafts from its q, mostly rejected."""
    from gdn_export.run.session import Session

    session = Session(converted("qwen3_5" if drafter == "mtp" else TRAINED))
    ids = session.tokenizer.encode((FIXTURES / TRAINED / "heldout.txt").read_text()[:1000]).ids
    # a stretch, then its first 20 tokens again (prompt lookup drafts; 111 of 177 kept at 400 requests). Under 64
    # tokens with the 3 drawn: each request's prompt prefill (most of its time) stays in one chunk (the 110-token prompt
    # this replaced, past a chunk, cost 5x a request with prompt lookup, 2.3x with a draft archive)
    prompt = ids[:30] + ids[:20] if drafter != "mtp" else [i % 128 for i in ids[:40]]
    params = SamplingParams(temperature=0.7, top_k=4)

    def distribution(prefix: list[int]) -> np.ndarray:
        session.reset()
        return filtered_probabilities(session.prefill(np.asarray([prompt + prefix]))[0, -1], params)

    exact = {}
    first = distribution([])
    for a in np.flatnonzero(first):
        second = distribution([int(a)])
        for b in np.flatnonzero(second):
            third = distribution([int(a), int(b)])
            for c in np.flatnonzero(third):
                exact[int(a), int(b), int(c)] = first[a] * second[b] * third[c]
    outcomes = sorted(exact)
    counts = np.zeros(len(outcomes))
    drafted = accepted = 0
    speculative = (SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_min=1) if drafter == "ngram" else
                   SpeculativeConfig("mtp", 2) if drafter == "mtp" else
                   SpeculativeConfig("draft", 2, model=str(converted(TRAINED, "float16"))))
    # a draft archive doubles each request's work: half the requests (the rule's power is the rule-alone test's)
    requests = SAMPLED_REQUESTS // 2 if drafter == "draft" else SAMPLED_REQUESTS
    for seed in range(requests):
        tokens = generate(session, prompt, 3, temperature=0.7, top_k=4, top_p=1.0, seed=seed, stop_token_ids=[],
                          speculative=speculative)
        drawn = tuple(t.token_id for t in tokens)
        counts[outcomes.index(drawn)] += 1
        drafted, accepted = drafted + tokens.generation.drafted, accepted + tokens.generation.accepted
    if drafter == "ngram":
        assert 0.2 * drafted < accepted < 0.9 * drafted  # drafts were both kept and rejected, many times
    elif drafter == "mtp":
        assert drafted >= requests  # a random head: its drafts are judged (mostly replaced) every request
    else:
        assert drafted == requests and accepted > 0  # q close to p: mostly kept (the rule's residual: the test above)
    assert chi_square_p_value(counts, np.array([exact[o] for o in outcomes])) > ALPHA


@pytest.mark.parametrize("name", by_fixture(*FAMILIES))
def test_engine_speculative_requests_get_what_they_get_alone(name, converted):
    """Speculative and plain requests batched together in an Engine (each row its own call length, rows going back
    to their states before the call while others keep theirs; on qwen3_5 one request drafting with a draft archive):
    every request's greedy tokens are those of the request alone through a batch-1 Session, and the speculative ones
    drafted."""
    from helpers import alone, engine_greedy_events

    from gdn_export.run.serving import Engine

    path = converted(name, serving=True)
    from gdn_export.run.session import Session

    vocab = Session(path).metadata["vocab_size"]
    prompts = [tuple(repetitive_prompt(vocab, seed)) for seed in range(5)]
    options = [SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_min=1) if k else None for k in (4, 0, 2, 6, 3)]
    if name == "qwen3_5":  # one request drafts with a draft archive (its float16 copy) instead
        options[3] = SpeculativeConfig("draft", 3, model=str(converted(name, "float16")))
    with Engine(path, slots=3, buckets=(1, 2, 4), prefix_cache_mib=0, prefill_piece=64) as engine:
        events = engine_greedy_events(engine, prompts, options, 24)
        assert engine.stats()["calls"].get("verify x 1", 0) + engine.stats()["calls"].get("verify x 2", 0) + \
            engine.stats()["calls"].get("verify x 3", 0) > 0
    for i, prompt in enumerate(prompts):
        tokens, _ = alone(path, prompt, 24)
        assert [e.token_id for e in events[i]] == tokens, f"request {i}"
        if options[i] is None:
            assert events[i][-1].drafted == 0
    assert sum(events[i][-1].drafted for i in range(5)) > 0


# --- over HTTP: per-request speculative_config (vLLM's keys), usage's accepted and rejected tokens -------------

@pytest.mark.parametrize("batched", [True, False], ids=["engine", "workers"])
def test_server_speculative_requests(converted, batched):
    """The openai client against a real server on 127.0.0.1 (the trained fixture: its text repeats, so drafts are
    kept): a request's ``speculative_config`` gives greedy tokens identical to the same request without, streamed
    or not, completions and chat, and usage counts the drafted tokens kept and rejected (OpenAI's names for
    predicted tokens); the server's default (``--speculative``) applies unless a request says ``"method": "none"``;
    bad options are a 400 naming the field."""
    import openai

    from helpers import serving

    from gdn_export.run.generation.executor import WorkerPool
    from gdn_export.run.serving import Engine
    from gdn_export.run.session import Session

    path = converted(TRAINED, serving=batched)
    executor = Engine(path, slots=2) if batched else WorkerPool(Session(path), workers=2)
    text = (FIXTURES / TRAINED / "heldout.txt").read_text()[:600]
    with serving(executor, "m", speculative=SpeculativeConfig(num_speculative_tokens=3)) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
        ask = dict(model="m", prompt=text, max_tokens=48, temperature=0, extra_body={"ignore_eos": True})
        plain = client.completions.create(**{**ask, "extra_body": {"ignore_eos": True,
                                                                    "speculative_config": {"method": "none"}}})
        assert plain.usage.completion_tokens_details is None
        for options in ({"num_speculative_tokens": 5, "prompt_lookup_max": 4}, None):
            extra = {"ignore_eos": True} | ({"speculative_config": options} if options else {})
            answer = client.completions.create(**{**ask, "extra_body": extra})
            assert answer.choices[0].token_ids == plain.choices[0].token_ids
            details = answer.usage.completion_tokens_details
            assert details.accepted_prediction_tokens > 0 and details.rejected_prediction_tokens >= 0
        chunks = list(client.completions.create(**ask, stream=True, stream_options={"include_usage": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == plain.choices[0].text
        assert chunks[-1].usage.completion_tokens_details.accepted_prediction_tokens > 0
        chat = dict(model="m", messages=[{"role": "user", "content": text}], max_tokens=32, temperature=0)
        greedy = [client.chat.completions.create(**chat, extra_body={"speculative_config": {"method": m}})
                  for m in ("none", "ngram")]
        assert greedy[0].choices[0].message.content == greedy[1].choices[0].message.content
        for bad, param in (({"method": "eagle"}, "speculative_config.method"),
                           ({"num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens"),
                           ({"method": "mtp", "num_speculative_tokens": 9}, "speculative_config.num_speculative_tokens"),
                           ({"draft": 3}, "speculative_config"), ("ngram", "speculative_config")):
            with pytest.raises(openai.BadRequestError) as err:
                client.completions.create(**{**ask, "extra_body": {"speculative_config": bad}})
            assert err.value.body["param"] == param, err.value.body


@pytest.mark.parametrize("name", by_fixture("qwen3_5", TRAINED))
def test_draft_archive_greedy_output_is_token_identical(name, converted):
    """A draft archive (the same model in float16: the same tokenizer, mostly the same argmax) drafts; greedy output
    is plain decoding's, through generate and the CLI; a draft archive of another vocabulary is refused."""
    from gdn_export.cli import main as cli
    from gdn_export.run.session import Session

    session, draft = Session(converted(name)), str(converted(name, "float16"))
    vocab = session.metadata["vocab_size"]
    for seed in range(2):
        prompt = repetitive_prompt(vocab, seed)
        plain = [t.token_id for t in generate(session, prompt, 30, temperature=0, stop_token_ids=[],
                                              speculative=None)]
        tokens = generate(session, prompt, 30, temperature=0, stop_token_ids=[],
                          speculative=SpeculativeConfig("draft", 3, model=draft))
        assert [t.token_id for t in tokens] == plain
        assert tokens.generation.accepted > tokens.generation.drafted / 2  # its own float16 copy: mostly kept
    other = str(converted("qwen3_5" if name == TRAINED else TRAINED))
    with pytest.raises(GdnExportError, match="vocabulary"):
        list(generate(session, [1, 2, 3], 4, speculative=SpeculativeConfig("draft", 2, model=other)))
    assert cli(["generate", str(converted(name)), "--prompt-ids", "1,2,3", "--speculative", "draft"]) == 2
