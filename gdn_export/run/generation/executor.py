"""Executors: what turns a token request into a stream of sampled tokens.

The interface the text side (``generate``, the HTTP server) is written against, small so that issue 11's batched
``Engine`` can replace today's executors without touching anything above it:

- ``executor.submit(TokenRequest) -> TokenStream`` queues one request; it never blocks, and raises ``ExecutorFull``
  when the executor takes no more;
- a ``TokenStream`` yields ``TokenEvent``s (one sampled token each, the last one with its ``finish_reason``) to one
  reader, by plain iteration (blocking) or ``async for``; ``stream.cancel()`` stops the request at its next token
  and frees what it held;
- ``executor.archive`` is what the text side needs from the model (tokenizer, chat template, generation config,
  vocabulary size), ``executor.stats()`` its load, ``executor.close()`` stops it.

Two executors for now, both over ``Session``, one request at a time each:

- ``InlineExecutor(session)``: runs the request in the reading thread, as it is read (``generate`` over a
  ``Session``; the session's states are reset by every request);
- ``WorkerPool(session, workers, max_queue)``: ``workers`` threads, each with a ``Session`` of its own over the one
  tract plan of ``session`` (weights loaded once; tract's calls release the GIL, so the threads compute at once),
  a queue of at most ``max_queue`` waiting requests, ``ExecutorFull`` past that. Requests never share a state.
"""

from __future__ import annotations

import asyncio
import collections
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterator, Protocol

import numpy as np

from gdn_export.errors import GdnExportError
from gdn_export.run.generation.sampling import Choice, Sampler, SamplingParams
from gdn_export.run.generation.speculative import SpeculativeConfig

if TYPE_CHECKING:
    from gdn_export.run.session import Session


# prompt + new tokens of an archive that carries no context length (docs/SERVER.md)
DEFAULT_CONTEXT_LENGTH = 4096
ALLOW_LONG_ENV = "GDN_EXPORT_ALLOW_LONG_MAX_MODEL_LEN"  # vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN
PROMPT_PIECE = 128  # prompt tokens per call when the session sets none: the unit of work between cancellation checks


class ExecutorFull(GdnExportError):
    """Every worker is busy and the queue is full (the HTTP server answers 503)."""


@dataclass(frozen=True)
class TokenRequest:
    """One sequence to continue: its prompt, at most ``max_new_tokens`` new tokens, how they are sampled, and the
    token ids that end it (the stop token is the last token streamed, with finish_reason "stop")."""

    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    sampling: SamplingParams = field(default_factory=lambda: SamplingParams(temperature=0.0))
    stop_token_ids: frozenset[int] = frozenset()
    speculative: SpeculativeConfig | None = None  # drafts verified in one call each step (None: one token a step)

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise GdnExportError("the prompt is empty: at least one token is needed")
        if self.max_new_tokens < 1:
            raise GdnExportError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass(frozen=True)
class TokenEvent:
    """One sampled token; ``finish_reason`` is "stop" (a stop token), "length" (``max_new_tokens`` reached) or None
    (more to come)."""

    choice: Choice
    finish_reason: str | None = None
    logits: np.ndarray | None = None  # the row the token was sampled from, where the executor keeps it (Engine)
    drafted: int = 0  # speculative decoding: tokens drafted for the request so far
    accepted: int = 0  # ... and kept (each one a token that took no call of its own)

    @property
    def token_id(self) -> int:
        return self.choice.token_id


class TokenStream:
    """The tokens of one request, handed from the thread computing them to the one reader, in order.

    Iterate it (blocking) or ``async for`` it (from an asyncio loop: the producer wakes the loop); iteration ends
    after the event carrying a finish reason, when the request is cancelled, or raises the error that stopped the
    request. ``cancel()`` may come from any thread, at any time."""

    def __init__(self) -> None:
        self._events: collections.deque = collections.deque()
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._done = False
        self._error: BaseException | None = None
        self._cancelled = threading.Event()
        self._wake: Callable[[], None] | None = None

    # --- the producer's side ---
    def put(self, event: TokenEvent) -> None:
        with self._lock:
            self._events.append(event)
            self._ready.notify_all()
            wake = self._wake
        if wake is not None:
            wake()

    def finish(self, error: BaseException | None = None) -> None:
        with self._lock:
            if self._done:
                return
            self._done, self._error = True, error
            self._ready.notify_all()
            wake = self._wake
        if wake is not None:
            wake()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    # --- the reader's side ---
    def cancel(self) -> None:
        """Stop the request: its computation ends before its next token; reading ends at once."""
        self._cancelled.set()
        self.finish()

    def _take(self) -> tuple[list[TokenEvent], bool]:
        events = list(self._events)
        self._events.clear()
        return events, self._done

    def __iter__(self) -> Iterator[TokenEvent]:
        while True:
            with self._lock:
                while not self._events and not self._done:
                    self._ready.wait()
                events, done = self._take()
            yield from self._deliver(events)
            if done:
                self._raise()
                return

    async def __aiter__(self):
        loop = asyncio.get_running_loop()
        ready = asyncio.Event()
        with self._lock:
            self._wake = lambda: loop.call_soon_threadsafe(ready.set)
        try:
            while True:
                ready.clear()  # cleared before taking: an event put after the take sets it again
                with self._lock:
                    events, done = self._take()
                for event in self._deliver(events):
                    yield event
                if done:
                    self._raise()
                    return
                if not events:
                    await ready.wait()
        finally:
            with self._lock:
                self._wake = None

    def _deliver(self, events: list[TokenEvent]) -> Iterator[TokenEvent]:
        for event in events:
            if self.cancelled:
                return
            yield event

    def _raise(self) -> None:
        if self._error is not None and not self.cancelled:
            raise self._error


def template_error(template: str | None) -> str | None:
    """Why the chat template does not compile (one line), or None (it compiles, there is none, or jinja2 is not
    installed: a chat says so when asked)."""
    if template is None:
        return None
    try:
        from gdn_export.run.generation.chat import compile_template

        compile_template(template)
    except ImportError:
        return None
    except GdnExportError as err:
        return str(err).strip().splitlines()[0]
    return None


class ArchiveText:
    """What the text side needs from an archive, read once: tokenizer, chat template, generation config, the
    tokenizer config's special tokens (the names a chat template may use), vocabulary size."""

    def __init__(self, session: Session) -> None:
        from gdn_export.run.archive import json_member

        files = session._generation_files()
        self.path = session.path
        self.vocab_size: int | None = session.metadata.get("vocab_size")
        self.every_position = session.every_position  # every new position's logits: what verifying drafts needs
        self.mtp = session.mtp is not None  # the archive carries an MTP head (--speculative mtp)
        # the model's context from the checkpoint's config (None: the archive predates it, or the config gave none)
        self.model_context: int | None = session.metadata.get("context_length")
        self.max_model_len: int = context_bound(self.model_context)  # prompt + new tokens, at most
        self.tokenizer = session.tokenizer
        self.chat_template = session.chat_template
        self.chat_template_error = template_error(self.chat_template)  # refused once, at load: chats get a 400
        if self.chat_template_error is not None:
            self.chat_template = None
        self.generation_config: dict = session.generation_config or {}
        config = json_member(files["tokenizer_config.json"], "tokenizer_config.json", session.path) \
            if "tokenizer_config.json" in files else {}
        self.special_tokens = {}
        for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
            value = config.get(name)
            if isinstance(value, dict):  # an AddedToken as tokenizer_config.json may write it
                value = value.get("content")
            if isinstance(value, str):
                self.special_tokens[name] = value

    @property
    def eos_token_ids(self) -> frozenset[int]:
        ids = self.generation_config.get("eos_token_id")
        if ids is None:
            return frozenset()
        ids = [ids] if not isinstance(ids, list) else ids
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise GdnExportError(f"{self.path}: generation_config.json's eos_token_id must be a token id or a list of "
                                 f"them, got {self.generation_config.get('eos_token_id')!r}")
        return frozenset(ids)

    @property
    def context_note(self) -> str | None:
        """Why the context bound is what it is, when the archive does not give it (None when it does)."""
        if self.model_context is not None:
            return None
        return (f"{self.path.name} carries no context length (converted before gdn-export stored the checkpoint's "
                f"max_position_embeddings, or its config has none): prompt + new tokens are bounded by "
                f"{DEFAULT_CONTEXT_LENGTH} (--max-model-len sets another bound)")

    def limit_context(self, max_model_len: int | None, allow_longer: bool = False) -> None:
        """Bound prompt + new tokens by ``max_model_len`` (vLLM's option): at most the model's context, unless
        ``allow_longer`` (positions past the trained context give untrained outputs)."""
        self.max_model_len = context_bound(self.model_context, max_model_len, allow_longer)


def context_bound(model_context: int | None, max_model_len: int | None = None, allow_longer: bool = False) -> int:
    """Prompt + new tokens at most: ``max_model_len`` where given (checked: an integer >= 1, at most
    ``model_context`` unless ``allow_longer``), else the model's context, else ``DEFAULT_CONTEXT_LENGTH``."""
    if max_model_len is None:
        return model_context or DEFAULT_CONTEXT_LENGTH
    if isinstance(max_model_len, bool) or not isinstance(max_model_len, int) or max_model_len < 1:
        raise GdnExportError(f"max_model_len must be an integer >= 1, got {max_model_len!r}")
    if model_context is not None and max_model_len > model_context and not allow_longer:
        raise GdnExportError(f"max_model_len {max_model_len} is longer than the model's context of {model_context} "
                             f"tokens (its config's max_position_embeddings); set {ALLOW_LONG_ENV}=1 to allow it "
                             "(outputs past the trained context are untrained)")
    return max_model_len


class Executor(Protocol):
    archive: ArchiveText

    def submit(self, request: TokenRequest) -> TokenStream | InlineStream: ...

    def stats(self) -> dict: ...

    def close(self) -> None: ...


def request_tokens(session: Session, request: TokenRequest, cancelled: Callable[[], bool]) -> Iterator[TokenEvent]:
    """Run one request through a batch-1 ``session`` (reset first): prefill, then sample and decode a token at a
    time until a stop token, ``max_new_tokens`` or ``cancelled()`` (asked before every decode step); with
    ``request.speculative``, a step verifies drafts (``speculative.speculative_tokens``)."""
    if request.speculative is not None:
        from gdn_export.run.generation.speculative import speculative_tokens

        yield from speculative_tokens(session, request, cancelled)
        return
    session.reset()
    logits = prefill_pieces(session, request.prompt_ids, cancelled)
    if logits is None:
        return
    sampler = Sampler(request.sampling)
    for produced in range(1, request.max_new_tokens + 1):
        if cancelled():
            return
        choice = sampler(logits)
        finish = ("stop" if choice.token_id in request.stop_token_ids
                  else "length" if produced == request.max_new_tokens else None)
        yield TokenEvent(choice, finish)
        if finish is not None:
            return
        if cancelled():
            return
        logits = session.decode(np.asarray([[choice.token_id]], dtype=np.int64))[0, -1]


def prefill_pieces(session: Session, prompt_ids, cancelled: Callable[[], bool]) -> np.ndarray | None:
    """The last prompt position's logits, the prompt run a piece at a time (the session's ``prefill_piece``, else
    ``PROMPT_PIECE`` tokens) with ``cancelled()`` asked before each piece: a cancelled request stops within one piece,
    whatever the prompt's length (None then). Only the last piece's logits are kept."""
    piece = session.prefill_piece or PROMPT_PIECE
    ids = np.asarray([prompt_ids], dtype=np.int64)
    logits = None
    for begin in range(0, ids.shape[1], piece):
        if cancelled():
            return None
        logits = session.prefill(ids[:, begin:begin + piece])[0, -1]
    return logits


class InlineStream:
    """A request run by the thread that reads it, token by token as it is read."""

    def __init__(self, session: Session, request: TokenRequest) -> None:
        self._cancelled = False
        self._events = request_tokens(session, request, lambda: self._cancelled)

    def __iter__(self) -> Iterator[TokenEvent]:
        return self._events

    def cancel(self) -> None:
        self._cancelled = True
        self._events.close()


class InlineExecutor:
    """Requests run in the caller's thread through one ``Session`` (whose states each request resets)."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self.archive = ArchiveText(session)

    def submit(self, request: TokenRequest) -> InlineStream:
        return InlineStream(self.session, request)

    def stats(self) -> dict:
        return {"workers": 1, "busy": 0, "queued": 0}

    def close(self) -> None:
        pass


class QueuedExecutor:
    """What the threaded executors (``WorkerPool``, ``gdn_export.run.serving.Engine``) share: a queue of waiting
    ``(request, stream)`` pairs under one lock, and closing: waiting requests fail, the threads are joined."""

    def _init_queue(self) -> None:
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._pending: collections.deque = collections.deque()
        self._closed = False

    def _close_queue(self, threads: list[threading.Thread], what: str, timeout: float) -> None:
        with self._lock:
            self._closed = True
            pending, self._pending = list(self._pending), collections.deque()
            self._wake.notify_all()
        for _, stream in pending:
            stream.finish(GdnExportError(f"the {what} was closed"))
        for thread in threads:
            thread.join(timeout=timeout)


class WorkerPool(QueuedExecutor):
    """``workers`` threads, each a ``Session`` of its own sharing ``session``'s tract plan; a request waits in a
    queue of at most ``max_queue`` (``ExecutorFull`` beyond) for the next free worker, which runs it alone."""

    def __init__(self, session: Session, workers: int = 1, max_queue: int = 16) -> None:
        from gdn_export.run.session import Session

        if workers < 1 or max_queue < 0:
            raise GdnExportError(f"a worker pool needs workers >= 1 and max_queue >= 0, got {workers}, {max_queue}")
        self.workers, self.max_queue = workers, max_queue
        self.archive = ArchiveText(session)
        self._sessions = [session] + [Session.sharing_plan(session) for _ in range(workers - 1)]
        self._init_queue()
        self._admitted = 0  # running + waiting
        self._busy = 0
        self._threads = [threading.Thread(target=self._work, args=(s,), name=f"gdn_export-worker-{i}", daemon=True)
                         for i, s in enumerate(self._sessions)]
        for thread in self._threads:
            thread.start()

    def submit(self, request: TokenRequest) -> TokenStream:
        with self._lock:
            if self._closed:
                raise GdnExportError("the executor is closed")
            if self._admitted >= self.workers + self.max_queue and self._pending:
                waiting = len(self._pending)  # requests cancelled while they waited give their place now
                self._pending = collections.deque(item for item in self._pending if not item[1].cancelled)
                self._admitted -= waiting - len(self._pending)
            if self._admitted >= self.workers + self.max_queue:
                raise ExecutorFull(f"all {self.workers} workers are busy and {self.max_queue} requests wait: "
                                   "try again later")
            self._admitted += 1
            stream = TokenStream()
            self._pending.append((request, stream))
            self._wake.notify()
        return stream

    def stats(self) -> dict:
        with self._lock:
            return {"workers": self.workers, "busy": self._busy, "queued": self._admitted - self._busy,
                    "max_queue": self.max_queue}

    def close(self) -> None:
        self._close_queue(self._threads, "executor", timeout=10)

    def _work(self, session: Session) -> None:
        while True:
            with self._lock:
                while not self._pending and not self._closed:
                    self._wake.wait()
                if self._closed:
                    return
                request, stream = self._pending.popleft()
                self._busy += 1
            last, error = None, None
            try:
                for event in request_tokens(session, request, lambda: stream.cancelled or self._closed):
                    if event.finish_reason is not None:
                        last = event  # handed over once the worker is free: a reader done with it may submit again
                    else:
                        stream.put(event)
            except BaseException as err:  # handed to the reader
                error = err
            finally:
                session.reset()  # the request's states are dropped now, not at the next request
                with self._lock:
                    self._busy -= 1
                    self._admitted -= 1
            if last is not None:
                stream.put(last)
            stream.finish(error)
