"""The HTTP server over real sockets on 127.0.0.1, driven by the ``openai`` client (and the standard library's
``http.client`` where a body must be malformed or the raw event stream read).

``gdn-export serve`` itself runs as a process of its own once (``test_gdn_export_serve``); the API's behaviour is
checked on the same server run by uvicorn in a thread of the test process over the test's tract plan (planned once):
2 workers and a queue of 2, and 1 worker without a queue (a full server, a cancelled stream, an archive read as if it
carried no tokenizer and no chat template). Every answer is compared with ``gdn_export.generate`` run here."""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai  # the test extra installs it
import pytest

from gdn_export.run.generation import generate
from gdn_export.run.generation.executor import ArchiveText, WorkerPool
from gdn_export.run.generation.generate import chat_prompt_ids
from helpers import raw, serve_process, serving, wait_for

NAME = "qwen3_5"
PROMPT = "Hello world. The"
pytestmark = pytest.mark.xdist_group(NAME)


# session-scoped: one server per test process, however pytest-xdist spreads and interleaves this module's tests
@pytest.fixture(scope="session")
def server(session):
    """2 workers, 2 waiting, over the tract plan of ``session``: (base url, pool)."""
    from gdn_export.run.session import Session

    pool = WorkerPool(Session.sharing_plan(session), workers=2, max_queue=2)
    with serving(pool, NAME) as base:
        yield base, pool


@pytest.fixture(scope="session")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="session")
def session(shared_session):
    return shared_session(NAME)


def expected(session, prompt=PROMPT, max_tokens=16, **kw):
    tokens = list(generate(session, prompt, max_tokens, **kw))
    return "".join(t.text for t in tokens), [t.token_id for t in tokens], tokens[-1].finish_reason


# --- the endpoints -------------------------------------------------------------------------------------------

def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [NAME]
    status, body = raw(server[0], "GET", "/health")
    assert status == 200 and body == {"status": "ok", "workers": 2, "busy": 0, "queued": 0, "max_queue": 2}


def _metrics(base: str) -> dict[str, float]:
    """/metrics parsed as Prometheus' text format: sample name with its labels -> value."""
    status, text = raw(base, "GET", "/metrics")
    assert status == 200 and isinstance(text, str), (status, text)
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


def test_metrics_count_what_the_requests_did(server, client, session):
    """/metrics (vLLM's names, Prometheus' text format): the tokens counted are the prompt's (the tokenizer's count,
    not the server's usage) and the tokens generated; one time to first token and one latency per request; the
    finished request under its finish reason; nothing running after."""
    before = _metrics(server[0])
    prompt_tokens = len(session.tokenizer.encode(PROMPT).ids)
    answer = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=5, temperature=0,
                                       extra_body={"ignore_eos": True})
    after = _metrics(server[0])
    label = f'{{model_name="{NAME}"}}'
    delta = {key: after[key] - before.get(key, 0.0) for key in after}
    assert answer.choices[0].finish_reason == "length" and answer.usage.completion_tokens == 5
    assert delta[f"vllm:prompt_tokens_total{label}"] == prompt_tokens
    assert delta[f"vllm:generation_tokens_total{label}"] == 5
    assert delta[f'vllm:request_success_total{{model_name="{NAME}",finished_reason="length"}}'] == 1
    assert delta[f"vllm:time_to_first_token_seconds_count{label}"] == 1
    assert delta[f"vllm:e2e_request_latency_seconds_count{label}"] == 1
    assert after[f"vllm:num_requests_running{label}"] == 0 and after[f"vllm:num_requests_waiting{label}"] == 0
    ttft = delta[f"vllm:time_to_first_token_seconds_sum{label}"]
    assert 0 < ttft <= delta[f"vllm:e2e_request_latency_seconds_sum{label}"]
    buckets = [v for k, v in after.items() if k.startswith("vllm:time_to_first_token_seconds_bucket")]
    assert buckets == sorted(buckets) and buckets[-1] == after[f"vllm:time_to_first_token_seconds_count{label}"]


def test_completion_equals_generate(client, session):
    text, ids, finish = expected(session, temperature=0, stop_token_ids=[])
    answer = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=16, temperature=0,
                                       extra_body={"ignore_eos": True})
    choice = answer.choices[0]
    assert (choice.text, choice.token_ids, choice.finish_reason) == (text, ids, finish)
    assert choice.prompt_token_ids == session.tokenizer.encode(PROMPT).ids
    assert answer.usage.prompt_tokens == len(choice.prompt_token_ids) and answer.usage.completion_tokens == 16
    # a prompt of token ids, and top_k (vLLM's extension) 1 at temperature 1: the same greedy tokens
    same = client.completions.create(model=NAME, prompt=choice.prompt_token_ids, max_tokens=16, temperature=1.0,
                                     seed=3, extra_body={"top_k": 1, "ignore_eos": True})
    assert same.choices[0].token_ids == ids and same.choices[0].text == text


def test_seeded_sampling_and_logprobs(client, session):
    text, ids, _ = expected(session, temperature=0.9, top_p=0.95, seed=42, logprobs=2, stop_token_ids=[])
    ask = dict(model=NAME, prompt=PROMPT, max_tokens=16, temperature=0.9, top_p=0.95, seed=42, logprobs=2,
               extra_body={"ignore_eos": True})
    first, second = client.completions.create(**ask), client.completions.create(**ask)
    assert first.choices[0].token_ids == second.choices[0].token_ids == ids
    assert first.choices[0].text == text
    logprobs = first.choices[0].logprobs
    reference = list(generate(session, PROMPT, 16, temperature=0.9, top_p=0.95, seed=42, logprobs=2,
                              stop_token_ids=[]))
    assert logprobs.token_logprobs == pytest.approx([t.logprob for t in reference])
    assert logprobs.tokens == [session.tokenizer.decode([i]) for i in ids]
    assert [sorted(top.values(), reverse=True) for top in logprobs.top_logprobs] == \
        [pytest.approx([lp for _, lp in t.top_logprobs]) for t in reference]
    assert logprobs.text_offset == [t.offset for t in reference]


def test_stop_strings_and_stop_token_ids(client, session):
    full, ids, _ = expected(session, max_tokens=24, temperature=0, stop_token_ids=[])
    stop = full[9:12]
    answer = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop, "\x01"],
                                       extra_body={"ignore_eos": True})
    choice = answer.choices[0]
    assert choice.text == full[:full.find(stop)] and choice.finish_reason == "stop" and choice.stop_reason == stop
    assert choice.token_ids == ids[:len(choice.token_ids)]
    answer = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=24, temperature=0,
                                       extra_body={"stop_token_ids": [ids[4]], "ignore_eos": True})
    choice = answer.choices[0]
    assert choice.token_ids == ids[:ids.index(ids[4]) + 1] and choice.finish_reason == "stop"
    assert choice.stop_reason == ids[4]


def test_stream_assembles_to_the_whole_answer(server, client):
    ask = dict(model=NAME, prompt=PROMPT, max_tokens=20, temperature=0.8, seed=9, extra_body={"ignore_eos": True})
    whole = client.completions.create(**ask).choices[0]
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **ask))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.text
    assert [i for c in chunks if c.choices for i in c.choices[0].token_ids] == whole.token_ids
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    # on the wire: server-sent events, each a JSON object, ending with data: [DONE]
    wire = {"model": NAME, "prompt": PROMPT, "max_tokens": 20, "temperature": 0.8, "seed": 9, "ignore_eos": True,
            "stream": True}
    status, body = raw(server[0], "POST", "/v1/completions", json.dumps(wire))
    events = [line for line in body.split("\n") if line]
    assert status == 200 and events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)
    assert "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-1]) == whole.text


def test_chat_completion_through_the_template(client, session):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Hello the cat"}]
    prompt = chat_prompt_ids(ArchiveText(session), messages)
    text, ids, finish = expected(session, list(prompt), 12, temperature=0, stop_token_ids=[])
    answer = client.chat.completions.create(model=NAME, messages=messages, max_tokens=12, temperature=0,
                                            logprobs=True, top_logprobs=1, extra_body={"ignore_eos": True})
    choice = answer.choices[0]
    assert (choice.message.content, choice.token_ids, choice.finish_reason) == (text, ids, finish)
    assert choice.message.role == "assistant" and answer.usage.prompt_tokens == len(prompt)
    assert len(choice.logprobs.content) == 12 and all(len(e.top_logprobs) == 1 for e in choice.logprobs.content)
    chunks = list(client.chat.completions.create(model=NAME, messages=messages, max_tokens=12, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == "length"


def until_served(call, attempts: int = 400):
    """``call()``, asked again while the server answers 503 (full)."""
    for _ in range(attempts):
        try:
            return call()
        except openai.APIStatusError as err:
            if err.status_code != 503:
                raise
            time.sleep(0.02)
    raise AssertionError(f"still 503 after {attempts} attempts")


def test_concurrent_clients_get_what_they_get_alone(client):
    asks = [dict(prompt=PROMPT, temperature=0), dict(prompt="The cat sat", temperature=1.0, seed=1),
            dict(prompt="and the", temperature=0.7, top_p=0.9, seed=2), dict(prompt=[5, 6, 7], temperature=0),
            dict(prompt="Hello", temperature=1.2, seed=3)]
    asks = [dict(a, model=NAME, max_tokens=24, extra_body={"ignore_eos": True}) for a in asks]
    alone = [client.completions.create(**a).choices[0].token_ids for a in asks]
    at_once = [None] * len(asks)
    errors = []

    def ask(i):
        try:  # 5 clients, 2 workers, 2 waiting: at most one is told the server is full; it asks again
            at_once[i] = until_served(lambda: client.completions.create(**asks[i]).choices[0].token_ids)
        except Exception as err:  # reported below
            errors.append(err)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(asks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and at_once == alone


@pytest.fixture(scope="session")
def engine_server(converted):
    """The batched Engine over the serving archive (2 workers, 4 slots, 1 waiting): (base url, engine)."""
    from gdn_export.run.serving import Engine

    engine = Engine(converted(NAME, serving=True), slots=4, workers=2, max_queue=1)
    engine.archive.limit_context(200_000, allow_longer=True)  # a client below asks for more than the 256-token context
    with serving(engine, NAME) as base:
        yield base, engine


def test_engine_server_batches_concurrent_clients(engine_server, client):
    """Over the Engine: 6 concurrent clients (greedy and seeded sampling, one streaming, one leaving mid-stream) get
    the tokens the one-request-at-a-time server gives each alone; the one that left frees its slot."""
    base, engine = engine_server
    batched = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)
    asks = [dict(prompt=PROMPT, temperature=0), dict(prompt="The cat sat", temperature=1.0, seed=1),
            dict(prompt="and the", temperature=0.7, top_p=0.9, seed=2), dict(prompt=[5, 6, 7], temperature=0),
            dict(prompt="Hello", temperature=1.2, seed=3)]
    asks = [dict(a, model=NAME, max_tokens=24, extra_body={"ignore_eos": True}) for a in asks]
    alone = [client.completions.create(**a).choices[0].token_ids for a in asks]
    at_once: list = [None] * len(asks)
    errors = []

    def answer(i):
        if i == 0:
            return [t for c in batched.completions.create(**asks[i], stream=True) for t in c.choices[0].token_ids]
        return batched.completions.create(**asks[i]).choices[0].token_ids

    def ask(i):
        try:  # 4 slots and 1 waiting for 6 clients: one may be told to come back
            at_once[i] = until_served(lambda: answer(i))
        except Exception as err:  # reported below
            errors.append(err)

    def leave():
        stream = batched.completions.create(model=NAME, prompt="x y", max_tokens=100000, stream=True,
                                            extra_body={"ignore_eos": True})
        next(iter(stream))
        stream.close()

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(asks))] + [threading.Thread(target=leave)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert not errors and at_once == alone
    wait_for(lambda: engine.stats()["busy"] == 0, 10, "every slot to be free")
    status, body = raw(base, "GET", "/health")
    assert status == 200 and body["slots"] == 4 and body["workers"] == 2
    for bad, param in (('{"prompt": "x",', None), ('{"prompt": [1, 2, 500]}', "prompt"),
                       ('{"prompt": "x", "top_p": 0}', "top_p")):
        status, refusal = raw(base, "POST", "/v1/completions", bad)
        assert status == 400 and refusal["error"]["param"] == param, (bad, refusal)
    assert engine.stats()["busy"] == 0


@pytest.mark.parametrize("body, status, param", [
    ('{"prompt": "x",', 400, None),
    ('[1, 2]', 400, None),
    ('{"prompt": "x", "max_tokens": "many"}', 400, "max_tokens"),
    ('{"prompt": "x", "temperature": -0.5}', 400, "temperature"),
    ('{"prompt": "x", "temperature": true}', 400, "temperature"),
    ('{"prompt": "x", "top_p": 0}', 400, "top_p"),
    ('{"prompt": "x", "stop": 3}', 400, "stop"),
    ('{"prompt": "x", "n": 2}', 400, "n"),
    ('{"prompt": "x", "model": "gpt-4o"}', 404, "model"),
    ('{"prompt": [1, 2, 500]}', 400, "prompt"),
    ('{"prompt": [1, 2.5]}', 400, "prompt"),
    ('{"prompt": ["a", "b"]}', 400, "prompt"),
    ('{"prompt": ""}', 400, "prompt"),
    ('{"max_tokens": 3}', 400, "prompt"),
    ('{"prompt": "x", "logprobs": 50}', 400, "logprobs"),
    ('{"prompt": "x", "echo": true}', 400, "echo"),
    ('{"prompt": "x", "stream": "yes"}', 400, "stream"),
])
def test_bad_requests_get_an_openai_error(server, body, status, param):
    got, answer = raw(server[0], "POST", "/v1/completions", body)
    assert got == status, answer
    error = answer["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param and error["type"] == "invalid_request_error"


def test_bad_chat_requests_and_routes(server, client):
    for body, param in [('{"messages": "hi"}', "messages"), ('{"messages": [{"content": "x"}]}', "messages"),
                        ('{}', "messages"), ('{"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}',
                                             "top_logprobs")]:
        status, answer = raw(server[0], "POST", "/v1/chat/completions", body)
        assert status == 400 and answer["error"]["param"] == param, answer
    status, answer = raw(server[0], "GET", "/v1/nowhere")
    assert status == 404 and answer["error"]["code"] == "not_found"
    status, answer = raw(server[0], "GET", "/v1/completions")
    assert status == 405 and "error" in answer
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=NAME, prompt="x", n=3)
    assert info.value.status_code == 400 and "n=1" in info.value.message
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="x")


# --- a full server, a cancelled stream, an archive without tokenizer or template (in-process) --------------------

@pytest.fixture(scope="session")
def small_server(session):
    """One worker, no queue, the archive read as if it carried no tokenizer and no chat template, its context raised
    past the model's (streams below stay busy until cancelled): (base url, pool)."""
    from gdn_export.run.session import Session

    pool = WorkerPool(Session.sharing_plan(session), workers=1, max_queue=0)
    pool.archive.tokenizer, pool.archive.chat_template = None, None
    pool.archive.limit_context(200_000, allow_longer=True)
    with serving(pool, "bare") as base:
        yield base, pool


def test_full_server_answers_503_and_a_cancelled_stream_frees_its_worker(small_server, session):
    base, pool = small_server
    bare = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)
    prompt = session.tokenizer.encode(PROMPT).ids
    stream = bare.completions.create(model="bare", prompt=prompt, max_tokens=100000, temperature=0, stream=True,
                                     extra_body={"ignore_eos": True})
    first = next(iter(stream))
    assert first.choices[0].text == "" and len(first.choices[0].token_ids) == 1  # served in token ids
    assert pool.stats()["busy"] == 1
    with pytest.raises(openai.APIStatusError) as info:
        bare.completions.create(model="bare", prompt=prompt, max_tokens=2)
    assert info.value.status_code == 503 and info.value.body["code"] == "server_busy"
    stream.close()  # the client leaves mid-stream: the worker stops at its next token
    wait_for(lambda: pool.stats()["busy"] == 0, 10, "the worker to be freed")
    answer = bare.completions.create(model="bare", prompt=prompt, max_tokens=8, temperature=0,
                                     extra_body={"ignore_eos": True})
    _, ids, _ = expected(session, prompt, 8, temperature=0, stop_token_ids=[])
    assert answer.choices[0].token_ids == ids and answer.choices[0].text == ""
    # a client that leaves while waiting for a whole answer frees the worker too
    status = {}

    def leave():
        host, port = base.removeprefix("http://").split(":")
        connection = http.client.HTTPConnection(host, int(port), timeout=60)
        connection.request("POST", "/v1/completions", body=json.dumps(
            {"prompt": prompt, "max_tokens": 100000, "ignore_eos": True}))
        wait_for(lambda: pool.stats()["busy"] == 1, 10, "the request to run")
        status["running"] = True
        connection.sock.shutdown(2)
        connection.close()

    leave()
    wait_for(lambda: pool.stats()["busy"] == 0, 10, "the worker to be freed")
    assert status["running"]


def test_an_archive_without_tokenizer_or_template(small_server):
    base, _ = small_server
    status, answer = raw(base, "POST", "/v1/chat/completions", '{"messages": [{"role": "user", "content": "x"}]}')
    assert status == 400 and "no chat template" in answer["error"]["message"]
    status, answer = raw(base, "POST", "/v1/completions", '{"prompt": "text"}')
    assert status == 400 and "token ids" in answer["error"]["message"]
    status, answer = raw(base, "POST", "/v1/completions", '{"prompt": [1, 2], "stop": "x"}')
    assert status == 400 and answer["error"]["param"] == "stop"
    status, answer = raw(base, "POST", "/v1/completions", '{"prompt": [1, 2], "max_tokens": 3, "logprobs": 1}')
    assert status == 200 and answer["choices"][0]["logprobs"]["tokens"][0].startswith("token_id:")


def test_cli_serve_refuses_bad_arguments(converted):
    from gdn_export.cli import main

    for args in (["--port", "70000"], ["--workers", "0"], ["--max-queue", "-1"], ["--prefill-piece", "0"],
                 ["--prefix-cache-mib", "-1"]):
        with pytest.raises(SystemExit) as info:
            main(["serve", str(converted(NAME)), *args])
        assert info.value.code == 2
    # the Engine's prefill pieces end on the prefix cache's 64-token boundaries: refused before anything loads
    assert main(["serve", str(converted(NAME, serving=True)), "--prefill-piece", "100", "--port", "0"]) == 2
    assert main(["serve", str(converted(NAME)), "--prefill-rows", "2", "--port", "0"]) == 2
    assert main(["serve", str(converted(NAME)), "--prefix-cache-mib", "64", "--port", "0"]) == 2  # no Engine
    with pytest.raises(SystemExit) as info:
        main(["serve", str(Path(converted(NAME)).with_suffix(".none"))])
    assert info.value.code == 2


@pytest.mark.parametrize("served", [False, True], ids=["worker_pool", "engine"])
def test_gdn_export_serve(converted, session, tmp_path, served):
    """The command: listens on the port it prints, serves, and stops cleanly (exit 0) on SIGTERM; a serving
    archive on the batched Engine."""
    log = tmp_path / "stderr.txt"
    process, base = serve_process([str(converted(NAME, serving=served)), "--host", "127.0.0.1", "--workers", "2",
                                   "--max-queue", "1", "--served-model-name", NAME, "--prefill-piece", "64"]
                                  + (["--slots", "4", "--prefill-rows", "2", "--prefix-cache-mib", "1.5"] if served
                                     else []), log)
    try:
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == [NAME]
        health = raw(base, "GET", "/health")[1]
        assert health["workers"] == 2 and health.get("slots") == (4 if served else None)
        assert health.get("prefill_piece") == (64 if served else None)
        assert health.get("prefill_rows") == (2 if served else None)
        assert health.get("prefix_cache", {}).get("max_bytes") == (3 << 19 if served else None)
        text, ids, _ = expected(session, temperature=0, stop_token_ids=[])
        chunks = list(client.completions.create(model=NAME, prompt=PROMPT, max_tokens=16, temperature=0, stream=True,
                                                extra_body={"ignore_eos": True}))
        assert "".join(c.choices[0].text for c in chunks) == text
        assert [i for c in chunks for i in c.choices[0].token_ids] == ids
    finally:
        _stop(process)
    assert process.returncode == 0 and "stopped" in log.read_text(), log.read_text()


def _answer(base: str, method: str, path: str, body: dict | None = None) -> tuple[int, dict, dict]:
    """(status, JSON body, headers) of one request over a real connection."""
    host, port = base.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        connection.request(method, path, body=None if body is None else json.dumps(body),
                           headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, json.loads(response.read().decode()), {k.lower(): v for k, v in response.getheaders()}
    finally:
        connection.close()


def test_gdn_export_serve_listens_while_it_loads(converted, session, tmp_path):
    """The command listens before tract has loaded and planned the model: a request made as soon as it says so gets
    503 with Retry-After (``/v1`` and ``/health``: "loading"); once loaded, ``/health`` says ok with the load's
    seconds and the same request is answered as ``generate`` answers it."""
    log = tmp_path / "stderr.txt"
    with open(log, "w") as err:
        process = subprocess.Popen([sys.executable, "-m", "gdn_export.cli", "serve", str(converted(NAME)), "--host",
                                    "127.0.0.1", "--port", "0", "--served-model-name", NAME],
                                   stdout=subprocess.DEVNULL, stderr=err, stdin=subprocess.DEVNULL,
                                   env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        def listening():
            assert process.poll() is None, log.read_text()
            lines = [line for line in log.read_text().splitlines() if "listening at http://127.0.0.1:" in line]
            return lines and f"http://127.0.0.1:{int(lines[0].split('http://127.0.0.1:')[1].split()[0])}"

        base = wait_for(listening, 60, "gdn-export serve to listen")
        ask = {"model": NAME, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
        status, body, headers = _answer(base, "POST", "/v1/completions", ask)
        assert status == 503 and body["error"]["code"] == "model_loading", (status, body, log.read_text())
        assert int(headers["retry-after"]) >= 1
        status, body, headers = _answer(base, "GET", "/health")
        assert (status, body["status"]) == (503, "loading") and int(headers["retry-after"]) >= 1, (status, body)
        wait_for(lambda: _answer(base, "GET", "/health")[0] == 200, 90, "the model to load")
        health = _answer(base, "GET", "/health")[1]
        assert health["status"] == "ok" and health["load_seconds"] > 0, health
        status, body, _ = _answer(base, "POST", "/v1/completions", ask)
        assert status == 200 and body["choices"][0]["text"] == expected(session, max_tokens=8, temperature=0)[0]
        assert "loaded and planned in" in log.read_text()
    finally:
        _stop(process)
    assert process.returncode == 0, log.read_text()


def _stop(process: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL if it has not exited within 15 s."""
    process.terminate()
    try:
        process.wait(15)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
