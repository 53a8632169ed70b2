"""The serving graph and the Engine: per-row past lengths against transformers, batched requests against each
request alone through a batch-1 Session, untouched slots, the prefix cache, cancellation and a full queue.

Real tract on the fixtures' serving archives (``converted(name, serving=True)``)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from gdn_export.errors import GdnExportError
from gdn_export.run.generation import ExecutorFull, TokenRequest
from gdn_export.run.serving import SCRATCH, Engine, SlotPool
from gdn_export.run.session import Session

from helpers import FAMILIES, FIXTURES, GREEDY, alone, by_fixture, prompts_for, relative_error

NEW_TOKENS = (5, 9, 3, 7, 12, 4, 6)


def wait_for(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.mark.parametrize("name", by_fixture(*FAMILIES))
def test_serving_graph_matches_transformers(name, converted, reference_model):
    """The serving graph, batch 1 and 2 through Session (which pads each cache by one masked position), against
    transformers' eager model: the same rule as convert's check."""
    from gdn_export.hf.check import check_against_transformers

    path = converted(name, serving=True)
    for batch in (1, 2):
        result = check_against_transformers(path, reference_model(name), prompt_len=16, decode_steps=6, batch=batch)
        assert result.ok, f"batch {batch}: {result}"


@pytest.mark.parametrize("name", by_fixture(*FAMILIES))
def test_engine_requests_get_what_they_get_alone(name, converted):
    """Staggered arrivals, prompts of 1 to 131 tokens (across the 64-token pieces), mixed decode lengths, 3 slots for
    7 requests (slots reused, requests queued), decode batches padded to the next bucket, prefill pieces of two
    prompts at once where two are in their prompts (each row its own length: the graph's ``seq_len``): every
    request's logits and greedy tokens are those of the same request alone through a batch-1 Session."""
    path = converted(name, serving=True)
    prompts = prompts_for(path)
    with Engine(path, slots=3, workers=2 if name == "qwen3_5" else 1, buckets=(1, 2, 4), keep_logits=True,
                prefix_cache_mib=0, prefill_piece=64, prefill_rows=2) as engine:
        streams = [engine.submit(TokenRequest(p, n, GREEDY)) for p, n in zip(prompts[:3], NEW_TOKENS[:3])]
        events: dict[int, list] = {}

        def read(i, stream):
            events[i] = list(stream)

        readers = [threading.Thread(target=read, args=(i, s)) for i, s in enumerate(streams)]
        for reader in readers:
            reader.start()
        wait_for(lambda: engine.stats()["busy"] >= 2)  # later arrivals join running requests
        for i in range(3, len(prompts)):
            streams.append(engine.submit(TokenRequest(prompts[i], NEW_TOKENS[i], GREEDY)))
            readers.append(threading.Thread(target=read, args=(i, streams[-1])))
            readers[-1].start()
            time.sleep(0.02 * i)
        for reader in readers:
            reader.join(timeout=120)
        assert engine.stats()["busy"] == 0
    for i, (prompt, new_tokens) in enumerate(zip(prompts, NEW_TOKENS)):
        tokens, rows = alone(path, prompt, new_tokens)
        got = events[i]
        assert [e.token_id for e in got] == tokens, f"prompt of {len(prompt)}"
        assert got[-1].finish_reason == "length"
        for step, (event, row) in enumerate(zip(got, rows)):
            error = relative_error(event.logits, row)
            assert error <= 1e-4, f"prompt of {len(prompt)}, token {step}: {error:.2e}"


@pytest.mark.parametrize("resident", [False, True], ids=["copied", "resident"])
def test_padding_rows_and_admissions_leave_other_slots_untouched(converted, resident):
    """A decode batch of one real row and scratch padding writes that row only: every other slot (and the
    scratch row) is byte-identical afterwards, and a slot reset for an admission touches no other; the same when
    the batch's states stay resident between two steps (the Engine's decode path) and are flushed by the reset."""
    from gdn_export.run.runtime import load_tract_model, run_tract, run_tract_tensors

    path = converted("qwen3_5", serving=True)
    session = Session(path)
    pool = SlotPool(session.state_specs, 4)
    plans = {b: load_tract_model(path, {"B": b}) for b in (1, 4)}
    rng = np.random.default_rng(1)
    for slot, length in enumerate((5, 9, 2, 7)):
        ids = rng.integers(0, session.metadata["vocab_size"], (1, length))
        past_len, states = pool.gather([slot])
        outputs = run_tract(plans[1], [ids, past_len, np.array([length]), *states])
        pool.scatter([slot], outputs[1:1 + len(session.state_specs)], length)  # an MTP archive's hidden: no state
    before = [pool.snapshot(slot) for slot in range(4)]
    _, scratch_before = pool.gather([SCRATCH])
    rows = [2, SCRATCH, SCRATCH, SCRATCH]
    for token in (7, 8):  # two steps: resident, the second reads the first's states as they came
        past_len, states = pool.gather(rows)
        outputs = run_tract_tensors(plans[4], [np.full((4, 1), token), past_len, np.ones(4, np.int64), *states])
        outputs = outputs[1:1 + len(session.state_specs)]
        pool.scatter(rows, outputs, 1, resident=resident)
    pool.reset(3)  # an admission into slot 3 (flushes a resident batch first)
    after = [pool.snapshot(slot) for slot in range(4)]
    for slot in (0, 1):
        assert before[slot].length == after[slot].length
        for a, b in zip(before[slot].fixed + before[slot].caches, after[slot].fixed + after[slot].caches):
            assert a.tobytes() == b.tobytes(), f"slot {slot} changed"
    assert after[2].length == before[2].length + 2
    assert any(a.tobytes() != b.tobytes() for a, b in zip(before[2].fixed, after[2].fixed))
    assert after[3].length == 0 and all(not a.any() for a in after[3].fixed)
    _, scratch_after = pool.gather([SCRATCH])
    assert all(a.tobytes() == b.tobytes() for a, b in zip(scratch_before, scratch_after))
    RESIDENT_RUNS[resident] = after[2]
    if len(RESIDENT_RUNS) == 2:  # the resident path leaves the same states as copying them every step
        copied, kept = RESIDENT_RUNS[False], RESIDENT_RUNS[True]
        assert all(a.tobytes() == b.tobytes() for a, b in zip(copied.fixed + copied.caches, kept.fixed + kept.caches))


RESIDENT_RUNS: dict = {}


def test_prefix_cache_hit_equals_a_cold_run(converted):
    """A request whose prompt shares 128 tokens with an earlier one starts from the snapshot at 128: its logits are
    exactly (bit for bit) those of the same request in an engine without a prefix cache, and within the f32 rule
    of the request alone through a Session."""
    path = converted("qwen3_5", serving=True)
    first, tail = prompts_for(path, (140, 9), seed=3)
    second = first[:128] + tail
    request = TokenRequest(second, 4, GREEDY)
    with Engine(path, slots=2, keep_logits=True, prefill_piece=64) as engine:
        list(engine.submit(TokenRequest(first, 2, GREEDY)))
        assert engine.stats()["prefix_cache"]["entries"] == 2  # after 64 and 128 tokens
        warm = list(engine.submit(request))
        assert engine.stats()["prefix_cache"]["hits"] == 1
    with Engine(path, slots=2, keep_logits=True, prefix_cache_mib=0, prefill_piece=64) as engine:
        cold = list(engine.submit(request))
    assert [e.token_id for e in warm] == [e.token_id for e in cold]
    for a, b in zip(warm, cold):
        assert np.array_equal(a.logits, b.logits)
    tokens, rows = alone(path, second, 4)
    assert [e.token_id for e in warm] == tokens
    assert max(relative_error(e.logits, r) for e, r in zip(warm, rows)) <= 1e-4


def test_prefix_cache_is_bounded():
    from gdn_export.run.serving import PrefixCache, Snapshot

    cache = PrefixCache(max_bytes=3000)
    for i in range(5):
        cache.put(tuple(range(i, i + 64)), Snapshot(64, (np.zeros(250, np.float32),), ()))  # 1000 bytes each
    assert len(cache) == 3 and cache.nbytes == 3000
    assert cache.longest(tuple(range(0, 65))) is None  # the oldest were evicted
    assert cache.longest(tuple(range(4, 4 + 65))) is not None
    assert not cache.wants(tuple(range(63)))  # not aligned


def test_cancelled_request_frees_its_slot_and_a_full_engine_refuses(converted):
    path = converted("qwen3_5", serving=True)
    prompt = prompts_for(path, (5,))[0]
    with Engine(path, slots=1, max_queue=0) as engine:
        stream = engine.submit(TokenRequest(prompt, 1000, GREEDY))
        first = next(iter(stream))
        assert first.finish_reason is None
        with pytest.raises(ExecutorFull, match="slots are busy"):
            engine.submit(TokenRequest(prompt, 3, GREEDY))
        stream.cancel()
        wait_for(lambda: engine.stats()["busy"] == 0)
        tokens = [e.token_id for e in engine.submit(TokenRequest(prompt, 3, GREEDY))]
    assert tokens == alone(path, prompt, 3)[0]


def test_engine_refuses_what_it_cannot_serve(converted, tmp_path):
    with pytest.raises(GdnExportError, match="--serving"):
        Engine(converted("qwen3_5"))
    path = converted("qwen3_5", serving=True)
    with pytest.raises(GdnExportError, match="multiple of 64"):
        Engine(path, prefill_piece=100)
    with pytest.raises(GdnExportError, match="slots >= workers"):
        Engine(path, slots=1, workers=2)
    with Engine(path, slots=1) as engine:
        with pytest.raises(GdnExportError, match="outside this model's vocabulary"):
            engine.submit(TokenRequest((10**6,), 2, GREEDY))


def test_qwen4_exp_has_no_serving_graph(tmp_path):
    from gdn_export.pipeline.convert import convert

    with pytest.raises(GdnExportError, match="no serving graph.*QSA indexer"):
        convert(FIXTURES / "qwen4_exp", tmp_path / "m.nnef.tgz", serving=True)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("lowering", ["scan", "recurrent"])
@pytest.mark.slow  # converts a fixture
def test_serving_graph_with_every_lowering(tmp_path, lowering):
    """The serving graph changes only the attention side: with the other GDN lowerings (chunked is the default,
    above; tract's fused op needs K = V, which no fixture with attention has) it passes convert's check against
    transformers, and the Engine's greedy tokens equal the Session's."""
    from gdn_export.pipeline.convert import convert

    path = tmp_path / f"{lowering}.nnef.tgz"
    report = convert(FIXTURES / "qwen3_5", path, serving=True, lowering=lowering)
    assert report.check.ok and {layer.lowering for layer in report.layers if layer.lowering != "-"} == {lowering}
    prompts = prompts_for(path, (3, 70))
    with Engine(path, slots=2, buckets=(2,), prefill_piece=64) as engine:
        streams = [engine.submit(TokenRequest(p, 4, GREEDY)) for p in prompts]
        got = [[e.token_id for e in s] for s in streams]
    assert got == [alone(path, p, 4)[0] for p in prompts]
