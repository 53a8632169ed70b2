"""Issue 25: every unbounded case found by trying the server as a user and as an attacker gets a clear, bounded
answer. Real servers over real sockets on 127.0.0.1 (uvicorn in a thread of this process over the test's tract
plan, and ``gdn-export serve`` as a process of its own), driven by the ``openai`` client and raw HTTP; memory of
the server process read from /proc. Every expectation is computed here: token counts from the request, the
context from the fixture's config.json, sizes from the files the test writes."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

import openai
import pytest
from helpers import (FIXTURES, add_member, raw, rewritten, serve_process, serving,  # the same helpers as the server's other tests
                     shared_pool, wait_for)

NAME = "qwen3_5"
FIXTURE = FIXTURES / NAME
CONTEXT = json.loads((FIXTURE / "config.json").read_text())["max_position_embeddings"]
LONG_PROMPT = 100_000
KEY = "test-key-25"
GIB = 1 << 30
pytestmark = pytest.mark.xdist_group(NAME)


def long_prompt_body(**fields) -> bytes:
    ids = [(i * 7919) % 100 + 1 for i in range(LONG_PROMPT)]  # token ids of the fixture's 128-token vocabulary
    return json.dumps(dict(prompt=ids, **fields)).encode()


@pytest.fixture(scope="session")
def archive(converted):
    return converted(NAME)


@pytest.fixture(scope="session")
def keyed_server(shared_session):
    """2 workers over the fixture's plan, its own context (256 tokens), asking for KEY: (base url, pool)."""
    pool = shared_pool(shared_session(NAME), workers=2, max_queue=2)
    with serving(pool, NAME, api_key=KEY) as base:
        yield base, pool


@pytest.fixture(scope="session")
def long_server(shared_session):
    """1 worker, the context raised past the model's to take 100,000-token prompts (as
    GDN_EXPORT_ALLOW_LONG_MAX_MODEL_LEN allows), a 3 s deadline: (base url, pool)."""
    pool = shared_pool(shared_session(NAME), workers=1, max_queue=1)
    pool.archive.limit_context(3 * LONG_PROMPT, allow_longer=True)
    with serving(pool, NAME, request_timeout=3.0) as base:
        yield base, pool


# --- bounded work per request ----------------------------------------------------------------------------------

@pytest.mark.slow
def test_a_cancelled_long_prompt_frees_the_worker_of_an_archive_without_serving_graph(long_server):
    """100,000 prompt tokens on an archive converted without --serving: the client leaves while the prompt runs and
    the worker is free within 5 s (a prompt runs a piece at a time, a cancellation check between pieces)."""
    base, pool = long_server
    host, port = base.removeprefix("http://").split(":")
    body = long_prompt_body(max_tokens=8)
    client = socket.create_connection((host, int(port)))
    client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                   b"Content-Length: %d\r\n\r\n" % len(body) + body)
    wait_for(lambda: pool.stats()["busy"] == 1, 30, "the prompt to run")
    client.close()
    wait_for(lambda: pool.stats()["busy"] == 0, 5, "the worker to be freed within 5 s of the client leaving")
    status, answer = raw(base, "POST", "/v1/completions", json.dumps({"prompt": [1, 2, 3], "max_tokens": 2}))
    assert status == 200 and len(answer["choices"][0]["token_ids"]) <= 2


@pytest.mark.slow
def test_a_request_past_its_deadline_is_ended(long_server):
    """--request-timeout 3: a request that cannot finish in time gets OpenAI's error body (408), a stream an error
    event then [DONE]; the worker is free again."""
    base, pool = long_server
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(model=NAME, prompt=[1, 2, 3], max_tokens=2 * LONG_PROMPT,
                                  extra_body={"ignore_eos": True})
    assert info.value.status_code == 408 and info.value.body["code"] == "request_timeout"
    status, events = raw(base, "POST", "/v1/completions", long_prompt_body(max_tokens=LONG_PROMPT, stream=True,
                                                                           ignore_eos=True))
    lines = [line.removeprefix("data: ") for line in events.splitlines() if line.startswith("data: ")]
    assert status == 200 and lines[-1] == "[DONE]" and json.loads(lines[-2])["error"]["code"] == "request_timeout"
    wait_for(lambda: pool.stats()["busy"] == 0, 5, "the worker to be freed")


@pytest.mark.slow
def test_tokenizing_a_big_prompt_leaves_the_event_loop_free(long_server, keyed_server):
    """A 1 MB text prompt is tokenized off the event loop: /health keeps answering meanwhile; the prompt, past even
    the raised context, gets context_length_exceeded. On the model's own context (256 tokens) it is refused from its
    length alone, before tokenizing."""
    status, answer = raw(keyed_server[0], "POST", "/v1/completions",
                         json.dumps({"prompt": "hello world, the cat sat. " * 10_000}),
                         {"Authorization": f"Bearer {KEY}"})
    assert status == 400 and answer["error"]["code"] == "context_length_exceeded"
    assert "260000 characters, more than 256 tokens can hold" in answer["error"]["message"]
    base, _ = long_server
    text = "hello world, the cat sat. " * (1_000_000 // 26)
    answered, during = [], threading.Event()

    def ping():
        while not during.is_set():
            time.sleep(0.01)
        while during.is_set():
            if raw(base, "GET", "/health")[0] == 200 and during.is_set():
                answered.append(time.monotonic())

    pinger = threading.Thread(target=ping)
    pinger.start()
    during.set()
    started = time.monotonic()
    status, answer = raw(base, "POST", "/v1/completions", json.dumps({"prompt": text}))
    took = time.monotonic() - started
    during.clear()
    pinger.join(30)
    assert status == 400 and answer["error"]["code"] == "context_length_exceeded", answer
    assert "in the prompt" not in answer["error"]["message"]  # tokenized: 1,000,000 characters fit 3 * LONG_PROMPT
    if took > 1.0:  # long enough that a blocked event loop would have answered nothing meanwhile
        assert answered, f"/health never answered during the {took:.1f} s the big prompt took"


# --- context limits ------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_prompt_and_new_tokens_are_bounded_by_the_context(keyed_server):
    base, _ = keyed_server
    client = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=60)
    card = client.models.retrieve(NAME)
    assert card.id == NAME and card.model_extra["max_model_len"] == CONTEXT
    with pytest.raises(openai.BadRequestError) as info:  # 300 + 512 on a 256-token context
        client.completions.create(model=NAME, prompt=[5] * 300, max_tokens=512)
    assert info.value.body["code"] == "context_length_exceeded" and info.value.body["param"] == "prompt"
    assert f"maximum context length is {CONTEXT} tokens" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=NAME, prompt=[5] * 200, max_tokens=CONTEXT - 199)
    assert info.value.body["code"] == "context_length_exceeded" and info.value.body["param"] == "max_tokens"
    answer = client.completions.create(model=NAME, prompt=[5] * 200, max_tokens=CONTEXT - 200, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert len(answer.choices[0].token_ids) == CONTEXT - 200 and answer.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as info:  # a chat too: the rendered prompt counts
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "a b " * 400}])
    assert info.value.body["code"] == "context_length_exceeded" and info.value.body["param"] == "messages"
    # no max_tokens: the default (16) lowered to what the context leaves
    answer = client.completions.create(model=NAME, prompt=[5] * (CONTEXT - 3), temperature=0,
                                       extra_body={"ignore_eos": True})
    assert len(answer.choices[0].token_ids) == 3


@pytest.mark.slow
def test_generate_refuses_more_tokens_than_the_context(archive, tmp_path, capsys):
    from gdn_export.cli import main

    assert main(["generate", str(archive), "--prompt-ids", "1,2", "--max-new-tokens", "100000", "--ignore-eos"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"maximum context length is {CONTEXT} tokens" in err[0] and "100002" in err[0]
    assert main(["generate", str(archive), "--prompt-ids", "1,2", "--max-model-len", str(CONTEXT + 1)]) == 2
    assert "GDN_EXPORT_ALLOW_LONG_MAX_MODEL_LEN" in capsys.readouterr().err
    # an archive converted before the context was stored: said, and bounded by the documented default (4096)
    old = rewritten(archive, tmp_path / "old.nnef.tgz", drop_metadata=("context_length",))
    assert main(["generate", str(old), "--prompt-ids", "1,2", "--max-new-tokens", "5000", "--ignore-eos"]) == 2
    err = capsys.readouterr().err
    assert "carries no context length" in err and "maximum context length is 4096 tokens" in err


# --- keys, names, shutdown, a template bomb: `gdn-export serve` itself ----------------------------------------------

EVIL_TEMPLATE = "{% for i in range(50000) %}{{ 'x' * 20000 }}{% endfor %}"


def memory_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/{pid}/status")


@pytest.mark.slow
def test_gdn_export_serve_keys_names_templates_and_sigterm(archive, tmp_path):
    """One `gdn-export serve` process over an archive whose chat template would make 1 GB of text: /v1 asks for the
    key (401 with OpenAI's body), /v1/models shows the served name and /v1/models/{id} answers; the chat request gets
    a 400 within 1 GiB of extra memory (the server's peak RSS from /proc); SIGTERM with a stream and a whole answer in
    flight ends both with an error (an SSE error event and [DONE]; a 503 body), exits 0, and prints no traceback."""
    evil = rewritten(archive, tmp_path / "evil.nnef.tgz", add={"chat_template.jinja": EVIL_TEMPLATE.encode()})
    log = tmp_path / "stderr.txt"
    process, base = serve_process([str(evil), "--max-model-len", str(3 * LONG_PROMPT), "--shutdown-grace", "1"], log,
                                  GDN_EXPORT_API_KEY=KEY, GDN_EXPORT_ALLOW_LONG_MAX_MODEL_LEN="1")
    try:
        for path in ("/v1/models", "/v1/models/evil", "/v1/nowhere"):
            status, answer = raw(base, "GET", path)
            assert status == 401 and answer["error"]["code"] == "invalid_api_key", (path, answer)
        status, answer = raw(base, "GET", "/v1/models", headers={"Authorization": "Bearer wrong"})
        assert status == 401
        assert raw(base, "GET", "/health")[0] == 200  # not under /v1: a load balancer's probe needs no key
        client = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == ["evil"]  # the file's stem, never its path
        assert client.models.retrieve("evil").id == "evil"
        with pytest.raises(openai.NotFoundError):
            client.models.retrieve("other")

        before = memory_kib(process.pid, "VmRSS")
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="evil", messages=[{"role": "user", "content": "hi"}])
        assert "chat template" in info.value.body["message"]
        assert (memory_kib(process.pid, "VmHWM") - before) * 1024 < GIB

        answers: dict = {}

        def ask(stream: bool):
            answers[stream] = raw(base, "POST", "/v1/completions",
                                  long_prompt_body(max_tokens=LONG_PROMPT, ignore_eos=True, stream=stream),
                                  {"Authorization": f"Bearer {KEY}"})

        askers = [threading.Thread(target=ask, args=(stream,)) for stream in (True, False)]
        for asker in askers:
            asker.start()
        wait_for(lambda: raw(base, "GET", "/health")[1]["busy"] == 1, 30, "a request to run")
        process.terminate()
        for asker in askers:
            asker.join(60)
        process.wait(60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    text = log.read_text()
    assert process.returncode == 0 and "stopped" in text and "Traceback" not in text, text
    status, events = answers[True]
    lines = [line.removeprefix("data: ") for line in events.splitlines() if line.startswith("data: ")]
    assert status == 200 and lines[-1] == "[DONE]" and json.loads(lines[-2])["error"]["code"] == "server_shutdown"
    status, body = answers[False]
    assert status == 503 and body["error"]["code"] == "server_shutdown"


@pytest.mark.slow
def test_generate_chat_with_a_template_bomb_is_one_line_in_bounded_memory(archive, tmp_path):
    evil = rewritten(archive, tmp_path / "evil.nnef.tgz", add={"chat_template.jinja": EVIL_TEMPLATE.encode()})
    measure = ("import resource, subprocess, sys; done = subprocess.run(sys.argv[1:]); "
               "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); "
               "sys.exit(done.returncode)")
    done = subprocess.run([sys.executable, "-c", measure, sys.executable, "-m", "gdn_export.cli", "generate",
                           str(evil), "--chat", "--prompt", "hi"], capture_output=True, text=True, timeout=120)
    *lines, peak_kib = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and "chat template" in lines[0], done.stderr
    assert int(peak_kib) * 1024 < GIB  # the whole process: the import of the package and the tokenizer included


def test_the_loopback_rule():
    from gdn_export.run.http import is_loopback

    assert all(is_loopback(h) for h in ("127.0.0.1", "127.1.2.3", "::1", "[::1]", "localhost"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "192.0.2.1", "example.com"))


@pytest.mark.slow
def test_serve_beyond_loopback_without_a_key_warns(archive):
    """192.0.2.1 (TEST-NET-1) is no address of this machine: the warning comes, then the bind fails."""
    from gdn_export.run.http import serve

    said = []
    with pytest.raises(OSError):
        serve(archive, host="192.0.2.1", port=0, progress=said.append)
    assert any("without an API key" in line for line in said), said


# --- archives: one schema, bounded member reads, damage named (no tract needed) -----------------------------------

METADATA = {"format": 1, "family": "Qwen3.5", "vocab_size": 128, "generation_files": [], "serving": False,
            "states": [{"name": "state_0", "shape": ["B", 4, 16, 8], "dtype": "float32", "kind": "recurrent",
                        "layer": 0}]}


def small_archive(path: Path, metadata: dict | bytes, members: dict | None = None) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        add_member(tar, "gdn_export.json", metadata if isinstance(metadata, bytes) else json.dumps(metadata).encode())
        for name, value in (members or {}).items():
            add_member(tar, name, value)
    return path


@pytest.mark.parametrize("field, value", [("vocab_size", -5), ("serving", "yes"), ("states", "x"),
                                          ("states", [{"name": "s", "shape": ["B", -1], "dtype": "float32"}]),
                                          ("generation_files", ["../../etc/passwd"]), ("dtype", "int8"),
                                          ("context_length", 0)])
def test_a_bad_gdn_export_json_is_refused_naming_the_field(tmp_path, field, value):
    from gdn_export.errors import GdnExportError
    from gdn_export.run.session import Session

    path = small_archive(tmp_path / "bad.nnef.tgz", dict(METADATA, **{field: value}))
    with pytest.raises(GdnExportError, match=f"'{field}' must be"):
        Session(path)


def test_members_read_bounded_and_never_through_links(tmp_path):
    from gdn_export.errors import GdnExportError
    from gdn_export.run.session import Session

    # a tokenizer.json whose header claims 3 GiB: refused from its header, nothing read (a plain tar, data cut short)
    path = tmp_path / "big.nnef.tgz"
    data = json.dumps(dict(METADATA, generation_files=["tokenizer.json"])).encode()
    with tarfile.open(path, "w") as tar:
        add_member(tar, "gdn_export.json", data)
    with open(path, "r+b") as handle:  # replace the end-of-archive blocks by the big member's header
        handle.seek(512 + ((len(data) + 511) // 512) * 512)
        big = tarfile.TarInfo("tokenizer.json")
        big.size = 3 * GIB
        handle.write(big.tobuf(format=tarfile.GNU_FORMAT) + b"{" * 1024)
        handle.truncate()
    assert path.stat().st_size < 10_000
    session = Session(path)
    with pytest.raises(GdnExportError, match=r"tokenizer.json is 3072.0 MiB, more than the 64 MiB"):
        session.tokenizer
    # gdn_export.json as a symbolic link
    path = tmp_path / "link.nnef.tgz"
    with tarfile.open(path, "w:gz") as tar:
        info = tarfile.TarInfo("gdn_export.json")
        info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(info)
    with pytest.raises(GdnExportError, match="gdn_export.json is a symbolic link"):
        Session(path)
    # not JSON, not an object
    for data, message in ((b"{", "not valid JSON"), (b"[1]", "must be a JSON object")):
        with pytest.raises(GdnExportError, match=message):
            Session(small_archive(tmp_path / "x.nnef.tgz", data))


@pytest.mark.slow
def test_a_damaged_gzip_is_named_as_such(archive, tmp_path, capsys):
    from gdn_export.cli import main

    data = archive.read_bytes()
    truncated = tmp_path / "truncated.nnef.tgz"
    truncated.write_bytes(data[:len(data) // 2])
    header = bytearray(data)
    first = data.find(b"gdn_export.json\0")  # the first member's tar header, inside the deflate stream (the gzip
    assert first > 0                         # header before it may be padded with a comment: run/archive.py)
    for i in range(first, first + 30):
        header[i] ^= 0xFF
    corrupted = tmp_path / "corrupted.nnef.tgz"
    corrupted.write_bytes(bytes(header))
    for path in (truncated, corrupted):
        assert main(["generate", str(path), "--prompt-ids", "1,2"]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "damaged gzip file" in err[0], err


# --- the CLI's small ones -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("args, message", [
    (["generate", "MODEL", "--prompt-ids", "1,,2"], "not a comma-separated list"),
    (["generate", "MODEL", "--prompt-ids", "1,2,"], "not a comma-separated list"),
    (["generate", "MODEL", "--prompt-ids", "1", "--stop", ""], "empty stop string"),
    (["serve", "MODEL", "--port", "70000"], "at most 65535"),
    (["serve", "MODEL", "--request-timeout", "0"], "must be > 0"),
    (["serve", "MODEL", "--max-model-len", "0"], "must be >= 1"),
])
def test_cli_refusals_are_one_line(tmp_path, capsys, args, message):
    from gdn_export.cli import main

    model = small_archive(tmp_path / "m.nnef.tgz", METADATA)
    with pytest.raises(SystemExit) as info:
        main([str(model) if a == "MODEL" else a for a in args])
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2 and len(err) == 1 and message in err[0], err


# --- checkpoints: configs and safetensors headers checked before anything is allocated ------------------------------

def checkpoint_copy(tmp_path: Path, **config_changes) -> Path:
    import shutil

    folder = tmp_path / "checkpoint"
    shutil.copytree(FIXTURE, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(config_changes)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("field, value, message", [
    ("hidden_size", 10**9, "hidden_size 1000000000 is larger than any tensor of the checkpoint allows"),
    ("intermediate_size", 10**12, "intermediate_size 1000000000000 is larger"),
    ("num_hidden_layers", 0, "num_hidden_layers must be an integer >= 1, got 0"),
    ("num_attention_heads", -4, "num_attention_heads must be an integer >= 1, got -4"),
    ("vocab_size", "128", 'vocab_size must be an integer >= 1, got "128"'),
    ("head_dim", 16.0, "head_dim must be an integer >= 1, got 16.0"),
    ("max_position_embeddings", True, "max_position_embeddings must be an integer >= 1, got true"),
])
def test_a_bad_checkpoint_config_fails_fast_naming_the_field(tmp_path, field, value, message):
    from gdn_export.hf.checkpoint import open_checkpoint
    from gdn_export.hf.tensors import CheckpointError

    folder = checkpoint_copy(tmp_path, **{field: value})
    peak = memory_kib(os.getpid(), "VmHWM")
    with pytest.raises(CheckpointError, match=message.replace("(", r"\(")):
        open_checkpoint(folder)
    assert (memory_kib(os.getpid(), "VmHWM") - peak) * 1024 < GIB


def test_generation_config_ids_must_lie_in_the_vocabulary(tmp_path):
    from gdn_export.hf.checkpoint import open_checkpoint
    from gdn_export.hf.tensors import CheckpointError

    folder = checkpoint_copy(tmp_path)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 500]}))
    with pytest.raises(CheckpointError, match=r"eos_token_id \[2, 500\] is not a token id of the vocabulary \[0, 128\)"):
        open_checkpoint(folder)


def overlapping_safetensors(path: Path) -> None:
    """Every tensor's data_offsets rewritten to start at 0 (the file keeps its size)."""
    data = path.read_bytes()
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + length])
    for name, info in header.items():
        if name != "__metadata__":
            begin, end = info["data_offsets"]
            info["data_offsets"] = [0, end - begin]
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= length
    text += b" " * (length - len(text))  # the same header length: the data section stays where it was
    path.write_bytes(data[:8] + text + data[8 + length:])


@pytest.mark.parametrize("damage", ["overlapping", "trailing bytes"])
def test_safetensors_headers_are_checked_as_the_safetensors_library_checks_them(tmp_path, damage):
    from safetensors import safe_open

    from gdn_export.hf.checkpoint import open_checkpoint
    from gdn_export.hf.tensors import CheckpointError

    folder = checkpoint_copy(tmp_path)
    weights = next(folder.glob("*.safetensors"))
    if damage == "overlapping":
        overlapping_safetensors(weights)
    else:
        weights.write_bytes(weights.read_bytes() + b"\0" * 64)
    with pytest.raises(Exception):  # the reference: the safetensors library refuses the file
        with safe_open(str(weights), "np") as handle:
            [handle.get_tensor(name) for name in handle.keys()]
    expected = "overlaps the tensor before it" if damage == "overlapping" else "nothing after the last tensor"
    with pytest.raises(CheckpointError, match=expected):
        open_checkpoint(folder)
