"""``gdn-export serve``: an OpenAI-compatible HTTP server over an exported model (starlette on uvicorn).

    POST /v1/completions        prompt (text or token ids), max_tokens, temperature, top_p, top_k, seed, stop,
                                stream (server-sent events), logprobs, stop_token_ids, ignore_eos
    POST /v1/chat/completions   messages through the archive's chat template (400 where it has none)
    GET  /v1/models             the one model served (its served name)
    GET  /v1/models/{id}        that model (404 for any other name)
    GET  /health                200 and the executor's load (workers, busy, queued) and the seconds the model took
                                to load and plan; while it loads 503 ``{"status": "loading"}`` with Retry-After (every
                                ``/v1`` route then answers 503 + Retry-After too); 503 once shutting down

Every choice carries ``token_ids`` (the generated ids, as vLLM's ``return_token_ids``; an archive without a
tokenizer is served in token ids) and ``prompt_token_ids``. Bad requests get a 4xx with OpenAI's error body
``{"error": {"message", "type", "param", "code"}}``; a full executor answers 503. A client that disconnects, mid
stream or while it waits, cancels its request: its worker is free at the next token.

Requests run on an executor (``gdn_export.run.generation.executor``'s interface): for a serving archive
(``convert --serving``) the batched ``gdn_export.Engine`` (continuous batching over ``slots`` slots, ``workers``
threads); for any other a ``WorkerPool`` of ``workers`` threads, each a ``Session`` of its own over one tract plan,
one request at a time each.

Operating it (docs/SERVER.md): prompt + new tokens bounded by the model's context (400 ``context_length_exceeded``);
an API key checked on every ``/v1`` route (401); a per-request deadline; on SIGTERM new requests get 503, those in
flight finish within a grace period and are then ended with an error body (a stream: an error event and ``[DONE]``).
Parsing, tokenizing and chat-template rendering run off the event loop.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import threading
import time
import uuid
from typing import Any

from gdn_export.errors import GdnExportError
from gdn_export.run.generation.chat import ChatTemplateError
from gdn_export.run.generation.executor import ExecutorFull, context_bound
from gdn_export.run.generation.generate import (MAX_STOP_TOKEN_IDS, Generation, RequestError, chat_prompt_ids,
                                                prompt_ids_of, sampling_from)
from gdn_export.run.generation.sampling import MAX_LOGPROBS, SamplingError
from gdn_export.run.generation.speculative import SpeculativeConfig, SpeculativeError, resolve_speculative
from gdn_export.run.metrics import CONTENT_TYPE, ServerMetrics

SPECULATIVE_FIELDS = ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min")
MAX_BODY_BYTES = 8 * 1024 * 1024
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions (lowered to what the context leaves)
DEFAULT_CHAT_TOKENS = 512
API_KEY_ENV = "GDN_EXPORT_API_KEY"  # vLLM's VLLM_API_KEY
DEFAULT_SHUTDOWN_GRACE = 10.0  # seconds in-flight requests get to finish after SIGTERM
LOADING_RETRY_AFTER = "2"  # seconds a client is asked to wait while the model loads (seconds to tens of seconds)


class ApiError(Exception):
    """An error answered with OpenAI's error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _error_response(err: ApiError, retry_after: str = "1"):
    from starlette.responses import JSONResponse

    headers = {"Retry-After": retry_after} if err.status == 503 else None
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


# --- reading a request body ---------------------------------------------------------------------------------

async def _json_body(request) -> dict:
    from starlette.requests import ClientDisconnect

    size, chunks = 0, []
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                raise ApiError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes")
            chunks.append(chunk)
    except ClientDisconnect:  # one line in the log, not a traceback (starlette's answer to anything unhandled)
        import logging

        logging.getLogger("uvicorn.error").warning("%s %s: the client disconnected while sending its request body "
                                                   "(%d bytes received)", request.method, request.url.path, size)
        raise ApiError(400, "the client disconnected while sending its request body") from None
    return await asyncio.to_thread(_parsed, b"".join(chunks))  # megabytes of JSON: off the event loop


def _parsed(data: bytes) -> dict:
    from gdn_export.run.request_json import RequestJsonError, parse_body

    try:  # depth-limited, surrogates refused (request_json)
        body = parse_body(data)
    except RequestJsonError as err:
        raise ApiError(400, str(err), err.param) from None
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    return body


_TYPES = {"integer": (int,), "number": (int, float), "boolean": (bool,), "string": (str,), "object": (dict,)}


def _field(body: dict, name: str, kind: str, default: Any = None, *, minimum: float | None = None,
           maximum: float | None = None) -> Any:
    """``body[name]`` checked against ``kind`` (null or absent: ``default``); a wrong type or range is a 400."""
    value = body.get(name)
    if value is None:
        return default
    if kind != "boolean" and isinstance(value, bool) or not isinstance(value, _TYPES[kind]):
        article = "an" if kind[0] in "aeiou" else "a"
        raise ApiError(400, f"'{name}' must be {article} {kind}, got {json.dumps(value)[:80]}", name)
    if minimum is not None and value < minimum or maximum is not None and value > maximum:
        bounds = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ApiError(400, f"'{name}' must be {bounds}, got {value}", name)
    return value


def _refuse_unsupported(body: dict) -> None:
    n = _field(body, "n", "integer", 1)
    if n != 1:
        raise ApiError(400, f"only n=1 is supported (one choice per request), got n={n}", "n")
    best_of = _field(body, "best_of", "integer", 1)
    if best_of != 1:
        raise ApiError(400, f"only best_of=1 is supported, got {best_of}", "best_of")
    if _field(body, "echo", "boolean", False):
        raise ApiError(400, "echo is not supported", "echo")
    if body.get("suffix") is not None:
        raise ApiError(400, "suffix is not supported", "suffix")
    if body.get("logit_bias"):
        raise ApiError(400, "logit_bias is not supported", "logit_bias")
    for name in ("presence_penalty", "frequency_penalty"):
        if _field(body, name, "number", 0) != 0:
            raise ApiError(400, f"{name} is not supported (only 0)", name)
    if _field(body, "repetition_penalty", "number", 1) != 1:
        raise ApiError(400, "repetition_penalty is not supported (only 1)", "repetition_penalty")
    for name in ("tools", "functions"):
        if body.get(name):
            raise ApiError(400, f"{name} is not supported", name)
    response_format = body.get("response_format")
    if response_format is not None and response_format != {"type": "text"}:
        raise ApiError(400, "response_format is not supported (only {\"type\": \"text\"})", "response_format")


class _Flight:
    """One request being answered: its stream once submitted, and why it was ended early (None: it was not; else
    "timeout" or "shutdown")."""

    def __init__(self, deadline: float | None) -> None:
        self.deadline, self.stream, self.ended = deadline, None, None
        self.timer = None
        self.arrived = time.monotonic()  # the request's latency and time to first token count from here

    def end(self, why: str) -> None:
        if self.ended is None:
            self.ended = why
        if self.stream is not None:
            self.stream.cancel()

    def error(self, timeout: float | None) -> ApiError | None:
        if self.ended == "timeout":
            return ApiError(408, f"the request ran past its deadline of {timeout:g} s (the server's "
                                 "--request-timeout)", None, "request_timeout", "timeout_error")
        if self.ended == "shutdown":
            return ApiError(503, "the server shut down before the request finished", None, "server_shutdown",
                            "server_error")
        return None


class App:
    """The HTTP side: requests parsed and checked, run on ``executor``, answered in OpenAI's formats.

    ``executor`` None: the model is still loading (``serve`` listens at once): every ``/v1`` route answers 503 with
    Retry-After and ``/health`` says "loading" until ``ready(executor)``.
    ``api_key``: the key every ``/v1`` route asks for (``Authorization: Bearer KEY``; None: none asked);
    ``request_timeout``: seconds a request may take from its arrival (None: no deadline)."""

    def __init__(self, executor, model_name: str, api_key: str | None = None,
                 request_timeout: float | None = None, speculative: SpeculativeConfig | None = None) -> None:
        if request_timeout is not None and not request_timeout > 0:
            raise GdnExportError(f"request_timeout must be > 0 seconds, got {request_timeout}")
        self.model_name = model_name
        self.executor, self.archive, self.load_seconds = None, None, None
        self.loading_since = time.monotonic()
        if executor is not None:
            self.ready(executor)
        self.created = int(time.time())
        self.api_key, self.request_timeout = api_key, request_timeout
        self.speculative = speculative  # a request's drafting unless it gives its own speculative_config
        self.draining = False
        self.flights: set[_Flight] = set()
        self.metrics = ServerMetrics(model_name)

    def ready(self, executor, load_seconds: float | None = None) -> None:
        """The model is loaded and planned: serve it (callable from any thread; ``executor`` is set last)."""
        self.archive, self.load_seconds = executor.archive, load_seconds
        self.executor = executor

    # --- shutdown ---
    def drain(self, grace: float) -> None:
        """Stop admitting (503) and end what is still in flight after ``grace`` seconds (from the event loop)."""
        self.draining = True
        asyncio.get_running_loop().call_later(grace, self.end_all)

    def end_all(self) -> None:
        for flight in list(self.flights):
            flight.end("shutdown")

    def _flight(self) -> _Flight:
        if self.draining:
            raise ApiError(503, "the server is shutting down", None, "server_shutting_down", "server_error")
        deadline = None if self.request_timeout is None else time.monotonic() + self.request_timeout
        flight = _Flight(deadline)
        if deadline is not None:
            flight.timer = asyncio.get_running_loop().call_later(self.request_timeout, flight.end, "timeout")
        self.flights.add(flight)
        return flight

    def _landed(self, flight: _Flight) -> None:
        self.flights.discard(flight)
        if flight.timer is not None:
            flight.timer.cancel()

    # --- the parts both endpoints share ---
    def _check_model(self, body: dict) -> None:
        model = _field(body, "model", "string")
        if model is not None and model != self.model_name:
            raise ApiError(404, f"the model '{model}' does not exist (this server serves '{self.model_name}')",
                           "model", "model_not_found")

    def _generation(self, body: dict, prompt, chat: bool) -> tuple[Generation, int | None]:
        """The request's Generation and its number of top logprobs (None: none asked)."""
        _refuse_unsupported(body)
        tokens_param = "max_tokens"
        if chat:
            max_tokens = _field(body, "max_completion_tokens", "integer", minimum=1)
            if max_tokens is None:
                max_tokens = _field(body, "max_tokens", "integer", minimum=1)
            else:
                tokens_param = "max_completion_tokens"
            if _field(body, "logprobs", "boolean", False):
                top = _field(body, "top_logprobs", "integer", 0, minimum=0, maximum=MAX_LOGPROBS)
            else:
                if _field(body, "top_logprobs", "integer") is not None:
                    raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
                top = None
        else:
            max_tokens = _field(body, "max_tokens", "integer", minimum=1)
            top = _field(body, "logprobs", "integer", minimum=0, maximum=MAX_LOGPROBS)
        temperature = _field(body, "temperature", "number", minimum=0)
        top_p = _field(body, "top_p", "number")
        top_k = _field(body, "top_k", "integer")
        seed = _field(body, "seed", "integer", minimum=0)
        stop = body.get("stop")
        if stop is not None and not isinstance(stop, str) and not (
                isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
            raise ApiError(400, "'stop' must be a string or a list of strings", "stop")
        stop_ids = body.get("stop_token_ids")
        if stop_ids is not None and not (isinstance(stop_ids, list) and all(
                isinstance(i, int) and not isinstance(i, bool) for i in stop_ids)):
            raise ApiError(400, "'stop_token_ids' must be a list of integers", "stop_token_ids")
        if stop_ids is not None and len(stop_ids) > MAX_STOP_TOKEN_IDS:  # before the set below is built
            raise ApiError(400, f"'stop_token_ids' has {len(stop_ids)} ids, more than {MAX_STOP_TOKEN_IDS}",
                           "stop_token_ids")
        ignore_eos = _field(body, "ignore_eos", "boolean", False)
        stop_token_ids = (set() if ignore_eos else set(self.archive.eos_token_ids)) | set(stop_ids or [])
        try:
            sampling = sampling_from(self.archive.generation_config, temperature, top_k, top_p, seed, top)
            speculative = self._speculative(body)
            generation = Generation(self.archive, prompt, max_tokens, stop=stop, stop_token_ids=stop_token_ids,
                                    sampling=sampling, prompt_param="messages" if chat else "prompt",
                                    tokens_param=tokens_param, speculative=speculative,
                                    default_new_tokens=DEFAULT_CHAT_TOKENS if chat else DEFAULT_COMPLETION_TOKENS)
        except SamplingError as err:
            raise ApiError(400, str(err), err.param) from None
        except RequestError as err:
            raise ApiError(400, str(err), err.param, getattr(err, "code", None)) from None
        return generation, top

    def _speculative(self, body: dict) -> SpeculativeConfig | None:
        """The request's drafting: its ``speculative_config`` (vLLM's keys: method "ngram", "draft" (the server's
        draft archive), "mtp" (the archive's MTP head; vLLM's "qwen3_next_mtp" too) or "none",
        num_speculative_tokens, prompt_lookup_max, prompt_lookup_min; unset keys from the server's), else the
        server's (``--speculative``)."""
        given = _field(body, "speculative_config", "object")
        if given is None:
            return self.speculative
        param = "speculative_config"
        unknown = sorted(set(given) - {"method", *SPECULATIVE_FIELDS})
        if unknown:  # named, a few and each cut short: the answer stays small whatever the body held
            named = ", ".join(key[:40] for key in unknown[:5]) + (f" and {len(unknown) - 5} more" if len(unknown) > 5
                                                                 else "")
            raise ApiError(400, f"speculative_config takes method, {', '.join(SPECULATIVE_FIELDS)}; got {named}",
                           param)
        if given.get("method") == "none":
            return None
        base = self.speculative or SpeculativeConfig()
        options = {name: given.get(name, getattr(base, name)) for name in ("method", *SPECULATIVE_FIELDS)}
        if options["method"] == "draft":  # the server's draft archive: a request never names a file to load
            if base.model is None:
                raise ApiError(400, "this server has no draft model (gdn-export serve --speculative draft --draft "
                                    "ARCHIVE): use method ngram", f"{param}.method")
            options["model"] = base.model
        if "prompt_lookup_max" in given and "prompt_lookup_min" not in given:
            options["prompt_lookup_min"] = min(options["prompt_lookup_min"], options["prompt_lookup_max"])
        try:
            config = SpeculativeConfig(**options)
        except SpeculativeError as err:
            raise ApiError(400, f"speculative_config: {err}", f"{param}.{err.param}") from None
        if not getattr(self.archive, "every_position", True):
            raise ApiError(400, f"{self.model_name} returns the last position's logits only (converted with "
                                "--logits last): speculative decoding needs every position's", param)
        if config.method == "mtp" and not getattr(self.archive, "mtp", False):
            raise ApiError(400, f"{self.model_name} carries no MTP head (converted from a checkpoint without mtp.* "
                                "weights, or with --quantize / --logits last): use method ngram", f"{param}.method")
        return config

    def _prompt(self, body: dict):
        if "prompt" not in body or body["prompt"] is None:
            raise ApiError(400, "'prompt' is required: a string or a list of token ids", "prompt")
        prompt = body["prompt"]
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ApiError(400, f"one prompt per request is supported, got {len(prompt)}", "prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            return prompt
        if not isinstance(prompt, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in prompt):
            raise ApiError(400, "'prompt' must be a string or a list of integer token ids", "prompt")
        try:
            return prompt_ids_of(self.archive, prompt)
        except RequestError as err:
            raise ApiError(400, str(err), err.param) from None

    def _submit(self, generation: Generation, flight: _Flight):
        error = flight.error(self.request_timeout)
        if error is not None:  # the deadline passed (or shutdown came) while the prompt was prepared
            raise error
        try:
            flight.stream = self.executor.submit(generation.request)
        except ExecutorFull as err:
            raise ApiError(503, f"the server is full: {err}", None, "server_busy", "server_overloaded") from None
        return flight.stream

    def _usage(self, generation: Generation) -> dict:
        prompt, completion = len(generation.prompt_ids), len(generation.token_ids)
        usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
        if generation.request.speculative is not None:  # OpenAI's names for predicted tokens kept and rejected
            rejected = generation.drafted - generation.accepted
            usage["completion_tokens_details"] = {"accepted_prediction_tokens": generation.accepted,
                                                  "rejected_prediction_tokens": rejected}
        return usage

    async def _tokens(self, generation: Generation, stream, flight: _Flight):
        """The request's GeneratedTokens as its events come; a stop string cancels the rest; a request ended by its
        deadline or by shutdown raises its ApiError once its stream stopped."""
        first = True
        try:
            async for event in stream:
                token = generation.step(event)
                if first:
                    self.metrics.first_token(time.monotonic() - flight.arrived)
                    first = False
                if token.finish_reason is not None:  # counted before the last token leaves (a client may go)
                    self.metrics.request_finished(len(generation.prompt_ids), len(generation.token_ids),
                                                  token.finish_reason, time.monotonic() - flight.arrived)
                yield token
                if token.finish_reason is not None:
                    return
            error = flight.error(self.request_timeout)
            if error is not None:
                raise error
        finally:
            stream.cancel()
            self._landed(flight)

    async def _collect(self, request, generation: Generation, stream, flight: _Flight) -> list:
        """Every token of a request answered at once; the client leaving cancels it."""
        async def watch():
            while True:
                message = await request.receive()
                if message["type"] == "http.disconnect":
                    stream.cancel()
                    return

        watcher = asyncio.ensure_future(watch())
        try:
            return [token async for token in self._tokens(generation, stream, flight)]
        except GdnExportError as err:
            raise ApiError(500, f"the model failed: {err}") from None
        finally:
            watcher.cancel()

    async def _started(self, request, chat: bool):
        """(Generation, top logprobs, flight, token stream, stream mode, usage in the stream) of a request submitted
        to the executor, its parsing, tokenizing and template rendering off the event loop; the flight is registered
        (ended by shutdown or the deadline) from its arrival."""
        flight = self._flight()
        try:
            body = await _json_body(request)
            generation, top = await asyncio.to_thread(self._chat if chat else self._completion, body)
            stream_mode = _field(body, "stream", "boolean", False)
            usage_in_stream = bool(_field(body, "stream_options", "object", {}).get("include_usage"))
            stream = self._submit(generation, flight)
        except BaseException:
            self._landed(flight)
            raise
        return generation, top, flight, stream, stream_mode, usage_in_stream

    def _completion(self, body: dict):
        self._check_model(body)
        return self._generation(body, self._prompt(body), chat=False)

    def _chat(self, body: dict):
        self._check_model(body)
        if "messages" not in body:
            raise ApiError(400, "'messages' is required", "messages")
        try:
            prompt = chat_prompt_ids(self.archive, body["messages"])
        except (ChatTemplateError, RequestError) as err:
            raise ApiError(400, str(err), err.param, getattr(err, "code", None)) from None
        return self._generation(body, prompt, chat=True)

    def _sse(self, chunks):
        """Server-sent events: one ``data:`` line per chunk, then ``data: [DONE]``; the stream cancelled when the
        client leaves (starlette cancels this generator)."""
        from starlette.responses import StreamingResponse

        async def events():
            try:
                async for chunk in chunks:
                    yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
            except Exception as err:  # the model failed mid-stream, or the deadline or shutdown ended it: said in
                # the stream, which then ends
                if isinstance(err, ApiError):
                    error = err
                else:
                    error = ApiError(500, f"the model failed: {err}" if isinstance(err, GdnExportError) else
                                     f"unexpected {type(err).__name__}: {err}")
                yield f"data: {json.dumps(error.body())}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    # --- logprobs in the two formats ---
    def _completion_logprobs(self, generation: Generation, tokens: list, top: int | None, base: int = 0):
        if top is None:
            return None
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token in tokens:
            out["tokens"].append(generation.token_text(token.token_id))
            out["token_logprobs"].append(token.logprob)
            out["top_logprobs"].append({generation.token_text(i): lp for i, lp in token.top_logprobs or ()}
                                       if top else None)
            out["text_offset"].append(base + token.offset)
        return out

    def _chat_logprobs(self, generation: Generation, tokens: list, top: int | None):
        if top is None:
            return None

        def entry(token_id, logprob):
            text = generation.token_text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return {"content": [dict(entry(t.token_id, t.logprob),
                                 top_logprobs=[entry(i, lp) for i, lp in t.top_logprobs or ()]) for t in tokens]}

    # --- endpoints ---
    async def completions(self, request):
        generation, top, flight, stream, stream_mode, usage_in_stream = await self._started(request, chat=False)
        ident, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": ident, "object": "text_completion", "created": created, "model": self.model_name}
        if not stream_mode:
            tokens = await self._collect(request, generation, stream, flight)
            choice = {"index": 0, "text": generation.text,
                      "logprobs": self._completion_logprobs(generation, tokens, top),
                      "finish_reason": generation.finish_reason, "stop_reason": generation.stop_reason,
                      "token_ids": list(generation.token_ids), "prompt_token_ids": list(generation.prompt_ids)}
            return _json(dict(head, choices=[choice], usage=self._usage(generation)))

        async def chunks():
            first = True
            async for token in self._tokens(generation, stream, flight):
                choice = {"index": 0, "text": token.text,
                          "logprobs": self._completion_logprobs(generation, [token], top),
                          "finish_reason": token.finish_reason, "stop_reason": token.stop_reason,
                          "token_ids": [token.token_id]}
                if first:
                    choice["prompt_token_ids"], first = list(generation.prompt_ids), False
                yield dict(head, choices=[choice])
            if usage_in_stream:
                yield dict(head, choices=[], usage=self._usage(generation))

        return self._sse(chunks())

    async def chat_completions(self, request):
        generation, top, flight, stream, stream_mode, usage_in_stream = await self._started(request, chat=True)
        ident, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": ident, "object": "chat.completion", "created": created, "model": self.model_name}
        if not stream_mode:
            tokens = await self._collect(request, generation, stream, flight)
            choice = {"index": 0, "message": {"role": "assistant", "content": generation.text},
                      "logprobs": self._chat_logprobs(generation, tokens, top),
                      "finish_reason": generation.finish_reason, "stop_reason": generation.stop_reason,
                      "token_ids": list(generation.token_ids)}
            return _json(dict(head, choices=[choice], usage=self._usage(generation),
                              prompt_token_ids=list(generation.prompt_ids)))
        head["object"] = "chat.completion.chunk"

        async def chunks():
            yield dict(head, choices=[{"index": 0, "delta": {"role": "assistant", "content": ""},
                                       "logprobs": None, "finish_reason": None, "token_ids": []}],
                       prompt_token_ids=list(generation.prompt_ids))
            async for token in self._tokens(generation, stream, flight):
                delta = {"content": token.text} if token.text or token.finish_reason is None else {}
                yield dict(head, choices=[{"index": 0, "delta": delta,
                                           "logprobs": self._chat_logprobs(generation, [token], top),
                                           "finish_reason": token.finish_reason, "stop_reason": token.stop_reason,
                                           "token_ids": [token.token_id]}])
            if usage_in_stream:
                yield dict(head, choices=[], usage=self._usage(generation))

        return self._sse(chunks())

    def _model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "gdn_export",
                "root": self.model_name, "max_model_len": self.archive.max_model_len}

    async def models(self, request):
        return _json({"object": "list", "data": [self._model_card()]})

    async def model(self, request):
        name = request.path_params["name"]
        if name != self.model_name:
            raise ApiError(404, f"the model '{name}' does not exist (this server serves '{self.model_name}')",
                           "model", "model_not_found")
        return _json(self._model_card())

    async def health(self, request):
        from starlette.responses import JSONResponse

        if self.executor is None:  # a load balancer's probe: not ready yet, come back
            status = "shutting down" if self.draining else "loading"
            return JSONResponse({"status": status, "loading_seconds": round(time.monotonic() - self.loading_since, 1)},
                                status_code=503, headers={"Retry-After": LOADING_RETRY_AFTER})
        if self.draining:
            return JSONResponse(dict(status="shutting down", **self.executor.stats()), status_code=503)
        loaded = {} if self.load_seconds is None else {"load_seconds": round(self.load_seconds, 2)}
        return _json(dict(status="ok", **loaded, **self.executor.stats()))

    async def prometheus(self, request):
        """``/metrics``: vLLM's metrics in Prometheus' text format (run/metrics.py), while loading too (zeros)."""
        from starlette.responses import Response

        stats = self.executor.stats() if self.executor is not None else {}
        text = self.metrics.render(stats.get("busy", 0), stats.get("queued", 0))
        return Response(text, media_type=CONTENT_TYPE)

    def authorized(self, scope) -> bool:
        """Whether a request may use a ``/v1`` route: no key is set, or its ``Authorization: Bearer`` gives it."""
        if self.api_key is None:
            return True
        given = dict(scope.get("headers") or ()).get(b"authorization", b"")
        scheme, _, key = given.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(key.strip(), self.api_key.encode())


def _json(data: dict):
    from starlette.responses import Response

    return Response(json.dumps(data, ensure_ascii=False), media_type="application/json")


def make_app(executor, model_name: str, api_key: str | None = None, request_timeout: float | None = None,
             state: list | None = None, speculative: SpeculativeConfig | None = None):
    """The ASGI application serving ``executor`` (None: still loading, until ``App.ready``) under ``model_name``
    (``App``'s options); ``state``, when given, receives the ``App`` (what ``serve`` drains on shutdown and makes
    ready once loaded)."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.routing import Route

    app = App(executor, model_name, api_key, request_timeout, speculative)
    if state is not None:
        state.append(app)

    def guarded(endpoint):
        async def run(request):
            try:
                return await endpoint(request)
            except ApiError as err:
                return _error_response(err)
        return run

    async def http_error(request, exc: HTTPException):
        return _error_response(ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                                        code="not_found" if exc.status_code == 404 else None))

    async def unexpected(request, exc: Exception):
        return _error_response(ApiError(500, f"unexpected {type(exc).__name__}: {exc}"))

    routes = [Route("/v1/completions", guarded(app.completions), methods=["POST"]),
              Route("/v1/chat/completions", guarded(app.chat_completions), methods=["POST"]),
              Route("/v1/models", guarded(app.models), methods=["GET"]),
              Route("/v1/models/{name:path}", guarded(app.model), methods=["GET"]),
              Route("/health", guarded(app.health), methods=["GET"]),
              Route("/metrics", guarded(app.prometheus), methods=["GET"])]
    routed = Starlette(routes=routes, exception_handlers={HTTPException: http_error, Exception: unexpected})

    async def keyed(scope, receive, send):
        """Every ``/v1`` path (known or not) asks for the key first: 401 with OpenAI's body without it."""
        if scope["type"] == "http" and scope["path"].startswith("/v1") and not app.authorized(scope):
            from starlette.responses import JSONResponse

            error = ApiError(401, "Incorrect API key provided: pass it as 'Authorization: Bearer KEY' (the "
                                  "server's --api-key)", None, "invalid_api_key")
            response = JSONResponse(error.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"})
            await response(scope, receive, send)
            return
        if scope["type"] == "http" and scope["path"].startswith("/v1") and app.executor is None:
            error = ApiError(503, "the model is still loading; GET /health says when it is ready", None,
                             "model_loading", "server_error")
            await _error_response(error, LOADING_RETRY_AFTER)(scope, receive, send)
            return
        await routed(scope, receive, send)

    return keyed


def model_name_of(path) -> str:
    name = str(getattr(path, "name", path))
    for suffix in (".nnef.tgz", ".tgz", ".nnef"):
        if name.endswith(suffix):
            return name[:-len(suffix)]
    return name


def default_slots(workers: int) -> int:
    """An Engine's slots when ``--slots`` is not given: 8, at least one per worker."""
    return max(8, workers)


def executor_for(session, workers: int, max_queue: int, slots: int | None = None, progress=None,
                 prefill_piece: int | None = None, prefill_rows: int = 1, prefix_cache_mib: float | None = None):
    """The executor ``serve`` runs on: an ``Engine`` for a serving archive (planned now), else a
    ``WorkerPool``; ``prefill_piece`` (None: the default, 128) prompt tokens per prefill call; ``prefill_rows``
    (an Engine's): prompts whose pieces run in one call; ``prefix_cache_mib`` (an Engine's; None: its default)."""
    if prefill_piece is not None and not session.serving:
        session.prefill_piece = prefill_piece
    if session.serving:
        from gdn_export.run.serving.engine import Engine, slots_per_worker

        slots = slots or default_slots(workers)
        if progress is not None:
            progress(f"planning the serving graph for batches of up to {max(slots_per_worker(slots, workers))} "
                     "rows (one plan for every batch size)")
        piece = {} if prefill_piece is None else {"prefill_piece": prefill_piece}
        if prefix_cache_mib is not None:
            piece["prefix_cache_mib"] = prefix_cache_mib
        return Engine(session, slots=slots, workers=workers, max_queue=max_queue, plan_now=True,
                      prefill_rows=prefill_rows, **piece)
    from gdn_export.run.generation.executor import WorkerPool

    if progress is not None:
        progress("planning the model for batches of 1")
    session.prefill([[0]])  # plans now (seconds): a first request's first piece would otherwise hold its worker for
    session.reset()  # the whole planning, cancellation or not
    return WorkerPool(session, workers=workers, max_queue=max_queue)


def listen(host: str, port: int):
    """A listening TCP socket on ``host``:``port`` (0: a free port), IPv4 or IPv6 as ``host`` is."""
    import socket

    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    return socket.create_server((host, port), family=family, backlog=128)


def is_loopback(host: str) -> bool:
    """Whether ``host`` is reachable from this machine only (127.0.0.0/8, ::1, localhost)."""
    import ipaddress

    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def exit_at_once(sig: int) -> None:
    """The process ended now with exit status 1 and one line on stderr: what a second signal during the shutdown
    grace asks for (the requests still in flight are dropped, their connections closed by the system)."""
    import os
    import signal
    import sys

    name = signal.Signals(sig).name if sig in signal.Signals.__members__.values() else str(sig)
    try:
        sys.stderr.write(f"gdn-export: {name} again during the shutdown grace: exiting at once\n")
        sys.stderr.flush()
    finally:
        os._exit(1)


def graceful_server(config, app_state: list, grace: float):
    """A ``uvicorn.Server`` whose shutdown (SIGTERM, Ctrl-C) stops admitting at once (503), gives the requests in
    flight ``grace`` seconds to finish, then ends them with an error body (a stream: an error event and ``[DONE]``)
    before uvicorn closes their connections; a second signal forces the exit."""
    import uvicorn

    class GracefulServer(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            if self.should_exit:  # a second SIGTERM or Ctrl-C during the grace: at once, no cleanup, no traceback
                exit_at_once(sig)
            super().handle_exit(sig, frame)

        async def shutdown(self, sockets=None):
            for app in app_state:
                app.drain(grace)
            await super().shutdown(sockets)

    config.timeout_graceful_shutdown = grace + 5  # the ended requests' last words, then uvicorn cancels the rest
    return GracefulServer(config)


def serve(path, host: str = "127.0.0.1", port: int = 8000, workers: int = 1, max_queue: int = 16,
          model_name: str | None = None, log_level: str = "warning", ready=None, slots: int | None = None,
          progress=None, prefill_piece: int | None = None, prefill_rows: int = 1, *, api_key: str | None = None,
          request_timeout: float | None = None, max_model_len: int | None = None, allow_long: bool = False,
          shutdown_grace: float = DEFAULT_SHUTDOWN_GRACE, prefix_cache_mib: float | None = None,
          speculative: SpeculativeConfig | str | None = None, listening=None) -> None:
    """Serve the archive at ``path`` until interrupted (Ctrl-C, SIGTERM): ``workers`` threads over one tract
    plan, at most ``max_queue`` requests waiting; a serving archive on an ``Engine`` of ``slots`` slots (default 8;
    every batch-size bucket planned before the server answers); ``prefill_piece``: prompt tokens per prefill call (a
    smaller piece holds up the other requests' next tokens for less time, at some prefill speed; on an Engine a
    multiple of 64); ``prefill_rows``: an Engine's prompts prefilled in one call. The socket listens at once, while
    the model loads and is planned in a thread (seconds to tens of seconds): meanwhile ``/health`` answers 503
    "loading" and every ``/v1`` route 503 with Retry-After; ``listening(host, port)`` is called once the socket
    listens, ``ready(host, port)`` once the model is served (a failed load stops the server and raises its error
    here). ``api_key``: asked on
    every /v1 route; ``request_timeout``: each request's deadline in seconds; ``max_model_len``: prompt + new tokens
    at most (default: the model's context; longer only with ``allow_long``); ``shutdown_grace``: seconds in-flight
    requests get after SIGTERM; ``prefix_cache_mib``: an Engine's prefix cache bound (None: 512 MiB; 0: none);
    ``speculative``: requests draft so unless they give their own ``speculative_config`` (docs/SERVER.md; the
    default, None: no drafts, as vLLM; ``"default"``: the archive's default drafting,
    ``speculative.default_speculative``)."""
    import uvicorn

    from gdn_export.run.session import Session

    say = progress or (lambda message: None)
    if shutdown_grace < 0:
        raise GdnExportError(f"shutdown_grace must be >= 0 seconds, got {shutdown_grace}")
    session = Session(path)
    context_bound(session.metadata.get("context_length"), max_model_len, allow_long)  # refused before any planning
    speculative = resolve_speculative(speculative, session.every_position, session.mtp is not None)
    if speculative is not None and not session.every_position:
        raise GdnExportError(f"{path} returns the last position's logits only (converted with --logits last): "
                             "--speculative needs every position's")
    if speculative is not None and speculative.method == "mtp" and session.mtp is None:
        from gdn_export.run.mtp import no_mtp_message

        raise GdnExportError(no_mtp_message(session.path))
    if speculative is not None and speculative.model is not None:  # planned now (and its vocabulary checked)
        from gdn_export.run.generation.speculative import draft_session

        draft_session(speculative.model, session.metadata.get("vocab_size"))
    if (slots is not None or prefill_rows != 1 or prefix_cache_mib is not None) and not session.serving:
        option = "--slots" if slots is not None else "--prefill-rows" if prefill_rows != 1 else "--prefix-cache-mib"
        raise GdnExportError(f"{option} batches requests over a serving graph; {path} has none (convert it with "
                             "--serving)")
    if api_key is None and not is_loopback(host):
        say(f"warning: listening on {host} without an API key: anyone who reaches this port can use the model "
            f"(--api-key KEY or {API_KEY_ENV})")
    sock = listen(host, port)
    bound = sock.getsockname()[:2]
    state: list = []
    app = make_app(None, model_name or model_name_of(path), api_key, request_timeout, state, speculative)
    config = uvicorn.Config(app, log_level=log_level, http="h11", lifespan="off")
    server = graceful_server(config, state, shutdown_grace)
    loaded: dict = {}

    def load() -> None:  # off the event loop: the server answers (503 "loading") meanwhile
        start = time.perf_counter()
        try:
            executor = loaded["executor"] = executor_for(session, workers, max_queue, slots, progress, prefill_piece,
                                                         prefill_rows, prefix_cache_mib)  # tract loads, plans
            executor.archive.limit_context(max_model_len, allow_long)
        except BaseException as err:  # the server stops; serve raises it
            loaded["error"] = err
            server.should_exit = True
            return
        if max_model_len is None and executor.archive.context_note:
            say(f"warning: {executor.archive.context_note}")
        if executor.archive.chat_template_error:  # serve completions all the same
            say(f"warning: {executor.archive.chat_template_error}: chat requests get a 400")
        seconds = time.perf_counter() - start
        say(f"loaded and planned in {seconds:.1f} s")
        state[0].ready(executor, seconds)
        if ready is not None:
            ready(*bound)

    loader = threading.Thread(target=load, name="gdn_export-load", daemon=True)
    try:
        loader.start()
        if listening is not None:
            listening(*bound)
        server.run(sockets=[sock])
    finally:
        sock.close()
        if not loader.is_alive() and "executor" in loaded:  # (a load still running when stopped dies with the process)
            loaded["executor"].close()
    if "error" in loaded:
        raise loaded["error"]
