"""``gdn-export``: convert, check and inspect gated delta-rule checkpoints for tract.

    gdn-export convert CHECKPOINT_DIR -o OUT.nnef.tgz [--dtype float32|float16] [--runtime cpu|cuda|any]
                       [--lowering auto|native|scan|recurrent|chunked] [--core-dtype float16]
                       [--chunk-size N] [--tract-version V] [--no-check] [--force]
    gdn-export convert CHECKPOINT_DIR -o OUT.onnx [--format onnx] [--runtime onnxruntime|tract-onnx|any]
                       [--lowering auto|native|scan] [--dtype float32|float16] [--no-check] [--force]
    gdn-export check OUT.nnef.tgz|OUT.onnx CHECKPOINT_DIR [--prompt-len N] [--decode-steps M] [--batch B]
    gdn-export info OUT.nnef.tgz
    gdn-export generate MODEL.nnef.tgz (--prompt TEXT | --prompt-ids 1,2,3) [--chat] [--max-new-tokens N]
                        [--temperature T] [--top-p P] [--top-k K] [--seed S] [--stop TEXT]... [--ignore-eos]
                        [--max-model-len N]
    gdn-export serve MODEL.nnef.tgz [--host 127.0.0.1] [--port N] [--workers W] [--max-queue Q] [--slots N]
                     [--prefill-piece T] [--prefill-rows N] [--prefix-cache-mib MIB]
                     [--api-key KEY] [--max-model-len N] [--request-timeout S] [--shutdown-grace S]
    gdn-export perplexity MODEL.nnef.tgz|MODEL.onnx TEXT_FILE [--ctx 256] [--chunks N] [--reference CHECKPOINT_DIR]
                          [--tokenizer TOKENIZER_JSON] [--json]

Exit status 0 on success; 1 with a one-line reason on any failure (``--debug``: the traceback too); 2 on a
usage error (checked before any work; for ``generate`` also a prompt + new tokens longer than the model's context);
130 when interrupted (Ctrl-C, SIGTERM), leaving no output behind; ``serve`` stopped by SIGTERM or Ctrl-C exits 0
once its requests were answered or ended (docs/SERVER.md).

``info``, ``generate`` and ``serve`` run on the base install (numpy, tract; text and chat: ``[generate]``; HTTP:
``[serve]``) and never import torch; ``convert`` and ``check`` need the ``[convert]`` extra (torch, torch-to-nnef,
transformers, onnx) and say so in one line when it is missing.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import warnings
from typing import Sequence

from gdn_export.errors import GdnExportError, missing_extra
from gdn_export.ops.gated_delta_rule.nnef.registry import LOWERINGS  # light: --help imports no torch (nor numpy)
from gdn_export.targets import ALL_RUNTIMES, BACKENDS, backend_for
from gdn_export.weights import formats


def _progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _convert(args) -> int:
    """One plan (``plan_conversion``: every option validated once, its errors worded with the flags here), one
    conversion (``run_plan``), whichever the format: --format, or the output's suffix (.onnx: onnx)."""
    from gdn_export.pipeline.convert import plan_conversion, run_plan

    fmt = args.format or backend_for(args.output).name
    plan = _in_flags(lambda: plan_conversion(
        args.checkpoint, args.output, format=fmt, dtype=args.dtype, lowering=args.lowering,
        tract_version=args.tract_version, check=False if args.no_check else args.check, force=args.force,
        runtime=args.runtime or "cpu", core_dtype=args.core_dtype, chunk_size=args.chunk_size,
        tail_chunk=args.tail_chunk,
        streamed=not args.in_memory, prompt_len=args.prompt_len, decode_steps=args.decode_steps,
        quantize=args.quantize, quantize_embeddings=args.quantize_embeddings, logits=args.logits,
        serving=args.serving, **{option.name: getattr(args, option.name) for option in _format_options()}))
    print(run_plan(plan, _progress))
    return 0


def _in_flags(call):
    """``call()``, an error it raises worded with the command line's flags where it carries them
    (``errors.worded``: exit status 2 for a refused combination of options, 1 for a state of the world)."""
    try:
        return call()
    except GdnExportError as err:
        flags = getattr(err, "flags", None)
        if flags is None:
            raise
        raise (UsageError if err.usage else GdnExportError)(flags) from None


def _check(args) -> int:
    from gdn_export.pipeline.convert import check, quality_line

    _progress(f"checking {args.model} against {args.checkpoint}: prefill {args.prompt_len} + decode "
              f"{args.decode_steps}, batch {args.batch}")
    result = _in_flags(lambda: check(args.model, args.checkpoint, args.prompt_len, args.decode_steps, args.batch,
                                     kind=args.kind, calibration=args.calibration, progress=_progress))
    print(f"{args.model}: {result}")
    if result.quality is not None:
        print(f"  {quality_line(result.quality)}")
    if result.mtp is not None:
        print(f"  MTP head: {result.mtp}{'' if result.mtp.ok else ' (FAILED)'}")
    if not result.ok:
        what = f"its MTP head: {result.mtp}" if result.mtp is not None and not result.mtp.ok else str(result)
        raise GdnExportError(f"{args.model} does not match {args.checkpoint}: {what}")
    return 0


def _info(args) -> int:
    from gdn_export.run.reading import read_metadata
    from gdn_export.run.runtime import load_tract_model

    metadata = read_metadata(args.model) or {}
    start = time.perf_counter()
    runnable = load_tract_model(args.model, whole=True)  # its facts are read: one tract model
    load_seconds = time.perf_counter() - start
    print(f"{args.model}")
    if metadata:
        weights = f", {metadata['quantized']} weights in {metadata['quantize'].upper()}" \
            if metadata.get("quantize") and metadata.get("quantized") is not None else ""
        print(f"  family: {metadata.get('family')} ({metadata.get('model_type')}), dtype {metadata.get('dtype')}"
              f"{weights}, vocab {metadata.get('vocab_size')}")
        context = metadata.get("context_length")
        print(f"  context: {f'{context} tokens' if context else 'not stored (converted before it was)'}; "
              + (f"{len(metadata['digests'])} members' SHA-256 verified" if metadata.get("digests") else
                 "no digests (written before them): members and the gzip CRC-32 checked"))
        if metadata.get("serving"):
            print("  serving graph: each row its own past length (past_len) and count of new tokens (seq_len); cache "
                  "outputs are the new positions only; `gdn-export serve` batches requests over it (docs/SERVING.md)")
    print(f"  tract: target {_property(args.model, 'tract_target_version')}, runtime {_tract_version()}; loaded and "
          f"planned in {load_seconds:.1f} s")
    print("  inputs:")
    for i in range(runnable.input_count()):
        print(f"    {_name(metadata, 'inputs', i)}: {runnable.input_fact(i)}")
    print("  outputs:")
    for i in range(runnable.output_count()):
        print(f"    {_name(metadata, 'outputs', i)}: {runnable.output_fact(i)}")
    decisions = metadata.get("decisions", [])
    if decisions:
        print("  lowerings:")
        for d in decisions:
            print(f"    {d['node']} ({d['entry']}): {d['lowering']} - {d['reason']}")
    return 0


def _name(metadata: dict, key: str, index: int) -> str:
    names = metadata.get(key) or []
    return names[index] if index < len(names) else f"#{index}"


def _property(path: str, key: str) -> str:
    import re
    import tarfile

    with tarfile.open(path) as tar:
        text = tar.extractfile("graph.nnef").read().decode(errors="replace")
    match = re.search(rf'\("{key}", "([^"]*)"\)', text)
    return match.group(1) if match else "unknown"


def _tract_version() -> str:
    from gdn_export.run.runtime import tract_version

    return tract_version()


def _quiet_transformers() -> None:
    """transformers prints loading bars and kernel fallback notes that say nothing about the export."""
    try:
        import transformers
    except ImportError:
        return
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()


def _format_options() -> list:
    """Every ``convert`` option a weight format owns (``gdn_export.weights.formats``: the flag, its keywords)."""
    return [option for fmt in formats.all_formats() for option in fmt.options]


def _count(minimum: int):
    """An argparse type: an integer >= ``minimum`` (a usage error otherwise, before any work)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value
    return parse


def _chunk_size(text: str) -> int:
    value = _count(1)(text)
    try:
        from gdn_export.ops.gated_delta_rule.nnef.chunked import chunk_size_error  # the rule; only when given
    except ModuleNotFoundError:  # no [convert] extra: the conversion says what to install
        return value
    if chunk_size_error(value):
        raise argparse.ArgumentTypeError(chunk_size_error(value))
    return value


def _version(text: str) -> str:
    from gdn_export.ops.gated_delta_rule.nnef.capabilities import check_target_version  # numpy: when given
    from gdn_export.targets import parse_version

    try:
        check_target_version(parse_version(text), _installed_tract())
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return text


def _installed_tract() -> tuple[int, int, int] | None:
    from gdn_export.targets import parse_version

    try:
        return parse_version(_tract_version())
    except (ImportError, ValueError):
        return None


# --- generate and serve ----------------------------------------------------------------------------------------

class UsageError(Exception):
    """Bad input found once the model is open (a text prompt for an archive without a tokenizer, a token id outside
    the vocabulary, --chat without a chat template): exit status 2, like argparse's."""


def _existing_archive(text: str) -> str:
    """An argparse type: a path to an existing file (checked before any work)."""
    if not os.path.isfile(text):
        raise argparse.ArgumentTypeError(f"no such file: {text}")
    return text


def _token_ids(text: str) -> list[int]:
    parts = text.replace(" ", "").split(",")
    try:
        ids = [int(part) for part in parts]  # an empty part (1,,2 or a trailing comma) is not a token id
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of token ids, e.g. 1,2,3") from None
    if not ids or min(ids) < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give one or more token ids >= 0, e.g. 1,2,3")
    return ids


def _stop_text(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("an empty stop string would stop before the first token; give some text")
    return text


def _max_model_len(text: str) -> int:
    """--max-model-len: tokens >= 1 (vLLM also takes 1k / 32K, powers of 1000 / 1024 as its case says)."""
    multiplier = {"k": 1000, "K": 1024, "m": 1000 ** 2, "M": 1024 ** 2}.get(text[-1:], 1)
    value = _count(1)(text[:-1] if multiplier > 1 else text)
    return value * multiplier


def _seconds(text: str) -> float:
    return _number(0, open_below=True)(text)


def _number(minimum: float, maximum: float | None = None, open_below: bool = False):
    def parse(text: str) -> float:
        import math

        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(value) or (value <= minimum if open_below else value < minimum) or (
                maximum is not None and value > maximum):
            low = f"> {minimum}" if open_below else f">= {minimum}"
            raise argparse.ArgumentTypeError(f"must be {low}" + (f" and <= {maximum}" if maximum is not None else "")
                                             + f", got {text}")
        return value
    return parse


def _generate(args) -> int:
    from gdn_export.errors import GdnExportError
    from gdn_export.run.generation import RequestError, SamplingError, generate
    from gdn_export.run.generation.chat import ChatTemplateError
    from gdn_export.run.generation.executor import InlineExecutor
    from gdn_export.run.generation.generate import chat_prompt_ids
    from gdn_export.run.session import Session

    from gdn_export.run.generation.executor import ALLOW_LONG_ENV

    executor = InlineExecutor(Session(args.model, progress=_progress))  # says what the wait is while tract loads
    archive = executor.archive
    try:
        archive.limit_context(args.max_model_len, os.environ.get(ALLOW_LONG_ENV) == "1")
    except GdnExportError as err:
        raise UsageError(str(err)) from None
    if args.max_model_len is None and archive.context_note:
        _progress(f"warning: {archive.context_note}")
    prompt = args.prompt if args.prompt_ids is None else args.prompt_ids
    try:
        if args.chat:
            if args.prompt is None:
                raise RequestError("--chat takes the user's message as --prompt TEXT")
            prompt = chat_prompt_ids(archive, [{"role": "user", "content": args.prompt}])
        stop_token_ids = None if not args.ignore_eos else []
        speculative = _speculative_config(args, executor.archive.every_position, executor.archive.mtp)
        if speculative is not None and not executor.session.every_position:
            raise RequestError(f"{args.model} returns the last position's logits only (converted with --logits "
                               "last): --speculative needs every position's")
        if speculative is not None and speculative.method == "mtp" and executor.session.mtp is None:
            from gdn_export.run.mtp import no_mtp_message

            raise RequestError(no_mtp_message(executor.session.path))
        tokens = generate(executor, prompt, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                          top_p=args.top_p, seed=args.seed, stop=args.stop or None, stop_token_ids=stop_token_ids,
                          speculative=speculative)
    except (RequestError, SamplingError, ChatTemplateError) as err:
        raise UsageError(str(err)) from None
    text_out = archive.tokenizer is not None
    started, count, last, drafts = time.perf_counter(), 0, None, ""
    try:
        for token in tokens:
            if count == 0:
                first = time.perf_counter() - started
            count, last = count + 1, token
            if speculative is not None:
                drafts = f"; drafted {tokens.generation.drafted}, accepted {tokens.generation.accepted}"
            out = token.text if text_out else f"{'' if count == 1 else ' '}{token.token_id}"
            if out:
                sys.stdout.write(out)
                sys.stdout.flush()
    except BrokenPipeError:  # the reader left (| head): stop quietly
        tokens.close()
        sys.stdout = open(os.devnull, "w")
        return 0
    except KeyboardInterrupt:
        tokens.close()
        print(file=sys.stdout, flush=True)
        print(f"gdn-export: interrupted after {count} tokens", file=sys.stderr)
        return 130
    sys.stdout.write("\n")
    sys.stdout.flush()
    elapsed = time.perf_counter() - started
    rate = f", {(count - 1) / (elapsed - first):.1f} tokens/s after the first" if count > 1 and elapsed > first else ""
    print(f"[{count} tokens, finish: {last.finish_reason}"
          f"{f' ({last.stop_reason!r})' if last.stop_reason is not None else ''}; first token {first * 1e3:.0f} ms"
          f"{rate}{drafts}]", file=sys.stderr)
    return 0


def _speculative_config(args, every_position: bool, has_mtp: bool):
    """The SpeculativeConfig of --speculative, --draft-max, --prompt-lookup-max/-min (None: no drafts); without
    --speculative, the archive's default drafting (``default_speculative``: every_position, has_mtp say what it
    can run) with those options."""
    from gdn_export.run.generation import SpeculativeConfig

    from gdn_export.run.generation import SpeculativeError
    from gdn_export.run.generation.speculative import default_speculative

    if args.speculative in ("none", None) and args.draft is not None:
        raise UsageError("--draft ARCHIVE drafts with --speculative draft")
    method = args.speculative
    if method is None:
        default = default_speculative(every_position, has_mtp)
        method = "none" if default is None else default.method
    if method == "none":
        return None
    try:
        return SpeculativeConfig(method, args.draft_max, args.prompt_lookup_max,
                                 min(args.prompt_lookup_min, args.prompt_lookup_max), args.draft)
    except SpeculativeError as err:
        flag = {"num_speculative_tokens": "--draft-max", "model": "--draft"}.get(
            err.param, f"--{err.param.replace('_', '-')}")
        raise UsageError(f"{flag}: {err}") from None


def _add_speculative(parser, what: str) -> None:
    parser.add_argument("--speculative", choices=["none", "ngram", "draft", "mtp"], default=None,
                        help=f"{what}: draft tokens and verify them in one call per step (ngram: prompt lookup over "
                             "the prompt and the output so far; draft: the --draft archive; mtp: the archive's MTP head, "
                             "1 to --draft-max chained drafts; none: one token a step; exact: greedy output is the "
                             "same; default: the archive's default drafting, docs/GENERATING.md)")
    parser.add_argument("--draft", type=_existing_archive, default=None, metavar="ARCHIVE",
                        help="--speculative draft: the draft model's archive (the same tokenizer)")
    parser.add_argument("--draft-max", type=_count(1), default=3, metavar="K",  # SpeculativeConfig.num_speculative_tokens
                        help="at most K drafted tokens per step (default 3: a verify call of 4 tokens, one short "
                             "chunk of the chunked lowering's tail)")
    parser.add_argument("--prompt-lookup-max", type=_count(1), default=3, metavar="N",
                        help="ngram: the longest n-gram looked up (default 3)")
    parser.add_argument("--prompt-lookup-min", type=_count(1), default=2, metavar="N",
                        help="ngram: the shortest n-gram looked up (default 2)")


def _perplexity(args) -> int:
    """docs/PERPLEXITY.md: llama-perplexity's windows, the second half of each scored."""
    import json

    from gdn_export.run.perplexity import measure, progress_bar

    reference = None
    if args.reference is not None:
        if not os.path.isdir(args.reference):
            raise UsageError(f"--reference {args.reference} is not a checkpoint folder")

        def reference():
            from gdn_export.checkpoints.reference import eager_window_logits

            _quiet_transformers()
            return eager_window_logits(args.reference)

    result = measure(args.model, args.text, ctx=args.ctx, reference=reference, reference_dir=args.reference,
                     tokenizer_path=args.tokenizer, chunks=args.chunks,
                     progress=progress_bar(sys.stderr) if not args.quiet else None,
                     loading=_progress if not args.quiet else None)
    for line in result.lines():
        print(line)
    if args.json:
        print(json.dumps(result.as_dict()))
    return 0


def _serve(args) -> int:
    from gdn_export.errors import GdnExportError
    from gdn_export.run.generation.executor import ALLOW_LONG_ENV, context_bound
    from gdn_export.run.http import API_KEY_ENV, default_slots, model_name_of, serve

    name = args.served_model_name or model_name_of(os.path.basename(args.model))
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    allow_long = os.environ.get(ALLOW_LONG_ENV) == "1"

    from gdn_export.run.reading import read_metadata

    metadata = read_metadata(args.model) or {}
    batched = bool(metadata.get("serving"))
    try:
        context_bound(metadata.get("context_length"), args.max_model_len, allow_long)
    except GdnExportError as err:
        raise UsageError(str(err)) from None
    if batched and args.prefill_piece is not None:
        from gdn_export.run.serving.prefix_cache import ALIGN

        if args.prefill_piece % ALIGN:
            raise UsageError(f"--prefill-piece must be a multiple of {ALIGN} on a serving archive (the prefix "
                             f"cache's alignment), got {args.prefill_piece}")

    if args.speculative is None:  # a server drafts when asked (vLLM's default): batched rows were not measured
        args.speculative = "none"
    speculative = _speculative_config(args, metadata.get("logits") != "last", isinstance(metadata.get("mtp"), dict))
    if speculative is not None and metadata.get("logits") == "last":
        raise UsageError(f"{args.model} returns the last position's logits only (converted with --logits last): "
                         "--speculative needs every position's")
    if speculative is not None and speculative.method == "mtp" and not isinstance(metadata.get("mtp"), dict):
        from pathlib import Path

        from gdn_export.run.mtp import no_mtp_message

        raise UsageError(no_mtp_message(Path(args.model)))
    if not batched and args.prefill_rows != 1:
        raise UsageError(f"--prefill-rows batches prompts over a serving graph; {args.model} has none (convert it "
                         "with --serving)")
    if not batched and args.prefix_cache_mib is not None:
        raise UsageError(f"--prefix-cache-mib sizes the batched Engine's prefix cache; {args.model} has no serving "
                         "graph (convert it with --serving)")

    def ready(host: str, port: int) -> None:
        where = f"[{host}]" if ":" in host else host
        slots = f"continuous batching over {args.slots or default_slots(args.workers)} slots, " if batched else ""
        _progress(f"serving {args.model} as '{name}' on http://{where}:{port} ({slots}{args.workers} worker"
                  f"{'s' if args.workers > 1 else ''}, queue {args.max_queue}); Ctrl-C stops")

    def listening(host: str, port: int) -> None:
        where = f"[{host}]" if ":" in host else host
        _progress(f"listening at http://{where}:{port} while {args.model} loads (/health: 503 loading, then 200)")

    _progress(f"loading {args.model}")
    try:
        serve(args.model, args.host, args.port, workers=args.workers, max_queue=args.max_queue, model_name=name,
              log_level=args.log_level, ready=ready, slots=args.slots, progress=_progress,
              prefill_piece=args.prefill_piece, prefill_rows=args.prefill_rows, api_key=api_key,
              request_timeout=args.request_timeout, max_model_len=args.max_model_len, allow_long=allow_long,
              shutdown_grace=args.shutdown_grace, prefix_cache_mib=args.prefix_cache_mib, speculative=speculative,
              listening=listening)
    except KeyboardInterrupt:  # SIGTERM or Ctrl-C: the requests in flight were answered or ended (docs/SERVER.md)
        pass
    _progress("stopped")
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse's parser whose errors are one line (the usage block only with --help)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def parser() -> argparse.ArgumentParser:
    top = _Parser(prog="gdn-export", description=__doc__.splitlines()[0])
    from gdn_export import __version__

    top.add_argument("--version", action="version", version=f"gdn-export {__version__}")
    sub = top.add_subparsers(dest="command", required=True)
    convert = sub.add_parser("convert", help="convert a local Hugging Face checkpoint to .nnef.tgz and check it")
    convert.add_argument("checkpoint", help="folder with config.json and *.safetensors")
    convert.add_argument("-o", "--output", required=True, help="the .nnef.tgz to write")
    convert.add_argument("--dtype", choices=["float32", "float16"], default="float32")
    convert.add_argument("--lowering", choices=list(LOWERINGS), default="auto",
                         help="gated delta rule: the fastest exact one for --runtime (auto), the fused tract op "
                              "(native, an error where inexact), or a portable lowering")
    convert.add_argument("--format", choices=[backend.name for backend in BACKENDS], default=None,
                         help=f"{' or '.join(backend.help for backend in BACKENDS)}; default: from the output's suffix")
    convert.add_argument("--runtime", choices=list(ALL_RUNTIMES),
                         default=None,
                         help="where the model will run: tract cpu (default), cuda, any; with --format onnx "
                              "onnxruntime (default: its contrib ops where exact), tract-onnx, any (portable Scan)")
    convert.add_argument("--core-dtype", choices=["float16"], default=None,
                         help="run the fused op on float16 q/k/v/beta in a float32 model (tract's CUDA kernel is "
                              "f16-only); inexact, reported")
    convert.add_argument("--chunk-size", type=_chunk_size, default=None,
                         help="tokens per chunk of the chunked lowering, a multiple of 16 (default: 64, or 32 with "
                              "per-channel decay)")
    convert.add_argument("--tail-chunk", type=int, choices=[1, 2, 4, 8, 16], default=None,
                         help="tokens per short chunk of the chunked lowering's tail, the last S mod C tokens "
                              "(default 4: a verify call of a few tokens costs about one step; 1: token by token, "
                              "which tract loads faster)")
    convert.add_argument("--tract-version", type=_version, help="tract version to target (default: the installed one)")
    convert.add_argument("--check", choices=["auto", "full", "layerwise"], default="auto",
                         help="the check's reference: transformers' whole model in memory (full), one decoder "
                              "layer in memory at a time (layerwise), or full where it fits (auto)")
    convert.add_argument("--no-check", action="store_true", help="run no check at all")
    convert.add_argument("--quantize", choices=list(formats.names()), default=None, help=formats.quantize_help())
    convert.add_argument("--quantize-embeddings", action="store_true",
                         help="with --quantize, the embedding table too (refused when the head is tied to it)")
    for option in _format_options():  # the options a weight format owns, as its registry entry declares them
        convert.add_argument(option.flag, dest=option.name, default=option.default, **option.cli)
    convert.add_argument("--logits", choices=["all", "last"], default="all",
                         help="logits of every new position (all: scoring, perplexity) or of the last one only "
                              "(last: generation; the head then runs once per call, not per prompt token)")
    convert.add_argument("--serving", action="store_true",
                         help="the graph `gdn-export serve` batches concurrent requests with (each row its own past "
                              "length; docs/SERVING.md)")
    convert.add_argument("--prompt-len", type=_count(1), default=16, help="the check's prefill length")
    convert.add_argument("--decode-steps", type=_count(0), default=8, help="the check's single-token decode steps")
    convert.add_argument("--in-memory", action="store_true",
                         help="load the whole model in memory before exporting (default: every weight is written "
                              "straight from the checkpoint's files; the same archive)")
    convert.add_argument("--force", action="store_true", help="overwrite OUTPUT if it exists")
    convert.set_defaults(run=_convert)
    _add_debug(convert)
    check = sub.add_parser("check", help="compare an exported model with transformers on prefill and decode")
    check.add_argument("model", help="the .nnef.tgz (or .onnx: checked in onnxruntime)")
    check.add_argument("checkpoint", help="the checkpoint it was converted from")
    check.add_argument("--prompt-len", type=_count(1), default=16)
    check.add_argument("--decode-steps", type=_count(0), default=8)
    check.add_argument("--batch", type=_count(1), default=1)
    check.add_argument("--kind", choices=["auto", "full", "layerwise"], default="auto",
                       help="the reference: whole model in memory, layer by layer, or full where it fits")
    check.add_argument("--calibration", metavar="TEXT_FILE", default=None,
                       help="a Q4_0 archive converted with --calibration: the same text (its scales are computed "
                            "again from it)")
    check.set_defaults(run=_check)
    _add_debug(check)
    info = sub.add_parser("info", help="show an exported model's inputs, outputs, lowerings and versions")
    info.add_argument("model", help="the .nnef.tgz")
    info.set_defaults(run=_info)
    _add_debug(info)
    gen = sub.add_parser("generate", help="continue a prompt with an exported model, streaming the text")
    gen.add_argument("model", type=_existing_archive, help="the .nnef.tgz")
    what = gen.add_mutually_exclusive_group(required=True)
    what.add_argument("--prompt", help="the prompt text (through the archive's tokenizer)")
    what.add_argument("--prompt-ids", type=_token_ids, help="the prompt as token ids, e.g. 1,2,3")
    gen.add_argument("--chat", action="store_true",
                     help="--prompt is a user message, rendered through the archive's chat template")
    gen.add_argument("--max-new-tokens", type=_count(1), default=None,
                     help="at most this many new tokens (default: generation_config.json's, else 256)")
    gen.add_argument("--temperature", type=_number(0), default=None,
                     help="0: greedy (default: generation_config.json's sampling, else greedy)")
    gen.add_argument("--top-p", type=_number(0, 1, open_below=True), default=None,
                     help="keep the most probable tokens whose probability reaches P")
    gen.add_argument("--top-k", type=_count(0), default=None, help="keep the K most probable tokens (0: all)")
    gen.add_argument("--seed", type=_count(0), default=None, help="seed of the sampling (reproducible draws)")
    gen.add_argument("--stop", action="append", default=[], type=_stop_text,
                     help="stop before this text (repeatable)")
    gen.add_argument("--max-model-len", type=_max_model_len, default=None, metavar="TOKENS",
                     help="prompt + new tokens at most (default: the model's context, stored in the archive; "
                          "docs/SERVER.md)")
    gen.add_argument("--ignore-eos", action="store_true",
                     help="do not stop at generation_config.json's eos_token_id")
    _add_speculative(gen, "decoding")
    gen.set_defaults(run=_generate)
    _add_debug(gen)
    ppl = sub.add_parser("perplexity", help="perplexity of an exported model on a text file (llama-perplexity's "
                                             "windows), with --reference its KL divergence from the checkpoint")
    ppl.add_argument("model", type=_existing_archive, help="the .nnef.tgz or .onnx (every position's logits)")
    ppl.add_argument("text", type=_existing_archive, help="a UTF-8 text file")
    ppl.add_argument("--ctx", type=_count(4), default=256,
                     help="tokens per window; the second half of each is scored (default 256)")
    ppl.add_argument("--chunks", type=_count(1), default=None, help="score the first N windows only (default: all)")
    ppl.add_argument("--reference", default=None, metavar="CHECKPOINT_DIR",
                     help="also transformers' float32 perplexity on the same windows, mean and 99th percentile KL "
                          "divergence and top-1 agreement (needs torch and transformers)")
    ppl.add_argument("--tokenizer", default=None, metavar="TOKENIZER_JSON",
                     help="a tokenizer.json (or a folder with one) instead of the archive's (an .onnx carries none)")
    ppl.add_argument("--json", action="store_true", help="also one JSON object on the last line of stdout")
    ppl.add_argument("--quiet", action="store_true", help="no progress bar on stderr")
    ppl.set_defaults(run=_perplexity)
    _add_debug(ppl)
    srv = sub.add_parser("serve", help="serve an exported model over OpenAI-compatible HTTP")
    srv.add_argument("model", type=_existing_archive, help="the .nnef.tgz")
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    srv.add_argument("--port", type=_port, default=8000, help="TCP port (default 8000; 0: a free one, printed)")
    srv.add_argument("--workers", type=_count(1), default=1,
                     help="requests computed at once, each by a thread over one shared tract plan (default 1)")
    srv.add_argument("--max-queue", type=_count(0), default=16,
                     help="requests waiting for a worker; beyond, 503 (default 16)")
    srv.add_argument("--prefill-piece", type=_count(1), default=None, metavar="TOKENS",
                     help="prompt tokens per prefill call (default 128; a multiple of 64 on a serving archive): "
                          "smaller holds up the other requests' next tokens for less time (measured on a 580M f32 "
                          "model, 8 clients: 64 tokens cut the inter-token p99 from 2.2 to 1.5 s for 6%% less "
                          "throughput)")
    srv.add_argument("--prefill-rows", type=_count(1), default=1, metavar="N",
                     help="a serving archive: the prompt pieces of up to N requests run in one call, each its own "
                          "length (default 1; each row count is one more plan of packed weights)")
    srv.add_argument("--prefix-cache-mib", type=_number(0), default=None, metavar="MIB",
                     help="a serving archive: memory for snapshots of the states at a prompt's multiples of 64 "
                          "tokens, reused by prompts that start the same (least recently used out; default 512, "
                          "0: none); on top of the slots' memory (docs/SERVING.md)")
    srv.add_argument("--slots", type=_count(1), default=None,
                     help="a serving archive (convert --serving): requests batched at once, split over the workers "
                          "(default 8)")
    srv.add_argument("--served-model-name", default=None,
                     help="the model's name in the API (default: the file name without .nnef.tgz)")
    srv.add_argument("--api-key", default=None, metavar="KEY",
                     help="ask every /v1 request for 'Authorization: Bearer KEY' (default: the GDN_EXPORT_API_KEY "
                          "environment variable; none: no key asked)")
    srv.add_argument("--max-model-len", type=_max_model_len, default=None, metavar="TOKENS",
                     help="prompt + new tokens at most (default: the model's context, stored in the archive)")
    srv.add_argument("--request-timeout", type=_seconds, default=None, metavar="SECONDS",
                     help="a request still unanswered after this long is ended (408; default: no deadline)")
    srv.add_argument("--shutdown-grace", type=_number(0), default=10.0, metavar="SECONDS",
                     help="on SIGTERM, in-flight requests get this long to finish before they are ended with an "
                          "error (default 10)")
    srv.add_argument("--log-level", choices=["critical", "error", "warning", "info", "debug"], default="warning",
                     help="uvicorn's log level (info logs every request)")
    _add_speculative(srv, "every request's default (a request's speculative_config overrides it)")
    srv.set_defaults(run=_serve)
    _add_debug(srv)
    return top


def _port(text: str) -> int:
    value = _count(0)(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"a TCP port is at most 65535, got {value}")
    return value


def _add_debug(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--debug", action="store_true", help="print the full traceback of a failure")


def _interrupt_on_sigterm() -> None:
    """SIGTERM ends the command like Ctrl-C: the cleanup that removes partial output runs."""
    import signal

    def stop(signum, frame):
        raise KeyboardInterrupt

    if hasattr(signal, "SIGTERM"):
        signal.signal(signal.SIGTERM, stop)


def _fail(message: str, debug: bool) -> int:
    if debug:
        import traceback

        traceback.print_exc()
    print(f"gdn-export: error: {message}", file=sys.stderr)
    return 1


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    os.environ.setdefault("RUST_BACKTRACE", "0")
    logging.basicConfig(level=logging.ERROR)
    warnings.filterwarnings("ignore")
    _interrupt_on_sigterm()
    try:
        if args.command in ("convert", "check"):  # the others never import transformers: its import takes seconds
            _quiet_transformers()
        return args.run(args)
    except KeyboardInterrupt:
        print("gdn-export: interrupted; no output was left behind", file=sys.stderr)
        return 130
    except UsageError as err:
        print(f"gdn-export {args.command}: error: {_first_line(err)}", file=sys.stderr)
        return 2
    except GdnExportError as err:
        return _fail(_first_line(err) or type(err).__name__, args.debug)
    except BrokenPipeError:  # the reader left (gdn-export info ... | head): stop quietly, as generate does
        sys.stdout = open(os.devnull, "w")
        return 0
    except ModuleNotFoundError as err:  # convert without the [convert] extra, serve without [serve], ...
        missing = missing_extra(err, f"gdn-export {args.command}")
        if missing is None:
            return _fail(f"unexpected {type(err).__name__}: {_first_line(err)} (rerun with --debug for the "
                         "traceback)", args.debug)
        return _fail(str(missing), args.debug)
    except OSError as err:  # a file the user named could not be read or written
        where = f"{err.filename}: " if err.filename else ""
        return _fail(f"{where}{err.strerror or err}", args.debug)
    except Exception as err:  # a defect of gdn_export or of a library: still one line, the rest with --debug
        return _fail(f"unexpected {type(err).__name__}: {_first_line(err)} (rerun with --debug for the traceback)",
                     args.debug)


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else ""


if __name__ == "__main__":
    sys.exit(main())
