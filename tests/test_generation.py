"""Generation: sampling against transformers' warpers, greedy tokens against transformers' eager model, seeded
reproducibility, stop tokens and strings, incremental UTF-8-safe text, chat templates, the worker pool, the CLI.

Real tract on the qwen3_5 fixture (its tiny tokenizer, ChatML template and generation_config.json), converted once
per run (``converted``) and planned once per process (``shared_session``)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from gdn_export.run.generation import (ExecutorFull, GeneratedToken, Generation, SamplingError, SamplingParams, TokenRequest,
                                   WorkerPool, generate, sampling_from)
from gdn_export.run.generation.chat import ChatTemplateError, render_chat
from gdn_export.run.generation.executor import ArchiveText
from gdn_export.run.generation.generate import RequestError, chat_prompt_ids
from gdn_export.run.generation.sampling import Sampler, filtered_probabilities, log_softmax
from gdn_export.run.generation.text import Detokenizer, StopStrings

from helpers import FIXTURES

NAME = "qwen3_5"
PROMPT = "Hello world. The"
group = pytest.mark.xdist_group(NAME)


def text_of(tokens: list[GeneratedToken]) -> str:
    return "".join(t.text for t in tokens)


# --- sampling rules, no model ---------------------------------------------------------------------------------

def test_filters_keep_what_transformers_warpers_keep():
    """temperature, then top-k, then top-p: the tokens left (and their renormalized probabilities) are those of
    transformers' TemperatureLogitsWarper -> TopKLogitsWarper -> TopPLogitsWarper."""
    from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                        TopPLogitsWarper)

    rng = np.random.default_rng(0)
    for case in range(60):
        logits = rng.normal(0, 3, size=97)
        temperature = float(rng.choice([0.3, 0.7, 1.0, 1.7]))
        top_k = int(rng.choice([0, 1, 2, 5, 40, 97]))
        top_p = float(rng.choice([1.0, 0.9, 0.5, 0.2, 0.01]))
        ours = filtered_probabilities(logits, SamplingParams(temperature, top_k, top_p))
        scores = torch.tensor(logits[None], dtype=torch.float64)
        scores = TemperatureLogitsWarper(temperature)(None, scores)
        if top_k:
            scores = TopKLogitsWarper(top_k)(None, scores)
        if top_p < 1:
            scores = TopPLogitsWarper(top_p)(None, scores)
        theirs = torch.softmax(scores, -1)[0].numpy()
        assert np.array_equal(ours > 0, theirs > 0), (case, temperature, top_k, top_p)
        np.testing.assert_allclose(ours, theirs, rtol=1e-9, atol=1e-12)


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    kept = lambda p: set(np.flatnonzero(filtered_probabilities(logits, SamplingParams(1.0, top_p=p))))  # noqa: E731
    assert kept(0.5) == {0}
    assert kept(0.79) == {0, 1}
    assert kept(0.81) == {0, 1, 2}
    assert kept(1.0) == {0, 1, 2, 3}
    assert kept(1e-9) == {0}  # at least one token


@pytest.mark.slow
def test_draws_follow_the_distribution_and_the_seed():
    logits = np.log(np.array([0.6, 0.25, 0.1, 0.05]))
    params = SamplingParams(1.0, seed=7)
    sampler = Sampler(params)
    draws = np.array([sampler(logits).token_id for _ in range(20000)])
    frequencies = np.bincount(draws, minlength=4) / draws.size
    np.testing.assert_allclose(frequencies, [0.6, 0.25, 0.1, 0.05], atol=0.015)
    again = Sampler(params)
    assert [again(logits).token_id for _ in range(200)] == list(draws[:200])
    top2 = Sampler(SamplingParams(1.0, top_k=2, seed=1))
    assert {top2(logits).token_id for _ in range(500)} == {0, 1}


def test_logprobs_are_the_raw_log_softmax():
    logits = np.random.default_rng(1).normal(size=50)
    choice = Sampler(SamplingParams(0.5, top_k=3, seed=0, logprobs=4))(logits)
    reference = torch.log_softmax(torch.tensor(logits), -1).numpy()
    assert choice.logprob == pytest.approx(reference[choice.token_id], abs=1e-12)
    assert [i for i, _ in choice.top_logprobs] == list(np.argsort(-reference)[:4])
    np.testing.assert_allclose([lp for _, lp in choice.top_logprobs], np.sort(reference)[::-1][:4], atol=1e-12)
    assert Sampler(SamplingParams(0.0, logprobs=0))(logits).top_logprobs == ()
    np.testing.assert_allclose(log_softmax(logits), reference, atol=1e-12)


@pytest.mark.parametrize("bad, param", [(dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"),
                                        (dict(top_p=1.5), "top_p"), (dict(top_k=-2), "top_k"),
                                        (dict(top_k=1.5), "top_k"), (dict(seed=-1), "seed"),
                                        (dict(logprobs=21), "logprobs"), (dict(temperature=float("nan")),
                                                                          "temperature")])
def test_bad_sampling_parameters_name_themselves(bad, param):
    with pytest.raises(SamplingError) as info:
        SamplingParams(**{"temperature": 1.0, **bad})
    assert info.value.param == param and param in str(info.value)


def test_defaults_come_from_generation_config():
    config = {"do_sample": True, "temperature": 0.7, "top_k": 20, "top_p": 0.8}
    assert sampling_from(config) == SamplingParams(0.7, 20, 0.8)
    assert sampling_from(config, temperature=0) == SamplingParams(0.0, 20, 0.8)
    assert sampling_from({}) == SamplingParams(0.0)  # transformers' default: greedy
    assert sampling_from({"do_sample": False, "temperature": 0.6}).greedy
    assert sampling_from(None, top_p=0.9) == SamplingParams(1.0, None, 0.9)  # a filter asked for: sample


# --- text: incremental detokenization and stop strings ----------------------------------------------------------

def byte_tokenizer():
    """A byte-level BPE over all 256 bytes with a few merges: most non-ASCII characters span several tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<eos>"], show_progress=False)
    tok.train_from_iterator(["hello world", "the cat sat on the mat"] * 5, trainer=trainer)
    return tok


def test_detokenizer_never_emits_a_broken_character():
    tok = byte_tokenizer()
    text = "héllo wörld, 日本語 🎉 the end ✓"
    ids = tok.encode(text).ids
    assert len(ids) > len(text) - 8  # multi-byte characters really are split across tokens
    detok = Detokenizer(tok, tok.encode("prompt: ").ids)
    pieces = [detok.add(i) for i in ids]
    pieces.append(detok.flush())
    assert "".join(pieces) == tok.decode(ids) == text
    assert all("\ufffd" not in piece for piece in pieces)
    assert pieces.count("") >= 5  # the tokens holding the first bytes of a character emitted nothing
    # skipped special tokens add nothing; an incomplete character at the end comes out as U+FFFD at the flush
    detok = Detokenizer(tok)
    eos = tok.token_to_id("<eos>")
    assert [detok.add(i) for i in tok.encode("a").ids + [eos]] == ["a", ""]
    partial = tok.encode("日").ids[:-1]
    assert [detok.add(i) for i in partial] == [""] * len(partial) and detok.flush() == "\ufffd"


def test_stop_strings_cut_as_openai_does():
    stops = StopStrings(["o w", "END"])
    out = [stops.add(p) for p in ["Hel", "lo", " ", "wo", "rld"]]
    assert "".join(out) == "Hell" and stops.matched == "o w"
    assert out == ["Hel", "l", "", "", ""]  # "o" and "o " held while they may begin "o w"
    stops = StopStrings(["END"])
    assert [stops.add(p) for p in ["aE", "N", "x"]] == ["a", "", "ENx"] and stops.matched is None
    assert stops.flush() == ""
    stops = StopStrings(["yz", "xy"])  # the earliest match wins, whatever the order of the list
    assert stops.add("axyzb") == "a" and stops.matched == "xy"
    stops = StopStrings(["EN"])
    assert stops.add("abE") == "ab" and stops.flush() == "E"  # held text comes out at the end


# --- chat templates ----------------------------------------------------------------------------------------

def test_chat_template_renders_as_transformers_does():
    import json

    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(FIXTURES / NAME)
    template = json.loads((FIXTURES / NAME / "tokenizer_config.json").read_text())["chat_template"]
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Hello"},
                {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "the cat?"}]
    for add in (True, False):
        assert render_chat(template, messages, add_generation_prompt=add) == \
            reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=add)
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert render_chat(template, parts) == render_chat(template, [{"role": "user", "content": "a\nb"}])


@pytest.mark.parametrize("template, messages, says", [
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", [{"role": "user", "content": "x"}], "sandbox"),
    ("{{ raise_exception('no system role') }}", [{"role": "user", "content": "x"}], "no system role"),
    ("{{ messages }}", [], "non-empty list"),
    ("{{ messages }}", [{"content": "x"}], "role"),
    ("{{ messages }}", [{"role": "user", "content": [{"type": "image_url"}]}], "text parts"),
])
def test_chat_template_refusals(template, messages, says):
    with pytest.raises(ChatTemplateError) as info:
        render_chat(template, messages)
    assert says in str(info.value)


# --- generation in tract -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def session(shared_session):
    return shared_session(NAME)


def greedy_reference(model, prompt_ids: list[int], steps: int) -> list[int]:
    """The independent loop: argmax of transformers' eager model's logits over the whole sequence, every step."""
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
    return ids[len(prompt_ids):]


@group
def test_greedy_equals_transformers_argmax(session, reference_model):
    tokens = list(generate(session, PROMPT, 24, temperature=0, stop_token_ids=[]))
    prompt_ids = session.tokenizer.encode(PROMPT).ids
    expected = greedy_reference(reference_model(NAME), prompt_ids, 24)
    assert [t.token_id for t in tokens] == expected
    assert text_of(tokens) == session.tokenizer.decode(expected, skip_special_tokens=True)
    assert [t.finish_reason for t in tokens] == [None] * 23 + ["length"]
    assert [t.index for t in tokens] == list(range(24))
    offsets = np.cumsum([0] + [len(t.text) for t in tokens[:-1]])
    assert [t.offset for t in tokens] == list(offsets)
    # token ids in give the same; top-k 1 with any temperature and seed is greedy
    assert [t.token_id for t in generate(session, prompt_ids, 24, temperature=0, stop_token_ids=[])] == expected
    assert [t.token_id for t in generate(session, prompt_ids, 24, temperature=1.3, top_k=1, seed=5,
                                         stop_token_ids=[])] == expected


@group
def test_seeded_sampling_is_reproducible(session):
    run = lambda seed, **kw: [t.token_id for t in generate(session, PROMPT, 20, temperature=1.0, seed=seed,  # noqa
                                                            stop_token_ids=[], **kw)]
    first = run(11)
    assert run(11) == first
    assert run(12) != first
    assert run(11, top_p=0.9, top_k=30) == run(11, top_p=0.9, top_k=30)
    # logprobs: the chosen token's and its alternatives' from the raw logits
    tokens = list(generate(session, PROMPT, 3, temperature=1.0, seed=11, logprobs=3, stop_token_ids=[]))
    session.reset()
    logits = session.prefill(np.array([session.tokenizer.encode(PROMPT).ids]))[0, -1]
    reference = torch.log_softmax(torch.tensor(logits, dtype=torch.float64), -1).numpy()
    assert tokens[0].logprob == pytest.approx(reference[tokens[0].token_id], abs=1e-6)
    assert [i for i, _ in tokens[0].top_logprobs] == list(np.argsort(-reference)[:3])


@group
def test_stop_tokens_and_stop_strings(session):
    greedy = list(generate(session, PROMPT, 30, temperature=0, stop_token_ids=[]))
    ids, text = [t.token_id for t in greedy], text_of(greedy)
    # a stop token ends the generation with it, adding no text
    stop_id = ids[5]
    first = ids.index(stop_id)
    tokens = list(generate(session, PROMPT, 30, temperature=0, stop_token_ids=[stop_id]))
    assert [t.token_id for t in tokens] == ids[:first + 1]
    assert tokens[-1].finish_reason == "stop" and tokens[-1].stop_reason == stop_id
    assert text_of(tokens) == session.tokenizer.decode(ids[:first])
    # by default the stop tokens are generation_config.json's eos_token_id
    eos = session.generation_config["eos_token_id"]
    assert Generation(ArchiveText(session), PROMPT).request.stop_token_ids == frozenset(eos)
    # a stop string: the text is cut before it, across token boundaries
    for stop in (text[7:10], text[15:16], [text[20:23], text[9:11]]):
        tokens = list(generate(session, PROMPT, 30, temperature=0, stop=stop, stop_token_ids=[]))
        stops = [stop] if isinstance(stop, str) else stop
        cut = min(text.find(s) for s in stops)
        assert text_of(tokens) == text[:cut]
        assert tokens[-1].finish_reason == "stop" and tokens[-1].stop_reason in stops
        assert [t.token_id for t in tokens] == ids[:len(tokens)]
    # a stop string never seen: everything, finish "length"
    tokens = list(generate(session, PROMPT, 30, temperature=0, stop="\x00never", stop_token_ids=[]))
    assert text_of(tokens) == text and tokens[-1].finish_reason == "length"


@group
def test_requests_are_refused_clearly(session):
    with pytest.raises(RequestError, match="outside this model's vocabulary"):
        generate(session, [1, 2, 128], 4)
    with pytest.raises(RequestError, match="empty"):
        generate(session, [], 4)
    with pytest.raises(RequestError, match="makes no tokens"):
        generate(session, "日本", 4)
    with pytest.raises(RequestError, match="max_new_tokens"):
        generate(session, PROMPT, 0)
    with pytest.raises(SamplingError, match="top_p"):
        generate(session, PROMPT, 4, top_p=2.0)
    archive = ArchiveText(session)
    archive.tokenizer = None
    with pytest.raises(RequestError, match="carries no tokenizer"):
        chat_prompt_ids(archive, [{"role": "user", "content": "x"}])
    archive.chat_template = None
    with pytest.raises(RequestError, match="no chat template"):
        chat_prompt_ids(archive, [{"role": "user", "content": "x"}])


@group
def test_chat_prompt_is_the_template_tokenized(session):
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(FIXTURES / NAME)
    messages = [{"role": "user", "content": "Hello the cat"}]
    ids = chat_prompt_ids(ArchiveText(session), messages)
    assert list(ids) == reference.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                                      return_dict=True)["input_ids"]


@group
def test_worker_pool_runs_requests_alone_and_at_once(session):
    """Two workers over one tract plan: concurrent requests get what each gets alone; a full pool refuses; a
    cancelled request frees its worker at its next token."""
    prompts = [PROMPT, "The cat sat", "Hello", "and the"]
    params = [SamplingParams(0.0), SamplingParams(1.0, seed=3), SamplingParams(0.8, top_p=0.9, seed=4),
              SamplingParams(0.0)]
    requests = [TokenRequest(tuple(session.tokenizer.encode(p).ids), 16, s) for p, s in zip(prompts, params)]
    pool = WorkerPool(session, workers=2, max_queue=2)
    try:
        alone = [[e.token_id for e in pool.submit(r)] for r in requests]
        results = [None] * len(requests)
        streams = [pool.submit(r) for r in requests]  # 2 running, 2 waiting
        with pytest.raises(ExecutorFull):
            pool.submit(requests[0])

        def read(i):
            results[i] = [e.token_id for e in streams[i]]

        threads = [threading.Thread(target=read, args=(i,)) for i in range(len(requests))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert results == alone
        # cancel a long request: the worker is free again, and the next request is served alone
        long = pool.submit(TokenRequest(requests[0].prompt_ids, 100000))
        next(iter(long))
        assert pool.stats()["busy"] == 1
        long.cancel()
        for _ in range(500):
            if pool.stats()["busy"] == 0:
                break
            threading.Event().wait(0.01)
        assert pool.stats() == {"workers": 2, "busy": 0, "queued": 0, "max_queue": 2}
        assert [e.token_id for e in pool.submit(requests[3])] == alone[3]
        # the pool is an executor generate() takes, as the Engine will be
        assert text_of(generate(pool, PROMPT, 12, temperature=0)) == text_of(generate(session, PROMPT, 12,
                                                                                      temperature=0))
    finally:
        pool.close()


@group
def test_a_request_cancelled_while_waiting_gives_its_place(session):
    pool = WorkerPool(session, workers=1, max_queue=1)
    try:
        prompt = tuple(session.tokenizer.encode(PROMPT).ids)
        running = pool.submit(TokenRequest(prompt, 100000))
        next(iter(running))
        waiting = pool.submit(TokenRequest(prompt, 4))
        with pytest.raises(ExecutorFull):
            pool.submit(TokenRequest(prompt, 4))
        waiting.cancel()
        again = pool.submit(TokenRequest(prompt, 4))  # the cancelled one's place
        assert pool.stats()["queued"] == 1
        running.cancel()
        assert len(list(again)) == 4 and list(waiting) == []
    finally:
        pool.close()


def run_cli(args: list[str], capsys) -> tuple[int, str, str]:
    from gdn_export.cli import main

    try:
        status = main(args)
    except SystemExit as exit:  # argparse's usage errors
        status = exit.code
    out = capsys.readouterr()
    return status, out.out, out.err


@group
def test_cli_generate_streams_text(converted, session, capsys):
    path = str(converted(NAME))
    expected = text_of(generate(session, PROMPT, 12, temperature=0))
    status, out, err = run_cli(["generate", path, "--prompt", PROMPT, "--max-new-tokens", "12",
                                "--temperature", "0"], capsys)
    assert status == 0 and out == expected + "\n" and "12 tokens, finish: length" in err
    loading, loaded = err.index("into tract and planning it"), err.index("loaded and planned in")  # while it waits
    assert loading < loaded < err.index("12 tokens, finish: length"), err
    for bad, says in [(["--prompt-ids", "1,2,999"], "outside this model's vocabulary"),
                      (["--prompt-ids", "1,x"], "comma-separated"), (["--prompt", "x", "--top-p", "0"], "--top-p"),
                      (["--prompt", "x", "--temperature", "-1"], "--temperature"),
                      (["--prompt-ids", "1", "--chat"], "--chat takes"), (["--prompt", "日本"], "makes no tokens"),
                      (["--prompt", "x", "--prompt-ids", "1"], "not allowed with"), ([], "one of the arguments")]:
        status, out, err = run_cli(["generate", path, *bad], capsys)
        assert status == 2 and says in err and "Traceback" not in err, (bad, err)
    status, _, err = run_cli(["generate", path + ".missing", "--prompt", "x"], capsys)
    assert status == 2 and "no such file" in err
