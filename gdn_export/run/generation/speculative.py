"""Speculative decoding: tokens drafted cheaply, checked by one call of the model over all of them, exact.

Each step runs the last sampled token and up to K drafted tokens in one call (``Session.verify``: every position's
logits). The draft at position i is judged against the logits that precede it (``Sampler.verify``): greedy keeps it
when it is the argmax; sampling keeps it with the standard speculative-sampling rule, so every emitted token is
distributed exactly as plain decoding draws it. The first rejected draft is replaced by the token the rule draws;
when every draft is kept, the last position's logits give one more token. A step thus yields 1 to K + 1 tokens.

Recurrent states cannot be cut back the way an attention cache is cut by length, so a step whose drafts were not
all kept goes back to the states before its call and keeps the accepted tokens *pending* (``Session.commit``): the
next step's call runs them first, with its own tokens, so nothing runs in a call of its own. Exact: the states then
hold exactly the accepted tokens. What it costs is the recomputed tokens in the next call (a verify call of k tokens
costs far less than k one-token calls: benchmarks/bench_speculative.py). A call is bounded to ``2 K + 1`` tokens:
past it the step drafts less.

Drafters: ``ngram`` (prompt lookup, llama.cpp's ``ngram-simple`` and vLLM's ``ngram``): the longest n-gram (from
``prompt_lookup_max`` down to ``prompt_lookup_min`` tokens) ending the text so far (prompt and output) is looked up
at its latest earlier occurrence, and the tokens that followed it there are the draft. ``draft`` (llama.cpp's
``--model-draft``, vLLM's draft model): another archive with the same vocabulary (``model``) continues the text one
token a call, greedy for a greedy request, otherwise sampled with the request's parameters (its distribution q goes
to the rule); its own Session catches up with the tokens kept at the next step and goes back (``Session.restore``)
after drafting.

Seeded sampling stays reproducible (the same seed, the same tokens with the same options) but draws other tokens
than plain decoding with that seed: the rule uses the random generator differently (the distribution is the same).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

import numpy as np

from gdn_export.run.generation.sampling import Choice, Sampler, SamplingError, filtered_probabilities
from gdn_export.run.integrity import ArchiveCache

if TYPE_CHECKING:
    from gdn_export.run.generation.executor import TokenEvent, TokenRequest
    from gdn_export.run.session import Session

METHODS = ("ngram", "draft", "mtp")
# vLLM's other names of the MTP method (its speculative_config "method"), read as "mtp"
MTP_ALIASES = ("qwen3_next_mtp", "qwen3_5_mtp", "deepseek_mtp")
MAX_DRAFT = 64  # drafted tokens per step at most (llama.cpp's --draft-max goes as far)
# an MTP head's drafts per step at most: each draft past the first is one more chained call of the head, and draft i
# is kept only if the i - 1 before it were. At 0.8 kept per draft (above the ~0.7 reported for published Qwen3.5
# heads' first draft; 0.44 on the trained fixture's, decaying when chained) draft 9 is kept with probability 0.13,
# less than its own head call costs (0.17x of the 0.8B int8 model's step for an int8 head, 0.30x float32:
# docs/PERFORMANCE.md) before its place in the verify call. vLLM defaults to the checkpoint's depth (1) and warns
# above it; the published Qwen3-Next recipe drafts 2.
MAX_MTP_DRAFT = 8


class SpeculativeError(SamplingError):
    """A speculative-decoding option out of its range (the message names it; ``param`` the field)."""


@dataclass(frozen=True)
class SpeculativeConfig:
    """How one request drafts: ``method`` (``"ngram"``: prompt lookup; ``"draft"``: a draft archive; ``"mtp"``: the
    archive's own MTP head, vLLM's ``"qwen3_next_mtp"`` too), ``num_speculative_tokens`` K (at most K
    drafts per step; ``--draft-max``), and the n-gram sizes looked up, longest first (vLLM's
    ``prompt_lookup_max``/``prompt_lookup_min``). The names are vLLM's ``speculative_config``'s."""

    method: str = "ngram"
    # 3: with the drafted-from token a verify call of 4, one short chunk of the chunked tail (TAIL_CHUNK); K = 4
    # calls open a second one (1.36-1.38x a step against 1.11-1.15x): bench_speculative.py at 0.8B int8
    num_speculative_tokens: int = 3
    prompt_lookup_max: int = 3
    prompt_lookup_min: int = 2  # 1-token matches draft often and are kept rarely: bench_speculative.py
    model: str | None = None  # method "draft": the draft archive's path

    def __post_init__(self) -> None:
        if self.method in MTP_ALIASES:
            object.__setattr__(self, "method", "mtp")
        if self.method not in METHODS:
            raise SpeculativeError(f"speculative method must be one of {', '.join(METHODS)}, got {self.method!r}",
                                   "method")
        if (self.method == "draft") != (self.model is not None):
            raise SpeculativeError("method draft takes the draft archive as model (and only it does)", "model")
        most = MAX_MTP_DRAFT if self.method == "mtp" else MAX_DRAFT
        for name, low, high in (("num_speculative_tokens", 1, most), ("prompt_lookup_max", 1, 64),
                                ("prompt_lookup_min", 1, 64)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                chained = (" for method mtp (each draft is one more chained call of the MTP head; later ones are "
                           "rarely kept)" if name == "num_speculative_tokens" and self.method == "mtp" else "")
                raise SpeculativeError(f"{name} must be an integer in [{low}, {high}]{chained}, got {value!r}", name)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise SpeculativeError(f"prompt_lookup_min ({self.prompt_lookup_min}) must be <= prompt_lookup_max "
                                   f"({self.prompt_lookup_max})", "prompt_lookup_min")

    @property
    def max_call(self) -> int:
        """Tokens one verify call runs at most (pending tokens, the sampled one and drafts)."""
        return 2 * self.num_speculative_tokens + 1


# What a request that names no drafting gets: the first of these methods the archive can run ("mtp" needs an MTP
# head; every method needs every position's logits). Chosen from benchmarks/bench_speculative.py on held-out code
# and prose (docs/PERFORMANCE.md, "Speculative decoding by default"): a method is here only where it never lost to
# plain decoding by more than the measurement's noise on either.
DEFAULT_METHODS: tuple[str, ...] = ("ngram",)
DEFAULT = "default"  # generate(speculative=DEFAULT), serve's default: the archive's default drafting


def default_speculative(every_position: bool, has_mtp: bool,
                        methods: Sequence[str] = DEFAULT_METHODS) -> SpeculativeConfig | None:
    """The drafting of a request that names none: the first of ``methods`` that the archive can run, at
    ``SpeculativeConfig``'s default settings; None (plain decoding) where it can run none (an archive converted with
    ``--logits last``, or only ``mtp`` listed and no head)."""
    if not every_position:
        return None
    for method in methods:
        if method != "mtp" or has_mtp:
            return SpeculativeConfig(method)
    return None


def resolve_speculative(speculative, every_position: bool, has_mtp: bool) -> SpeculativeConfig | None:
    """``speculative`` as a request runs it: ``DEFAULT`` becomes the archive's default drafting
    (``default_speculative``); a ``SpeculativeConfig`` or None (no drafts) stays as it is."""
    if isinstance(speculative, str) and speculative == DEFAULT:
        return default_speculative(every_position, has_mtp)
    return speculative


def propose_ngram(history: Sequence[int], count: int, longest: int, shortest: int = 1) -> list[int]:
    """Up to ``count`` tokens that followed the latest earlier occurrence of the longest n-gram (``longest`` down to
    ``shortest`` tokens) that ends ``history``; [] when none occurs earlier."""
    if count < 1 or len(history) < shortest + 1:
        return []
    tokens = np.asarray(history, np.int64)
    end = len(tokens)
    for n in range(min(longest, end - 1), shortest - 1, -1):
        # windows starting at 0 .. end - n - 1: every earlier occurrence (the suffix itself excluded)
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:end - 1], n)
        hits = np.flatnonzero((windows == tokens[end - n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return [int(t) for t in tokens[start:start + count]]
    return []


_DRAFT_PLANS = ArchiveCache()  # a draft archive's Session by archive file (see draft_session)


def draft_session(path: str, vocab_size: int | None) -> Session:
    """A Session of its own over the draft archive ``path``'s one tract plan (planned on first use, then shared by
    every request of the process, as ``WorkerPool``'s workers share theirs; a file replaced at ``path`` is planned
    again, a failure remembered); its vocabulary must be the model's."""
    from gdn_export.errors import GdnExportError
    from gdn_export.run.session import Session

    def plan() -> Session:
        session = Session(path)
        session._runnable(1)  # planned now: under the cache's lock, once
        return session

    base = _DRAFT_PLANS.get(path, plan)
    draft_vocab = base.metadata.get("vocab_size")
    if draft_vocab != vocab_size:
        raise GdnExportError(f"the draft archive {path} has a vocabulary of {draft_vocab} tokens, the model "
                             f"{vocab_size}: a draft model needs the model's tokenizer")
    return Session.sharing_plan(base)


def chain_drafts(sampler: Sampler, logits: np.ndarray, count: int,
                 step: Callable[[int], np.ndarray]) -> tuple[list[int], list[np.ndarray] | None]:
    """``count`` drafts, each from the logits before it: the argmax for a greedy request, else a draw from the
    request's filtered distribution q (returned per draft: the rule's q); ``step(draft)`` gives the logits after a
    draft (not called after the last). What a draft model and an MTP head share."""
    params = sampler.params
    greedy = params.greedy or params.top_k == 1
    drafts, probabilities = [], []
    for i in range(count):
        if greedy:
            drafts.append(int(np.argmax(logits)))
        else:
            probabilities.append(filtered_probabilities(logits, params))
            drafts.append(sampler._draw(probabilities[-1]))
        if i + 1 < count:
            logits = step(drafts[-1])
    return drafts, None if greedy else probabilities


class DraftModel:
    """Drafts from a draft archive's Session: it runs the tokens it has not seen (the prompt, then each step's kept
    tokens) in one call, drafts one token a call, and goes back to its states before the drafts."""

    def __init__(self, session: Session, sampler: Sampler) -> None:
        self.session, self.sampler = session, sampler
        self.seen = 0  # tokens of the history in the draft session's states

    def propose(self, history: list[int], count: int) -> tuple[list[int], list[np.ndarray] | None]:
        from gdn_export.run.generation.executor import prefill_pieces

        if count < 1:
            return [], None
        session = self.session
        if self.seen == 0:
            session.reset()
        # the history the draft has not seen, a piece at a time, only the last piece's logits kept
        logits = prefill_pieces(session, history[self.seen:], lambda: False)
        self.seen = len(history)
        before = session.checkpoint()
        drafts = chain_drafts(self.sampler, logits, count,
                              lambda draft: session.prefill(np.asarray([[draft]], np.int64))[0, -1])
        session.restore(before)
        return drafts


class MTPDrafter:
    """Drafts with the archive's MTP head (``gdn_export.run.mtp``): its cache holds one entry per position t whose
    main-model state ``h_t`` and next token are known; each step first runs the positions gained since (their ``h_t``
    from the main model's calls, told through ``Session.on_hidden``), whose last output drafts the first token, then
    chains: the MTP's own ``mtp_hidden`` and the draft make the next draft. The chained entries are cut off after
    drafting (they are rebuilt from the main model's states once those tokens are verified)."""

    def __init__(self, path, metadata: dict, sampler: Sampler) -> None:
        from gdn_export.run.mtp import MTPRunner

        self.runner, self.sampler = MTPRunner(path, metadata), sampler
        self.rows: dict[int, np.ndarray] = {}  # position -> the main model's hidden there, not yet in the cache

    def record(self, start: int, hidden: np.ndarray) -> None:
        """The main model's states after its final norm at positions ``start ...`` (batch 1); later calls at the same
        positions (a rejected draft's, then its replacement's) overwrite them. Each row is copied: a view would keep
        the whole output of its call alive (an Engine's: every row of the batch) until the row is used."""
        for i, row in enumerate(hidden[0]):
            if start + i >= self.runner.length:
                self.rows[start + i] = row.copy()

    def propose(self, history: list[int], count: int) -> tuple[list[int], list[np.ndarray] | None]:
        if count < 1:
            return [], None
        done, end = self.runner.length, len(history) - 1  # positions [done, end) have h_t and their next token
        logits, hidden = self.runner.run(np.stack([self.rows.pop(t) for t in range(done, end)]),
                                         history[done + 1:end + 1])

        def step(draft: int) -> np.ndarray:
            nonlocal hidden
            logits, hidden = self.runner.run(hidden[-1:], [draft])
            return logits[-1]

        drafts = chain_drafts(self.sampler, logits[-1], count, step)
        self.runner.truncate(end)
        return drafts


class Speculation:
    """One request's drafting and judging: the text so far (prompt and emitted tokens) and its counts."""

    def __init__(self, config: SpeculativeConfig, prompt_ids: Sequence[int], sampler: Sampler,
                 vocab_size: int | None = None, model: MTPDrafter | None = None) -> None:
        self.config, self.sampler = config, sampler
        self.history = list(prompt_ids)
        self.drafts: list[int] = []
        self.probabilities: list[np.ndarray] | None = None  # a draft model's q of each draft (None: certain drafts)
        self.drafted = self.accepted = 0
        # what drafts (None: prompt lookup); an MTP drafter is made by the caller before the prompt runs (it records
        # the prompt's hidden states)
        self.model = (DraftModel(draft_session(config.model, vocab_size), sampler) if config.method == "draft"
                      else model)

    def emitted(self, token: int) -> None:
        self.history.append(token)

    @property
    def reads_hidden(self) -> bool:
        """Whether the drafter reads the main model's ``hidden`` output (MTP)."""
        return isinstance(self.model, MTPDrafter)

    def record_hidden(self, start: int, hidden: np.ndarray) -> None:
        """The main model's ``hidden`` output ``[1, n, H]`` at positions ``start ...``, for an MTP drafter."""
        if self.reads_hidden:
            self.model.record(start, hidden)

    def propose(self, remaining: int, pending: int) -> list[int]:
        """The drafts of the next step: at most K, at most ``remaining - 1`` (the step emits one token more than the
        drafts it keeps), within ``max_call`` with ``pending`` tokens and the sampled one run in the same call."""
        config = self.config
        count = min(config.num_speculative_tokens, remaining - 1, config.max_call - pending - 1)
        if self.model is not None:
            self.drafts, self.probabilities = self.model.propose(self.history, count)
        else:
            self.drafts = propose_ngram(self.history, count, config.prompt_lookup_max, config.prompt_lookup_min)
        return self.drafts

    def judge(self, rows: np.ndarray) -> list[Choice]:
        """The step's tokens from its logits ``rows`` [1 + drafts, vocab] (the sampled token's position first): the
        kept drafts, then the token that replaces the first rejected one, or one more after all of them."""
        choices = []
        for i, (row, draft) in enumerate(zip(rows, self.drafts)):
            choice = self.sampler.verify(row, draft, None if self.probabilities is None else self.probabilities[i])
            choices.append(choice)
            if choice.token_id != draft:
                break
        else:
            choices.append(self.sampler(rows[len(self.drafts)]))
        self.drafted += len(self.drafts)
        self.accepted += len(choices) - 1
        return choices


def speculative_tokens(session: Session, request: TokenRequest, cancelled: Callable[[], bool]) -> Iterator[TokenEvent]:
    """``executor.request_tokens`` with drafts: the same events, through ``Session.verify`` and ``commit``."""
    from gdn_export.errors import GdnExportError

    if not session.every_position:
        raise GdnExportError(f"{session.path.name} returns the last position's logits only (converted with --logits "
                             "last): speculative decoding needs every position's")
    if request.speculative.method == "mtp" and session.mtp is None:
        from gdn_export.run.mtp import no_mtp_message

        raise GdnExportError(no_mtp_message(session.path))
    session.reset()
    sampler = Sampler(request.sampling)
    drafter = None
    if request.speculative.method == "mtp":  # listening before the prompt runs: its states are the first drafts'
        drafter = MTPDrafter(session.path, session.metadata, sampler)
        session.on_hidden = drafter.record
    try:
        yield from _speculative_steps(session, request, cancelled, sampler, drafter)
    finally:  # the drafter (its head's KV cache, its rows) goes with the request, not with the session's next reset
        if drafter is not None and session.on_hidden == drafter.record:
            session.on_hidden = None


def _speculative_steps(session: Session, request: TokenRequest, cancelled: Callable[[], bool], sampler: Sampler,
                       drafter: MTPDrafter | None) -> Iterator[TokenEvent]:
    from gdn_export.run.generation.executor import TokenEvent, prefill_pieces

    logits = prefill_pieces(session, request.prompt_ids, cancelled)
    if logits is None:
        return
    speculation = Speculation(request.speculative, request.prompt_ids, sampler, session.metadata.get("vocab_size"),
                              drafter)
    choices, produced = [sampler(logits)], 0
    while True:
        for choice in choices:
            if cancelled():
                return
            produced += 1
            speculation.emitted(choice.token_id)
            finish = ("stop" if choice.token_id in request.stop_token_ids
                      else "length" if produced == request.max_new_tokens else None)
            yield TokenEvent(choice, finish, drafted=speculation.drafted, accepted=speculation.accepted)
            if finish is not None:
                return
        if cancelled():
            return
        drafts = speculation.propose(request.max_new_tokens - produced, session.pending)
        rows = session.verify(np.asarray([[choices[-1].token_id, *drafts]], np.int64))[0]
        choices = speculation.judge(rows)
        session.commit(len(choices))  # the sampled token and the kept drafts; the last choice is run next step
