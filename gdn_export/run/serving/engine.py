"""``Engine``: many requests served at once over a serving graph, with continuous batching.

An executor (``gdn_export.run.generation.executor``'s interface: ``submit``, ``archive``, ``stats``, ``close``), so
``generate`` and ``gdn-export serve`` run on it unchanged. How it works (docs/SERVING.md):

- every admitted request gets a slot (``SlotPool``): its states live on the host between steps, zeroed at admission,
  or restored from the ``PrefixCache`` when its prompt starts with a snapshotted prefix;
- each worker thread owns ``slots / workers`` slots and loops: admit waiting requests into free slots, run *one
  prefill piece* of the oldest request still in its prompt (``prefill_piece`` tokens, a multiple of the 64-token
  snapshot alignment; with ``prefill_rows`` > 1, of up to that many such requests at once, each row its own
  count of real tokens: the graph's ``seq_len``), then *one decode step* of every request of its slots that has a
  sampled token to run, as one batch (with ``one_plan=False``, padded to the next batch-size bucket with scratch
  rows). A decode row never
  waits for a whole prompt, only for one piece, and is never padded to a piece's length;
- requests join and leave between steps; a finished or cancelled request frees its slot at once;
- one tract plan, with the batch and token counts symbolic, runs every call (one packed copy of the weights; shared
  by the workers: tract's calls release the GIL and spawn a fresh state per call, so workers compute at once on
  different cores); ``one_plan=False`` plans each batch size instead (``Plans``);
- a decode batch that runs the same rows again keeps its recurrent and conv states as tract tensors between steps
  (``SlotPool``'s resident batch).

Exactness: a row's logits depend only on its own slot (padding keys are masked with weight exactly 0, scratch rows
write nothing), so every request gets what it would alone through a batch-1 ``Session`` (tests/test_engine.py).
"""

from __future__ import annotations

import collections
import os
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from gdn_export.errors import GdnExportError
from gdn_export.run.generation.executor import (ArchiveText, ExecutorFull, QueuedExecutor, TokenEvent, TokenRequest,
                                            TokenStream)
from gdn_export.run.generation.sampling import Choice, Sampler
from gdn_export.run.generation.speculative import MTPDrafter, Speculation, draft_session
from gdn_export.run.serving.prefix_cache import ALIGN, PrefixCache
from gdn_export.run.serving.slots import SCRATCH, SlotPool

if TYPE_CHECKING:
    from gdn_export.run.session import Session

DEFAULT_BUCKETS = (1, 2, 4, 8, 16)
MIB = 1 << 20


@dataclass
class _Active:
    """One admitted request in its slot."""

    request: TokenRequest
    stream: TokenStream
    slot: int
    sampler: Sampler
    fed: int = 0  # prompt tokens run through the model
    produced: int = 0
    feed: list[int] = field(default_factory=list)  # to run next: kept drafts not in the states, then the sampled one
    speculation: Speculation | None = None  # the request's drafting (request.speculative)

    @property
    def prefilling(self) -> bool:
        return self.fed < len(self.request.prompt_ids)


def slots_per_worker(slots: int, workers: int) -> list[int]:
    """How ``slots`` split over ``workers`` threads (the first ones take the remainder)."""
    return [slots // workers + (i < slots % workers) for i in range(workers)]


class Plans:
    """The archive planned for the Engine's calls: ``get(batch, tokens)`` returns the runnable a call of ``batch``
    rows of ``tokens`` tokens (None: a prefill piece) runs on, planned on first use or by the Engine's
    ``plan_now``.

    ``one_plan`` (the default): a single plan with tract's symbols ``B`` and ``S`` left symbolic serves every call,
    so the process holds one packed copy of the weights whatever batch sizes run (tract has no way to share packed
    weights between plans: each plan holds its own). Its
    matmuls run as fast as with ``B`` fixed; what a symbolic batch costs is the per-token tail of each GDN layer
    (a scan whose elementwise passes keep tract's generic kernels), measured in docs/SERVING.md.

    ``one_plan=False``: today's earlier scheme, one plan per batch size with ``B`` fixed (and ``S = 1`` for decode
    from 2 rows; one-row steps share the one-row prefill plan): no symbolic-batch cost, one copy of the weights per
    plan. Kept to measure the two side by side (benchmarks/bench_serving.py --per-batch-plans)."""

    ONE = "B, S symbolic"

    def __init__(self, path: os.PathLike, one_plan: bool = True) -> None:
        self.path, self.one_plan = path, one_plan
        self._plans: dict[tuple[int, int | None] | str, object] = {}
        self._locks: collections.defaultdict[object, threading.Lock] = collections.defaultdict(threading.Lock)
        self._lock = threading.Lock()

    def key(self, batch: int, tokens: int | None) -> tuple[int, int | None] | str:
        return self.ONE if self.one_plan else (batch, None if batch == 1 else tokens)

    def get(self, batch: int, tokens: int | None = None):
        key = self.key(batch, tokens)
        plan = self._plans.get(key)
        if plan is not None:
            return plan
        with self._lock:
            lock = self._locks[key]
        with lock:  # one worker plans a size; another needing it waits for that plan
            if key not in self._plans:
                from gdn_export.run.runtime import load_tract_model

                symbols = (None if key == self.ONE else {"B": key[0]} if key[1] is None
                           else {"B": key[0], "S": key[1]})
                self._plans[key] = load_tract_model(self.path, symbols)
            return self._plans[key]

    @property
    def planned(self) -> list[str]:
        if self.one_plan:
            return [self.ONE] if self._plans else []
        return [f"B={b}" + (", S=1" if t else "") for b, t in sorted(self._plans, key=lambda k: (k[1] or 0, k[0]))]


class Engine(QueuedExecutor):
    """Serve concurrent requests over a serving archive (``gdn-export convert --serving``).

    ``slots``: requests computed at once (more wait in a queue of ``max_queue``; beyond it ``submit`` raises
    ``ExecutorFull``); ``workers``: threads, each with ``slots / workers`` slots (1 per core pays: tract's Python
    calls are single-threaded); ``buckets``: the largest is the most rows a decode call runs; with
    ``one_plan=False`` each is planned and a decode batch is padded to the next (with one plan, the default, a
    decode batch runs at its own size);
    ``prefill_piece``: prompt tokens per prefill call (a multiple of 64); ``prefill_rows``: prompts whose pieces run
    together in one call (each its own length; with ``one_plan=False`` each row count is one more plan, with its
    own packed weights); ``prefix_cache_mib``: the prefix cache's bound (0: none); ``plan_now``: plan before
    returning (else on first use, seconds); ``one_plan``: one plan for every call (the default: one packed copy of
    the weights), or a plan per batch size (``Plans``);
    ``keep_logits``: every ``TokenEvent`` carries the logits row its token was sampled from.
    """

    batched = True  # rows share a call: ``generate``'s default drafting is off here (docs/GENERATING.md)

    def __init__(self, model: str | os.PathLike | Session, *, slots: int = 8, workers: int = 1, buckets: tuple[int, ...] | None = None,
                 prefill_piece: int = 128, prefill_rows: int = 1, max_queue: int = 64, prefix_cache_mib: float = 512,
                 plan_now: bool = False, keep_logits: bool = False, one_plan: bool = True) -> None:
        from gdn_export.run.session import Session

        session = model if isinstance(model, Session) else Session(model)
        if not session.serving:
            raise GdnExportError(f"{session.path} has no serving graph: convert it with `gdn-export convert ... "
                                 "--serving` (convert(serving=True)) to serve it with an Engine")
        if workers < 1 or slots < workers:
            raise GdnExportError(f"an Engine needs workers >= 1 and slots >= workers, got slots={slots}, "
                                 f"workers={workers}")
        if prefill_piece < ALIGN or prefill_piece % ALIGN:
            raise GdnExportError(f"prefill_piece must be a positive multiple of {ALIGN} (the prefix cache's "
                                 f"alignment), got {prefill_piece}")
        if prefill_rows < 1:
            raise GdnExportError(f"prefill_rows must be >= 1, got {prefill_rows}")
        if max_queue < 0 or prefix_cache_mib < 0:
            raise GdnExportError(f"max_queue and prefix_cache_mib must be >= 0, got {max_queue}, {prefix_cache_mib}")
        per_worker = slots_per_worker(slots, workers)
        buckets = tuple(sorted(set(buckets or [b for b in DEFAULT_BUCKETS if b < max(per_worker)] +
                                   [max(per_worker)])))
        if not buckets or buckets[0] < 1:
            raise GdnExportError(f"buckets must be positive batch sizes, got {buckets}")
        self.archive = ArchiveText(session)
        self.path = session.path
        self.vocab_size = session.metadata.get("vocab_size")
        self.every_position = session.every_position
        self.slots, self.buckets, self.prefill_piece, self.max_queue = slots, buckets, prefill_piece, max_queue
        self.prefill_rows = min(prefill_rows, max(per_worker))
        self.keep_logits = keep_logits
        self.serving_inputs = session.serving_inputs
        self.metadata = session.metadata
        self.emits_hidden = session.emits_hidden  # an archive with an MTP head (--speculative mtp)
        self.mtp = session.mtp  # its head's metadata where the graph has the hidden output it reads (Session.mtp)
        self.plans = Plans(session.path, one_plan)
        self.calls: collections.Counter[tuple[str, int]] = collections.Counter()  # (kind, rows) -> tract calls
        self.prefix_cache = PrefixCache(int(prefix_cache_mib * MIB))
        self._init_queue()
        from gdn_export.run.integrity import check_archive
        from gdn_export.run.session import check_state_memory

        check_archive(session.path, session.metadata)  # the states against the graph before the slots allocate them
        check_state_memory(session.path, session.state_specs, slots + workers, positions=64)
        self._workers = [_Worker(self, SlotPool(session.state_specs, n), i) for i, n in enumerate(per_worker)]
        if plan_now:  # side by side, a thread per worker (tract's loads release the GIL)
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(max_workers=workers) as pool:
                sizes = {self.plans.key(b, None): (b, None) for b in range(1, self.prefill_rows + 1)}
                sizes.update({self.plans.key(b, 1): (b, 1) for b in buckets})
                for plan in [pool.submit(self.plans.get, *size) for size in sizes.values()]:
                    plan.result()
        for worker in self._workers:
            worker.thread.start()

    # --- the executor interface ---------------------------------------------------------------------------------

    def submit(self, request: TokenRequest) -> TokenStream:
        if self.vocab_size is not None:
            bad = [t for t in request.prompt_ids if not 0 <= t < self.vocab_size]
            if bad:
                raise GdnExportError(f"token id {bad[0]} is outside this model's vocabulary [0, {self.vocab_size})")
        if request.speculative is not None and not self.every_position:
            raise GdnExportError(f"{self.path.name} returns the last position's logits only (converted with --logits "
                                 "last): speculative decoding needs every position's")
        if request.speculative is not None and request.speculative.method == "mtp" and self.mtp is None:
            from gdn_export.run.mtp import no_mtp_message

            raise GdnExportError(no_mtp_message(self.path))
        if request.speculative is not None and request.speculative.method == "mtp":
            from gdn_export.run.mtp import mtp_plan

            mtp_plan(self.path, self.metadata)  # planned (once) in the caller's thread, not in a worker
        if request.speculative is not None and request.speculative.model is not None:
            # planned (once) and its vocabulary checked here, in the caller's thread, not in a worker
            draft_session(request.speculative.model, self.vocab_size)
        with self._lock:
            if self._closed:
                raise GdnExportError("the engine is closed")
            self._pending = collections.deque(item for item in self._pending if not item[1].cancelled)
            if len(self._pending) >= self.max_queue and not self._free_slot_locked():
                raise ExecutorFull(f"all {self.slots} slots are busy and {self.max_queue} requests wait: "
                                   "try again later")
            stream = TokenStream()
            self._pending.append((request, stream))
            self._wake.notify_all()
        return stream

    def stats(self) -> dict:
        with self._lock:
            busy = sum(len(w.active) for w in self._workers)
            return {"workers": len(self._workers), "slots": self.slots, "busy": busy, "queued": len(self._pending),
                    "max_queue": self.max_queue, "buckets": list(self.buckets), "planned": self.plans.planned,
                    "calls": {f"{kind} x {rows}": n for (kind, rows), n in sorted(self.calls.items())},
                    "prefill_piece": self.prefill_piece, "prefill_rows": self.prefill_rows,
                    "prefix_cache": {"entries": len(self.prefix_cache), "bytes": self.prefix_cache.nbytes,
                                     "max_bytes": self.prefix_cache.max_bytes,
                                     "hits": self.prefix_cache.hits, "misses": self.prefix_cache.misses}}

    def close(self) -> None:
        self._close_queue([worker.thread for worker in self._workers], "engine", timeout=30)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _free_slot_locked(self) -> bool:
        return any(w.free for w in self._workers)


class _Worker:
    """One thread and its slots (see the module docstring for its loop)."""

    def __init__(self, engine: Engine, pool: SlotPool, index: int) -> None:
        self.engine, self.pool = engine, pool
        self.free = list(range(pool.slots))
        self.active: list[_Active] = []
        self.thread = threading.Thread(target=self._loop, name=f"gdn_export-engine-{index}", daemon=True)

    def _loop(self) -> None:
        engine = self.engine
        while True:
            with engine._lock:
                while not engine._closed and not self.active and not (engine._pending and self._admissible()):
                    engine._wake.wait()
                if engine._closed:
                    break
                while engine._pending and self._admissible():
                    request, stream = engine._pending.popleft()
                    if not stream.cancelled:
                        self.active.append(self._admit(request, stream))
            self._drop_cancelled()
            prefilling = [a for a in self.active if a.prefilling]
            if prefilling:
                self._step(prefilling[:engine.prefill_rows], self._prefill_piece)
            decoding = [a for a in self.active if a.feed]
            largest = engine.buckets[-1]
            for begin in range(0, len(decoding), largest):
                self._step(decoding[begin:begin + largest], self._decode_step)
        for active in list(self.active):
            self._finish(active, None, GdnExportError("the engine was closed"))

    def _admissible(self) -> bool:
        """Whether this worker takes the next waiting request (engine lock held): it has a free slot and no more
        requests than any other worker with one (requests arriving together spread over the workers)."""
        others = [len(w.active) for w in self.engine._workers if w is not self and w.free]
        return bool(self.free) and (not others or len(self.active) <= min(others))

    def _admit(self, request: TokenRequest, stream: TokenStream) -> _Active:
        slot = self.free.pop(0)
        active = _Active(request, stream, slot, Sampler(request.sampling))
        mtp = request.speculative is not None and request.speculative.method == "mtp"
        if request.speculative is not None:
            drafter = MTPDrafter(self.engine.path, self.engine.metadata, active.sampler) if mtp else None
            active.speculation = Speculation(request.speculative, request.prompt_ids, active.sampler,
                                             self.engine.vocab_size, drafter)
        # an MTP drafter needs the main model's state at every prompt position: a cached prefix has none of them
        snapshot = None if mtp else self.engine.prefix_cache.longest(request.prompt_ids)
        if snapshot is None:
            self.pool.reset(slot)
        else:
            self.pool.restore(slot, snapshot)
            active.fed = snapshot.length
        return active

    def _drop_cancelled(self) -> None:
        for active in [a for a in self.active if a.stream.cancelled]:
            self._release(active)

    def _release(self, active: _Active) -> None:
        self.active.remove(active)
        self.pool.release(active.slot)
        with self.engine._lock:
            self.free.append(active.slot)
            self.engine._wake.notify_all()

    def _finish(self, active: _Active, event: TokenEvent | None, error: BaseException | None = None) -> None:
        """The request's end: its slot is free before its last event is handed over (a reader done with it may
        submit again at once)."""
        self._release(active)
        if event is not None:
            active.stream.put(event)
        active.stream.finish(error)

    def _step(self, rows: list[_Active], step) -> None:
        try:
            step(rows)
        except Exception as err:  # handed to those requests' readers; other slots were not written
            self.pool.drop_resident()
            for active in rows:
                if active in self.active:
                    self._finish(active, None, err)

    def _run(self, kind: str, slots: list[int], ids: np.ndarray, seq_len: np.ndarray,
             inputs_to: list | None = None) -> tuple[np.ndarray, list]:
        """One call of the plan for ``len(slots)`` rows of ``ids.shape[1]`` tokens (one token: a plan with S = 1), row
        b's first ``seq_len[b]`` real: (each row's last real position's logits ``[B, vocab]``, state outputs as
        tract tensors). With ``inputs_to`` (a verify call): every position's logits ``[B, S, vocab]``, and the state
        inputs are appended to that list."""
        from gdn_export.run.runtime import run_tract_tensors

        past_len, states = self.pool.gather(slots)
        if inputs_to is not None:
            inputs_to.extend(states)
        served = {"past_len": past_len, "seq_len": seq_len}
        inputs = [ids.astype(np.int64), *(served[name] for name in self.engine.serving_inputs), *states]
        with self.engine._lock:
            self.engine.calls[kind, len(slots)] += 1
        outputs = run_tract_tensors(self.engine.plans.get(len(slots), 1 if ids.shape[1] == 1 else None), inputs)
        logits = outputs[0].to_numpy()
        if self.engine.emits_hidden:  # an MTP archive's last output, hidden, is no state: its rows go to the drafters
            self.hidden = outputs[-1]  # a tract tensor: copied out only if a row's drafter reads it (_record_hidden)
            outputs = outputs[:-1]
        if inputs_to is not None:
            return logits, outputs[1:]
        if logits.shape[1] > 1:  # every position's logits (an archive without --logits last)
            return logits[np.arange(len(slots)), seq_len - 1], outputs[1:]
        return logits[:, -1], outputs[1:]  # the graph picked each row's last real position

    def _prefill_piece(self, rows: list[_Active]) -> None:
        pieces = []
        for active in rows:
            prompt = active.request.prompt_ids
            pieces.append(prompt[active.fed:min(len(prompt), active.fed + self.engine.prefill_piece)])
        seq_len = np.array([len(piece) for piece in pieces], np.int64)
        ids = np.zeros((len(rows), int(seq_len.max())), np.int64)  # padding tokens: identity steps in the graph
        for b, piece in enumerate(pieces):
            ids[b, :len(piece)] = piece
        slots = [a.slot for a in rows]
        logits, outputs = self._run("prefill", slots, ids, seq_len)
        self.pool.scatter(slots, outputs, seq_len)
        for b, active in enumerate(rows):
            self._record_hidden(active, b, active.fed, int(seq_len[b]))
            prompt, end = active.request.prompt_ids, active.fed + int(seq_len[b])
            active.fed = end
            if end < len(prompt):
                cache = self.engine.prefix_cache
                if cache.wants(prompt[:end]):
                    cache.put(prompt[:end], self.pool.snapshot(active.slot))
                continue
            self._sample(active, logits[b])

    def _decode_step(self, rows: list[_Active]) -> None:
        for active in rows:
            if active.speculation is not None:
                active.speculation.propose(active.request.max_new_tokens - active.produced, len(active.feed) - 1)
        if any(len(a.feed) > 1 or a.speculation is not None and a.speculation.drafts for a in rows):
            self._verify_step(rows)
            return
        plans = self.engine.plans
        bucket = len(rows) if plans.one_plan else next((b for b in self.engine.buckets if b >= len(rows)), len(rows))
        slots = [a.slot for a in rows] + [SCRATCH] * (bucket - len(rows))
        ids = np.asarray([a.feed for a in rows] + [[0]] * (bucket - len(rows)))
        logits, outputs = self._run("decode", slots, ids, np.ones(bucket, np.int64))
        self.pool.scatter(slots, outputs, 1, resident=True)
        for b, active in enumerate(rows):
            if active.speculation is not None:
                self._record_hidden(active, b, len(active.speculation.history) - 1, 1)
            active.feed = []
            if active.stream.cancelled:
                self._release(active)
                continue
            choices = ([active.sampler(logits[b])] if active.speculation is None else
                       active.speculation.judge(logits[b][None]))  # no drafts this step: one token
            self._emit(active, choices, [logits[b]])

    def _verify_step(self, rows: list[_Active]) -> None:
        """One call of every row's tokens (kept drafts not yet in its states, its sampled token, its drafts; each row
        its own length), every position's logits judged; a row whose drafts were not all kept goes back to its
        states before the call (attention caches by length, the fixed states as they were) and runs the kept tokens
        with its next call (``Session.commit``'s rule)."""
        runs = [a.feed + (a.speculation.drafts if a.speculation is not None else []) for a in rows]
        seq_len = np.array([len(run) for run in runs], np.int64)
        ids = np.zeros((len(rows), int(seq_len.max())), np.int64)  # padding tokens: identity steps in the graph
        for b, run in enumerate(runs):
            ids[b, :len(run)] = run
        slots, before = [a.slot for a in rows], []
        self.pool.flush()  # the resident batch's states into the pool: a row going back is restored from there
        lengths = [int(self.pool.lengths[slot]) for slot in slots]
        logits, outputs = self._run("verify", slots, ids, seq_len, inputs_to=before)
        self.pool.scatter(slots, outputs, seq_len)
        for b, active in enumerate(rows):
            run, feed = runs[b], active.feed
            if active.stream.cancelled:
                self._release(active)
                continue
            positions = logits[b, len(feed) - 1:len(run)]  # from the sampled token's position on
            if active.speculation is not None:
                self._record_hidden(active, b, len(active.speculation.history) - len(feed), len(run))
                choices = active.speculation.judge(positions)
            else:
                choices = [active.sampler(positions[0])]
            kept = len(feed) + len(choices) - 1  # the call's tokens that stay: the feed and the kept drafts
            active.feed = [] if kept == len(run) else run[:kept]
            if kept < len(run):
                self.pool.rewind(active.slot, lengths[b], [state[b] for state in before])
            self._emit(active, choices, positions[:len(choices)])

    def _record_hidden(self, active: _Active, row: int, start: int, count: int) -> None:
        """Row ``row`` of the last call's ``hidden`` output (its first ``count`` positions, from sequence position
        ``start``) to the request's MTP drafter, if it has one."""
        if self.engine.emits_hidden and active.speculation is not None and active.speculation.reads_hidden:
            if not isinstance(self.hidden, np.ndarray):
                self.hidden = self.hidden.to_numpy()
            active.speculation.record_hidden(start, self.hidden[row:row + 1, :count])

    def _sample(self, active: _Active, logits: np.ndarray) -> None:
        if active.stream.cancelled:
            self._release(active)
            return
        self._emit(active, [active.sampler(logits)], [logits])

    def _emit(self, active: _Active, choices: list[Choice], rows: list[np.ndarray]) -> None:
        """Hand the request its new tokens in order (``rows``: the logits each was drawn from); the request ends at
        a stop token or at ``max_new_tokens``; the last token is the next call's."""
        request, speculation = active.request, active.speculation
        counts = {} if speculation is None else {"drafted": speculation.drafted, "accepted": speculation.accepted}
        for choice, row in zip(choices, rows):
            active.produced += 1
            if speculation is not None:
                speculation.emitted(choice.token_id)
            finish = ("stop" if choice.token_id in request.stop_token_ids
                      else "length" if active.produced == request.max_new_tokens else None)
            event = TokenEvent(choice, finish, np.array(row, copy=True) if self.engine.keep_logits else None,
                               **counts)
            if finish is not None:
                self._finish(active, event)
                return
            active.stream.put(event)
        active.feed = active.feed + [choices[-1].token_id]
