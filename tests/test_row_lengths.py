"""A serving graph's per-row new-token counts (``seq_len``): rows of one call, each with its own past and its own
number of real tokens (the rest padding, filled with random ids so that a leak would show), get the logits and
leave the states that each row gets alone in a batch-1 call of exactly its tokens, for every family and every
GDN lowering; and the Engine's batched prefill pieces give each request what it gets alone through a Session.

Real tract on serving archives; the reference is the same archive run one row at a time, itself checked against
transformers in tests/test_engine.py."""

from __future__ import annotations

import numpy as np
import pytest

from gdn_export.pipeline.convert import convert
from gdn_export.run.runtime import load_tract_model, run_tract
from gdn_export.run.serving import SlotPool
from gdn_export.run.session import Session

from helpers import FAMILIES, FIXTURES, GREEDY, alone, prompts_for, relative_error

PASTS = (5, 0, 70)  # each slot's tokens before the call: a short past, none, one across the 64-token chunk
NEW = (1, 9, 4)  # each row's real tokens in the call (S = 9: rows 0 and 2 padded)

# (fixture, lowering): every family with the CPU default (chunked), the other lowerings on one family each; tract's
# fused op needs K = V and plain GDN, which only fla_gated_deltanet has
CASES = [(name, "chunked") for name in FAMILIES] + [
    ("fla_gated_deltaproduct", "chunked"), ("fla_delta_net", "chunked"),
    ("qwen3_5", "scan"), ("qwen3_5", "recurrent"), ("fla_kda", "scan"), ("fla_gated_deltanet", "native"),
]


def archive(converted, tmp_path, name: str, lowering: str, logits: str = "all"):
    if lowering == "chunked" and logits == "all":
        return converted(name, serving=True)
    path = tmp_path / f"{name}-{lowering}-{logits}.nnef.tgz"
    convert(FIXTURES / name, path, serving=True, lowering=lowering, logits=logits, check=False)
    return path


def served(session: Session, past_len: np.ndarray, seq_len: np.ndarray) -> list[np.ndarray]:
    given = {"past_len": past_len, "seq_len": seq_len}
    return [given[name] for name in session.serving_inputs]


def call(session: Session, plan, pool: SlotPool, slots: list[int], ids: np.ndarray, seq_len) -> np.ndarray:
    """One call of ``plan`` on ``slots`` of ``pool``; the states written back by each row's own count; the logits."""
    seq_len = np.asarray(seq_len, np.int64)
    past_len, states = pool.gather(slots)
    outputs = run_tract(plan, [ids.astype(np.int64), *served(session, past_len, seq_len), *states])
    pool.scatter(slots, outputs[1:1 + len(session.state_specs)], seq_len)  # an MTP archive's hidden last: no state
    return outputs[0]


def filled_pool(session: Session, plan, rng_seed: int = 0) -> SlotPool:
    """Three slots holding pasts of ``PASTS`` tokens, each run alone."""
    pool = SlotPool(session.state_specs, len(PASTS))
    rng = np.random.default_rng(rng_seed)
    vocab = session.metadata["vocab_size"]
    for slot, length in enumerate(PASTS):
        if length:
            call(session, plan, pool, [slot], rng.integers(0, vocab, (1, length)), [length])
    return pool


def state_error(a: np.ndarray, b: np.ndarray) -> float:
    return relative_error(a, b.astype(np.float64)) if a.size else 0.0


@pytest.mark.parametrize("name,lowering", [pytest.param(n, l, marks=pytest.mark.xdist_group(n), id=f"{n}-{l}")
                                           for n, l in CASES])
def test_rows_of_their_own_length_get_what_they_get_alone(name, lowering, converted, tmp_path):
    path = archive(converted, tmp_path, name, lowering)
    session = Session(path)
    one, three = load_tract_model(path, {"B": 1}), load_tract_model(path, {"B": 3})
    batched, single = filled_pool(session, one), filled_pool(session, one)
    rng = np.random.default_rng(1)
    ids = rng.integers(0, session.metadata["vocab_size"], (len(NEW), max(NEW)))  # padding: random ids too
    logits = call(session, three, batched, [0, 1, 2], ids, NEW)
    for slot, count in enumerate(NEW):
        alone_logits = call(session, one, single, [slot], ids[slot:slot + 1, :count], [count])
        error = relative_error(logits[slot, :count], alone_logits[0].astype(np.float64))
        assert error <= 1e-4, f"row {slot} ({count} of {max(NEW)} tokens real): logits {error:.2e}"
    for slot in range(len(PASTS)):
        got, want = batched.snapshot(slot), single.snapshot(slot)
        assert got.length == want.length == PASTS[slot] + NEW[slot]
        for index, (a, b) in enumerate(zip(got.fixed + got.caches, want.fixed + want.caches)):
            assert a.shape == b.shape
            error = state_error(a, b)
            assert error <= 1e-4, f"slot {slot}, state {index}: {error:.2e}"


def test_last_logits_are_each_rows_own_last(converted, tmp_path):
    """With ``--logits last`` the graph returns, per row, the logits of its last real token."""
    full = Session(converted("qwen3_5", serving=True))
    path = archive(converted, tmp_path, "qwen3_5", "chunked", logits="last")
    session = Session(path)
    rng = np.random.default_rng(2)
    ids = rng.integers(0, session.metadata["vocab_size"], (len(NEW), max(NEW)))
    outputs = {}
    for which, s in (("last", session), ("all", full)):
        one, three = load_tract_model(s.path, {"B": 1}), load_tract_model(s.path, {"B": 3})
        outputs[which] = call(s, three, filled_pool(s, one), [0, 1, 2], ids, NEW)
    assert outputs["last"].shape[1] == 1
    for row, count in enumerate(NEW):
        error = relative_error(outputs["last"][row, 0], outputs["all"][row, count - 1].astype(np.float64))
        assert error <= 1e-4, f"row {row}: {error:.2e}"


def test_engine_batched_prefill_pieces(converted):
    """``prefill_rows=3``: prompts of different lengths prefill together (each row its own piece, a prompt of 131
    across three; tests/test_engine.py runs every family with two), and every request's greedy tokens and logits are
    those it gets alone through a Session."""
    from gdn_export.run.generation import TokenRequest
    from gdn_export.run.serving import Engine

    path = converted("qwen3_5", serving=True)
    prompts = prompts_for(path, (3, 131, 64, 70), seed=4)
    with Engine(path, slots=4, buckets=(1, 2, 4), prefill_rows=3, keep_logits=True, prefix_cache_mib=0,
                prefill_piece=64) as engine:
        streams = [engine.submit(TokenRequest(p, 5, GREEDY)) for p in prompts]
        got = [list(s) for s in streams]
        # prompts' pieces ran together (prefill calls of 2 or 3 rows), all on one plan
        stats = engine.stats()
        assert {"prefill x 2", "prefill x 3"} & set(stats["calls"]) and stats["planned"] == ["B, S symbolic"]
    for prompt, events in zip(prompts, got):
        tokens, rows = alone(path, prompt, 5)
        assert [e.token_id for e in events] == tokens, f"prompt of {len(prompt)}"
        assert max(relative_error(e.logits, r) for e, r in zip(events, rows)) <= 1e-4
