"""Issue 34's fuzzing tier: malformed archives and requests generated from a seed, each answered in bounded time with
one line (an archive) or a 4xx (a request), never a 500, a traceback or a damaged archive that runs.

A few hundred cases run with the suite; ``GDN_EXPORT_FUZZ_CASES=5000`` runs thousands (the ``fuzz`` marker selects
this module). The oracle is independent of the checker: an archive the checker lets through must hold, member for
member, the bytes of the archive it was made from (read back by Python's tarfile), so a mutation that passes can only
have touched what no reader uses (a tar header's mtime, the gzip header's)."""

from __future__ import annotations

import itertools
import json
import os
import random
import tarfile
import time

import pytest
from helpers import raw, serving, shared_pool

NAME = "qwen3_5"
CASES = int(os.environ.get("GDN_EXPORT_FUZZ_CASES", "300"))
pytestmark = [pytest.mark.xdist_group(NAME), pytest.mark.fuzz]


@pytest.fixture(scope="session")
def archive(converted):
    return converted(NAME)


def members_of(path) -> dict[str, bytes] | None:
    try:
        with tarfile.open(path) as tar:
            return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}
    except Exception:  # noqa: BLE001 (the oracle only: anything unreadable is not the original)
        return None


def mutations(data: bytes, seed: int):
    """(what, mutated bytes): bytes flipped at random offsets (one, a run of 64, several), cut short, grown."""
    rng = random.Random(seed)
    for case in itertools.count():
        kind = case % 5
        mutated = bytearray(data)
        if kind == 0:
            at = rng.randrange(len(data))
            mutated[at] ^= 1 << rng.randrange(8)
            yield f"bit flipped at {at}", bytes(mutated)
        elif kind == 1:
            at = rng.randrange(len(data) - 64)
            for i in range(at, at + 64):
                mutated[i] ^= 0xFF
            yield f"64 bytes inverted at {at}", bytes(mutated)
        elif kind == 2:
            spots = sorted(rng.randrange(len(data)) for _ in range(rng.randint(2, 16)))
            for at in spots:
                mutated[at] = rng.randrange(256)
            yield f"bytes set at {spots}", bytes(mutated)
        elif kind == 3:
            at = rng.randrange(len(data))
            yield f"cut at {at}", bytes(data[:at])
        else:
            yield "grown", bytes(data) + bytes(rng.randrange(256) for _ in range(rng.randint(1, 2048)))


def test_mutated_archives_are_refused_in_one_line_or_are_the_original(archive, tmp_path):
    from gdn_export.errors import GdnExportError
    from gdn_export.run.reading import read_metadata
    from gdn_export.run.integrity import check_archive

    data = archive.read_bytes()
    original = members_of(archive)
    passed = refused = 0
    path = tmp_path / "m.nnef.tgz"
    for what, mutated in itertools.islice(mutations(data, 34), CASES):
        path.write_bytes(mutated)
        start = time.monotonic()
        try:
            check_archive(path, read_metadata(path))
        except GdnExportError as err:
            message = str(err)
            assert message and "\n" not in message.strip() and "unexpected" not in message, (what, message)
            refused += 1
        else:
            assert members_of(path) == original, f"{what}: passed the check with other content"
            passed += 1
        assert time.monotonic() - start < 5, what
    assert refused > passed  # nearly every mutation touches content


# (field, values): wrong types, out of range, huge, nested, surrogates; every field a request reads or refuses
FIELDS = {
    "prompt": [None, 5, -1, [], [[]], [-1], [10**30], ["x", "y"], {"a": 1}, "", "\ud800", [True], "x" * 100],
    "max_tokens": [0, -1, 10**30, 1.5, "8", True, [], None],
    "temperature": [-1, 10**308, "x", [], None, 1e-300],
    "top_p": [-1, 2, "x", [], None],
    "top_k": [-5, 10**12, 1.5, "x", None],
    "seed": [-1, 10**40, "x", 1.5, None],
    "stop": [5, [5], ["x"] * 100, "", [""], ["\udc00"], "s" * 5000, {"a": "b"}, None],
    "stop_token_ids": [5, [-1], [10**30], ["x"], list(range(5000)), [True], None],
    "logprobs": [-1, 100, "x", True, None],
    "n": [0, 2, "x"],
    "stream": ["yes", 1, None],
    "stream_options": [1, [], {"include_usage": "x"}, None],
    "logit_bias": [{"1": 100}, [], "x", None],
    "ignore_eos": ["x", 1, None],
    "model": [5, "other", "\ud800", None],
    "echo": [True, "x"],
    "response_format": [{"type": "json_object"}, "x"],
}
CHAT_FIELDS = {
    "messages": [None, [], "x", [1], [{"role": 5}], [{"role": "user", "content": 5}],
                 [{"role": "user", "content": [{"type": "image_url"}]}], [{"role": "user", "content": "\ud800"}],
                 [{"role": "user", "content": "x" * 10}] * 50],
    "max_completion_tokens": [0, -1, "x", 10**30],
    "top_logprobs": [-1, 100, 5],
}


def request_cases(seed: int):
    rng = random.Random(seed)
    single = [("/v1/completions", {"prompt": [1, 2], "max_tokens": 2, name: value})
              for name, values in FIELDS.items() for value in values]
    single += [("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                         name: value}) for name, values in CHAT_FIELDS.items() for value in values]
    yield from single
    while True:  # several fields broken at once
        path = rng.choice(["/v1/completions", "/v1/chat/completions"])
        body = {"prompt": [1, 2]} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]}
        body["max_tokens"] = 2
        pool = {**FIELDS, **(CHAT_FIELDS if "chat" in path else {})}
        for name in rng.sample(sorted(pool), rng.randint(2, 4)):
            body[name] = rng.choice(pool[name])
        yield path, body


@pytest.fixture(scope="module")
def server(shared_session):
    pool = shared_pool(shared_session(NAME), workers=1, max_queue=4)
    with serving(pool, NAME, request_timeout=10.0) as base:
        yield base


def test_malformed_requests_are_a_4xx_or_an_answer_never_a_500(server):
    for path, body in itertools.islice(request_cases(34), CASES):
        start = time.monotonic()
        status, answer = raw(server, "POST", path, json.dumps(body))
        assert status < 500, (path, body, answer)
        if status >= 400:
            assert isinstance(answer, dict) and answer["error"]["message"], (body, answer)
        assert time.monotonic() - start < 10, body
    assert raw(server, "GET", "/health")[0] == 200
