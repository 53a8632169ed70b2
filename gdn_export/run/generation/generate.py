"""``generate``: text or token ids in, tokens (with their text) out as they are sampled.

    for token in gdn_export.generate(session, "Hello", max_new_tokens=32, temperature=0):
        print(token.text, end="", flush=True)

It works over anything with the executor interface (``gdn_export.run.generation.executor``): a ``Session`` (run in
the calling thread), a ``WorkerPool``, later issue 11's ``Engine``. The text side (``Generation``) is separate from
the iteration so that the HTTP server drives it from asyncio with the same rules.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Iterator, Sequence

from gdn_export.errors import GdnExportError
from gdn_export.run.generation.executor import ArchiveText, InlineExecutor, TokenEvent, TokenRequest
from gdn_export.run.generation.sampling import SamplingParams
from gdn_export.run.generation.speculative import DEFAULT, SpeculativeConfig, resolve_speculative
from gdn_export.run.generation.text import Detokenizer, StopStrings

DEFAULT_MAX_NEW_TOKENS = 256


class RequestError(GdnExportError):
    """A request that cannot run as asked (the message says why; ``param`` names the argument at fault)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ContextLengthError(RequestError):
    """Prompt + new tokens exceed the model's context (``ArchiveText.max_model_len``): OpenAI's
    ``context_length_exceeded``."""

    code = "context_length_exceeded"


@dataclass(frozen=True)
class GeneratedToken:
    """One generated token. ``text`` is the text it completes ("" while held back: part of a UTF-8 character, or
    text that may begin a stop string; the last token carries what was held). ``finish_reason`` is None until the
    last token: "stop" (a stop token, which adds no text, or a stop string, cut off with what follows it) or
    "length"; ``stop_reason`` is the stop token id or stop string matched. ``offset`` is where the token's text
    begins in the generated text."""

    index: int
    token_id: int
    text: str
    offset: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


def sampling_from(generation_config: dict | None, temperature: float | None = None, top_k: int | None = None,
                  top_p: float | None = None, seed: int | None = None, logprobs: int | None = None) -> SamplingParams:
    """The request's sampling: what it gives, the rest from the checkpoint's generation_config.json as
    transformers' ``generate`` reads it (``do_sample`` true: its temperature, top_k, top_p; otherwise greedy).
    Where the defaults are greedy and the request gives top_k, top_p or a seed but no temperature, it samples at
    temperature 1 (vLLM's and OpenAI's default temperature)."""
    config = generation_config or {}
    sample = bool(config.get("do_sample"))
    if temperature is None:
        if sample:
            temperature = config.get("temperature", 1.0)
        else:
            temperature = 1.0 if (top_k not in (None, 0, -1) or top_p not in (None, 1, 1.0) or seed is not None) else 0.0
    if sample:
        top_k = config.get("top_k") if top_k is None else top_k
        top_p = config.get("top_p") if top_p is None else top_p
    return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, logprobs=logprobs)


def tokenized(archive: ArchiveText, text: str, add_special_tokens: bool, param: str) -> list[int]:
    """``text``'s token ids through the archive's tokenizer, refused before tokenizing when it is certainly longer
    than the context (more characters than ``max_model_len`` tokens of the vocabulary's longest can hold:
    tokenizing megabytes takes seconds and about 200 bytes of memory per character). ``encode_batch`` releases the
    GIL (``encode`` holds it), so a server's event loop keeps answering meanwhile."""
    check_text(text, param)
    limit = getattr(archive, "max_model_len", None)
    if limit is not None and len(text) > limit * longest_token(archive.tokenizer):
        raise ContextLengthError(f"This model's maximum context length is {limit} tokens; the {param} has "
                                 f"{len(text)} characters, more than {limit} tokens can hold. Please reduce the "
                                 f"length of the {param}.", param)
    return archive.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids


def check_text(text: str, param: str) -> None:
    """``text`` is Unicode text: a lone UTF-16 surrogate (a JSON ``"\\ud800"``, an undecodable byte of a command
    line) reaches no tokenizer."""
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as err:
            raise RequestError(f"the {param} holds a lone surrogate (U+{ord(text[err.start]):04X}) at character "
                               f"{err.start}, which is not Unicode text", param) from None


# What a request may ask to be matched against every token's text (OpenAI takes at most 4 stop strings; vLLM any
# number, matched on its event loop's side in C++ speed): 32 strings of 4096 characters in all keep the matching
# below a millisecond a token, wherever it runs. Stop token ids: a set lookup a token, bounded for the set's build.
MAX_STOP_STRINGS = 32
MAX_STOP_CHARS = 4096
MAX_STOP_TOKEN_IDS = 1024


def check_stops(stops: Sequence[str], stop_token_ids: Sequence[int] | None = None) -> None:
    """The request's stop strings and stop token ids within ``MAX_STOP_*``: a RequestError naming the field."""
    if len(stops) > MAX_STOP_STRINGS:
        raise RequestError(f"stop has {len(stops)} strings, more than the {MAX_STOP_STRINGS} a request may give",
                           "stop")
    total = sum(len(s) for s in stops)
    if total > MAX_STOP_CHARS:
        raise RequestError(f"stop strings have {total} characters in all, more than the {MAX_STOP_CHARS} a request "
                           "may give", "stop")
    for stop in stops:
        check_text(stop, "stop")
    if stop_token_ids is not None and len(stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise RequestError(f"stop_token_ids has {len(stop_token_ids)} ids, more than the {MAX_STOP_TOKEN_IDS} a "
                           "request may give", "stop_token_ids")


@functools.lru_cache(maxsize=8)
def longest_token(tokenizer) -> int:
    """The most characters one token of ``tokenizer`` decodes to (its longest vocabulary entry, added tokens
    included: a byte-level entry has one character per byte), computed once per tokenizer."""
    return max((len(token) for token in tokenizer.get_vocab(with_added_tokens=True)), default=1)


def prompt_ids_of(archive: ArchiveText, prompt: str | Sequence[int], param: str = "prompt") -> tuple[int, ...]:
    """A text prompt through the archive's tokenizer (with its special tokens, as transformers' ``tokenizer(text)``),
    or token ids, checked against the vocabulary."""
    if isinstance(prompt, str):
        if archive.tokenizer is None:
            raise RequestError(f"{archive.path} carries no tokenizer: give the prompt as token ids", param)
        ids = tuple(tokenized(archive, prompt, True, param))
        if not ids:
            raise RequestError(f"{param} makes no tokens (it is empty, or holds only characters the tokenizer has "
                               "no token for)", param)
    else:
        try:
            ids = tuple(prompt)
        except TypeError:
            raise RequestError(f"{param} must be a string or a list of token ids", param) from None
        if any(isinstance(i, bool) or not isinstance(i, int) and not hasattr(i, "__index__") for i in ids):
            raise RequestError(f"{param} must be a string or a list of integer token ids", param)
        ids = tuple(int(i) for i in ids)
    if not ids:
        raise RequestError(f"{param} is empty: at least one token is needed", param)
    vocab = archive.vocab_size
    bad = [i for i in ids if i < 0 or (vocab is not None and i >= vocab)]
    if bad:
        raise RequestError(f"token id {bad[0]} is outside this model's vocabulary [0, {vocab})", param)
    return ids


class Generation:
    """The text side of one request: built from the request's arguments, fed the executor's events in order.

    ``step(event)`` returns the ``GeneratedToken`` for the event; after one with a finish reason the request is
    over (``done``); when a stop string ends it, the caller cancels the executor's stream (``generate`` does)."""

    def __init__(self, archive: ArchiveText, prompt: str | Sequence[int], max_new_tokens: int | None = None, *,
                 temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
                 seed: int | None = None, logprobs: int | None = None, stop: str | Sequence[str] | None = None,
                 stop_token_ids: Sequence[int] | None = None, sampling: SamplingParams | None = None,
                 default_new_tokens: int | None = None, prompt_param: str = "prompt",
                 tokens_param: str = "max_new_tokens", speculative: SpeculativeConfig | str | None = DEFAULT) -> None:
        self.archive = archive
        self.prompt_ids = prompt_ids_of(archive, prompt, prompt_param)
        if max_new_tokens is not None and (isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int)
                                           or max_new_tokens < 1):
            raise RequestError(f"{tokens_param} must be an integer >= 1, got {max_new_tokens!r}", tokens_param)
        max_new_tokens = self._bounded(max_new_tokens, default_new_tokens, prompt_param, tokens_param)
        if sampling is None:
            sampling = sampling_from(archive.generation_config, temperature, top_k, top_p, seed, logprobs)
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if any(not isinstance(s, str) for s in stops):
            raise RequestError("stop must be a string or a list of strings", "stop")
        check_stops(stops, stop_token_ids)
        if stops and archive.tokenizer is None:
            raise RequestError(f"stop strings need a tokenizer and {archive.path} carries none: use stop token ids",
                               "stop")
        stop_ids = archive.eos_token_ids if stop_token_ids is None else frozenset(int(i) for i in stop_token_ids)
        speculative = resolve_speculative(speculative, archive.every_position, archive.mtp)
        if speculative is not None and not isinstance(speculative, SpeculativeConfig):
            raise RequestError(f"speculative must be a SpeculativeConfig, {DEFAULT!r} or None, got "
                               f"{type(speculative).__name__}", "speculative")
        self.request = TokenRequest(self.prompt_ids, max_new_tokens, sampling, stop_ids, speculative)
        tokenizer = archive.tokenizer
        self._detokenizer = Detokenizer(tokenizer, self.prompt_ids) if tokenizer is not None else None
        self._stops = StopStrings(stops)
        self.token_ids: list[int] = []
        self.text = ""  # the text returned so far
        self._decoded = 0  # length of the detokenized text so far
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.drafted = self.accepted = 0  # speculative decoding's counts (TokenEvent's)

    def _bounded(self, max_new_tokens: int | None, default: int | None, prompt_param: str, tokens_param: str) -> int:
        """``max_new_tokens`` checked against the context (``archive.max_model_len``: prompt + new tokens), or, when
        not given, the default (``default``, else generation_config.json's ``max_new_tokens``, else 256) lowered to
        what the context leaves."""
        limit = getattr(self.archive, "max_model_len", None)
        prompt = len(self.prompt_ids)
        if limit is not None and prompt >= limit:
            raise ContextLengthError(f"This model's maximum context length is {limit} tokens; the {prompt_param} has "
                                     f"{prompt} tokens, which leaves no room for a new one. Please reduce the length of "
                                     f"the {prompt_param}.", prompt_param)
        if max_new_tokens is None:
            config_default = self.archive.generation_config.get("max_new_tokens")
            if isinstance(config_default, bool) or not isinstance(config_default, int) or config_default < 1:
                config_default = None
            max_new_tokens = default or config_default or DEFAULT_MAX_NEW_TOKENS
            return max_new_tokens if limit is None else min(max_new_tokens, limit - prompt)
        if limit is not None and prompt + max_new_tokens > limit:
            raise ContextLengthError(f"This model's maximum context length is {limit} tokens. However, you requested "
                                     f"{prompt + max_new_tokens} tokens ({prompt} in the {prompt_param}, "
                                     f"{max_new_tokens} in the completion). Please reduce the length of the "
                                     f"{prompt_param} or {tokens_param}.", tokens_param)
        return max_new_tokens

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def step(self, event: TokenEvent) -> GeneratedToken:
        if self.done:
            raise GdnExportError("this generation is finished")
        token = event.token_id
        self.token_ids.append(token)
        self.drafted, self.accepted = event.drafted, event.accepted
        finish, stop_reason = event.finish_reason, token if event.finish_reason == "stop" else None
        offset = self._decoded
        if self._detokenizer is None:
            piece = ""
        else:
            new = self._detokenizer.add(token) if finish != "stop" else ""  # a stop token adds no text
            if finish is not None:
                new += self._detokenizer.flush()
            self._decoded += len(new)
            piece = self._stops.add(new)
            if self._stops.matched is not None:
                finish, stop_reason = "stop", self._stops.matched
            elif finish is not None:
                piece += self._stops.flush()
        self.text += piece
        self.finish_reason, self.stop_reason = finish, stop_reason
        return GeneratedToken(len(self.token_ids) - 1, token, piece, offset, event.choice.logprob,
                              event.choice.top_logprobs, finish, stop_reason)

    def token_text(self, token_id: int) -> str:
        """One token alone as text (for logprobs), or ``token_id:N`` without a tokenizer (vLLM's spelling)."""
        if self.archive.tokenizer is None:
            return f"token_id:{token_id}"
        return self.archive.tokenizer.decode([token_id], skip_special_tokens=False)


def as_executor(model):
    """A ``Session`` becomes an ``InlineExecutor``; anything with ``submit`` and ``archive`` is taken as it is."""
    from gdn_export.run.session import Session

    if isinstance(model, Session):
        return InlineExecutor(model)
    if hasattr(model, "submit") and hasattr(model, "archive"):
        return model
    raise GdnExportError(f"generate takes a Session or an executor, got {type(model).__name__}")


def generate(model, prompt: str | Sequence[int], max_new_tokens: int | None = None, *,
             temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
             seed: int | None = None, logprobs: int | None = None, stop: str | Sequence[str] | None = None,
             stop_token_ids: Sequence[int] | None = None,
             speculative: SpeculativeConfig | str | None = DEFAULT) -> Iterator[GeneratedToken]:
    """Continue ``prompt`` (text, through the archive's tokenizer, or token ids) on ``model`` (a ``Session``, whose
    states it resets, or an executor), yielding each token as it is sampled; the last one has a ``finish_reason``.

    ``max_new_tokens`` defaults to generation_config.json's, else 256. Sampling: ``temperature`` 0 is greedy;
    ``top_k``, ``top_p``, ``seed`` (reproducible draws); unset ones come from generation_config.json
    (``sampling_from``). ``logprobs`` N: each token's logprob and the N most probable alternatives'.
    ``stop_token_ids`` default to generation_config.json's ``eos_token_id``; ``stop`` strings end the text before
    them (OpenAI's rule). ``speculative``: drafts verified in one call per step (``SpeculativeConfig``; greedy output
    token-identical, sampled output distributed as without; docs/GENERATING.md); the default, ``"default"``, is the
    archive's default drafting (``speculative.default_speculative``) on a Session or a pool of them, plain decoding on
    an Engine (batched rows: not measured with drafts), None decodes without drafts. Bad arguments
    raise here
    (``RequestError``, ``SamplingError``); closing the iterator early cancels the request."""
    executor = as_executor(model)
    if isinstance(speculative, str) and speculative == DEFAULT and getattr(executor, "batched", False):
        # an Engine's batch: a drafting row lengthens every row's call, which no benchmark here measured
        speculative = None
    generation = Generation(executor.archive, prompt, max_new_tokens, temperature=temperature, top_k=top_k,
                            top_p=top_p, seed=seed, logprobs=logprobs, stop=stop, stop_token_ids=stop_token_ids,
                            speculative=speculative)
    return Tokens(generation, executor.submit(generation.request))


class Tokens:
    """``generate``'s iterator: the request's ``GeneratedToken``s as they are sampled; ``generation`` is its text
    side (token ids, text, and speculative decoding's ``drafted`` and ``accepted`` counts); ``close()`` cancels."""

    def __init__(self, generation: Generation, stream) -> None:
        self.generation = generation

        def tokens() -> Iterator[GeneratedToken]:
            try:
                for event in stream:
                    token = generation.step(event)
                    yield token
                    if token.finish_reason is not None:
                        return
            finally:
                stream.cancel()

        self._tokens = tokens()

    def __iter__(self) -> Tokens:
        return self

    def __next__(self) -> GeneratedToken:
        return next(self._tokens)

    def close(self) -> None:
        self._tokens.close()


def chat_prompt_ids(archive: ArchiveText, messages) -> tuple[int, ...]:
    """The prompt ids of a chat: the archive's chat template rendered over ``messages`` with
    ``add_generation_prompt=True``, tokenized without adding special tokens (transformers'
    ``apply_chat_template(messages, add_generation_prompt=True)``)."""
    from gdn_export.run.generation.chat import render_chat

    if getattr(archive, "chat_template_error", None):
        raise RequestError(f"{archive.path.name}: {archive.chat_template_error} (chats are refused; completions "
                           "are not affected)", "messages")
    if archive.chat_template is None:
        raise RequestError(f"{archive.path.name} carries no chat template: use a completion with a prompt instead",
                           "messages")
    if archive.tokenizer is None:
        raise RequestError(f"{archive.path.name} carries no tokenizer, which a chat needs", "messages")
    text = render_chat(archive.chat_template, messages, add_generation_prompt=True,
                       special_tokens=archive.special_tokens)
    return prompt_ids_of(archive, tokenized(archive, text, False, "messages"), "messages")
