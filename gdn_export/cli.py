"""``gdn-export``: convert, check and inspect gated delta-rule checkpoints for tract.

    gdn-export convert CHECKPOINT_DIR -o OUT.nnef.tgz [--dtype float32|float16] [--runtime cpu|cuda|any]
                       [--lowering auto|native|scan|recurrent|chunked] [--core-dtype float16]
                       [--chunk-size N] [--tract-version V] [--no-check] [--force]
    gdn-export check OUT.nnef.tgz CHECKPOINT_DIR [--prompt-len N] [--decode-steps M] [--batch B]
    gdn-export info OUT.nnef.tgz

Exit status 0 on success; 1 with a one-line reason on any failure (``--debug``: the traceback too); 2 on a
usage error (checked before any work); 130 when interrupted (Ctrl-C, SIGTERM), leaving no output behind.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import warnings
from typing import Sequence

from gdn_export.lowering.capabilities import parse_version  # these three are light: --help imports no torch
from gdn_export.lowering.policy import RUNTIMES
from gdn_export.lowering.registry import LOWERINGS


def _progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _convert(args) -> int:
    from gdn_export.hf.convert import check_output_path, convert

    check_output_path(args.output, args.force, force_hint="--force")
    report = convert(args.checkpoint, args.output, dtype=args.dtype, lowering=args.lowering,
                     tract_version=args.tract_version, check=False if args.no_check else args.check,
                     force=args.force, progress=_progress, runtime=args.runtime, core_dtype=args.core_dtype,
                     chunk_size=args.chunk_size, streamed=not args.in_memory, prompt_len=args.prompt_len,
                     decode_steps=args.decode_steps, quantize=args.quantize,
                     quantize_embeddings=args.quantize_embeddings)
    print(report)
    return 0


def _check(args) -> int:
    from gdn_export.errors import GdnExportError
    from gdn_export.hf.convert import check

    _progress(f"checking {args.model} against {args.checkpoint}: prefill {args.prompt_len} + decode "
              f"{args.decode_steps}, batch {args.batch}")
    result = check(args.model, args.checkpoint, args.prompt_len, args.decode_steps, args.batch, kind=args.kind)
    print(f"{args.model}: {result}")
    if not result.ok:
        raise GdnExportError(f"{args.model} does not match {args.checkpoint}: {result}")
    return 0


def _info(args) -> int:
    from gdn_export.archive import read_metadata
    from gdn_export.runtime import load_tract_model

    metadata = read_metadata(args.model) or {}
    runnable = load_tract_model(args.model)
    print(f"{args.model}")
    if metadata:
        print(f"  family: {metadata.get('family')} ({metadata.get('model_type')}), dtype {metadata.get('dtype')}, "
              f"vocab {metadata.get('vocab_size')}")
    print(f"  tract: target {_property(args.model, 'tract_target_version')}, runtime {_tract_version()}")
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
    from gdn_export.runtime import tract_version

    return tract_version()


def _quiet_transformers() -> None:
    """transformers prints loading bars and kernel fallback notes that say nothing about the export."""
    try:
        import transformers
    except ImportError:
        return
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()


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
    from gdn_export.lowering.chunked import chunk_size_error  # the rule itself; imported only when the option is given

    value = _count(1)(text)
    if chunk_size_error(value):
        raise argparse.ArgumentTypeError(chunk_size_error(value))
    return value


def _version(text: str) -> str:
    try:
        parse_version(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return text


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="gdn-export", description=__doc__.splitlines()[0])
    sub = top.add_subparsers(dest="command", required=True)
    convert = sub.add_parser("convert", help="convert a local Hugging Face checkpoint to .nnef.tgz and check it")
    convert.add_argument("checkpoint", help="folder with config.json and *.safetensors")
    convert.add_argument("-o", "--output", required=True, help="the .nnef.tgz to write")
    convert.add_argument("--dtype", choices=["float32", "float16"], default="float32")
    convert.add_argument("--lowering", choices=list(LOWERINGS), default="auto",
                         help="gated delta rule: the fastest exact one for --runtime (auto), the fused tract op "
                              "(native, an error where inexact), or a portable lowering")
    convert.add_argument("--runtime", choices=list(RUNTIMES), default="cpu",
                         help="where tract will run the model: auto picks the fastest exact lowering there")
    convert.add_argument("--core-dtype", choices=["float16"], default=None,
                         help="run the fused op on float16 q/k/v/beta in a float32 model (tract's CUDA kernel is "
                              "f16-only); inexact, reported")
    convert.add_argument("--chunk-size", type=_chunk_size, default=None,
                         help="tokens per chunk of the chunked lowering, a multiple of 16 (default: 64, or 32 with "
                              "per-channel decay)")
    convert.add_argument("--tract-version", type=_version, help="tract version to target (default: the installed one)")
    convert.add_argument("--check", choices=["auto", "full", "layerwise"], default="auto",
                         help="the check's reference: transformers' whole model in memory (full), one decoder "
                              "layer in memory at a time (layerwise), or full where it fits (auto)")
    convert.add_argument("--no-check", action="store_true", help="run no check at all")
    convert.add_argument("--quantize", choices=["q4_0"], default=None,
                         help="store every linear layer's weight (inner size a multiple of 32) in tract's Q4_0")
    convert.add_argument("--quantize-embeddings", action="store_true",
                         help="with --quantize, the embedding table too (refused when the head is tied to it)")
    convert.add_argument("--prompt-len", type=_count(1), default=16, help="the check's prefill length")
    convert.add_argument("--decode-steps", type=_count(0), default=8, help="the check's single-token decode steps")
    convert.add_argument("--in-memory", action="store_true",
                         help="load the whole model in memory before exporting (default: every weight is written "
                              "straight from the checkpoint's files; the same archive)")
    convert.add_argument("--force", action="store_true", help="overwrite OUTPUT if it exists")
    convert.set_defaults(run=_convert)
    _add_debug(convert)
    check = sub.add_parser("check", help="compare an exported model with transformers on prefill and decode")
    check.add_argument("model", help="the .nnef.tgz")
    check.add_argument("checkpoint", help="the checkpoint it was converted from")
    check.add_argument("--prompt-len", type=_count(1), default=16)
    check.add_argument("--decode-steps", type=_count(0), default=8)
    check.add_argument("--batch", type=_count(1), default=1)
    check.add_argument("--kind", choices=["auto", "full", "layerwise"], default="auto",
                       help="the reference: whole model in memory, layer by layer, or full where it fits")
    check.set_defaults(run=_check)
    _add_debug(check)
    info = sub.add_parser("info", help="show an exported model's inputs, outputs, lowerings and versions")
    info.add_argument("model", help="the .nnef.tgz")
    info.set_defaults(run=_info)
    _add_debug(info)
    return top


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
        from gdn_export.errors import GdnExportError  # imports the package (torch): after the arguments parse

        _quiet_transformers()
        return args.run(args)
    except KeyboardInterrupt:
        print("gdn-export: interrupted; no output was left behind", file=sys.stderr)
        return 130
    except GdnExportError as err:
        return _fail(_first_line(err) or type(err).__name__, args.debug)
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
