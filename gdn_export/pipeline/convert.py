"""``gdn_export.convert``: a local Hugging Face checkpoint to a checked ``.nnef.tgz`` in one call."""

from __future__ import annotations

import os
import tempfile
import time
from functools import partial
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from gdn_export.errors import GdnExportError, LoweringError, ParityError, worded
from gdn_export.targets import FLOAT_DTYPES, backend_for, backend_named, load
from gdn_export.run.archive import GENERATION_FILES, nnef_tgz_path
from gdn_export.targets import parse_version
from gdn_export.hf.check import LogitCheck, check_archive, transformers_references, validate_check
from gdn_export.checkpoints import family_for, open_checkpoint, read_config
from gdn_export.hf.checkpoint import CheckpointError, cast_buffers, empty_model, materialize, model_in_memory
from gdn_export.hf.layerwise import layerwise_logits
from gdn_export.hf.layout import resolve_layout
from gdn_export.hf.weight_writers import (dequantized_view, int8_reference_linears, plan_writes, separate_tied_head,
                                          untied_view)
from gdn_export.weights.formats import check_owned_options, weight_format
from gdn_export.run.runtime import lean_allocator
from gdn_export.models.decoder import serving_inputs
from gdn_export.ops.moe_ffn.op import moe_report
from gdn_export.backends.staging import staging_folder

DTYPES = {name: getattr(torch, name) for name in FLOAT_DTYPES}
LOGITS = ("all", "last")  # the logits a call returns: of every new position, or of the last one only
FORMAT_VERSION = 1


@dataclass
class LayerReport:
    index: int
    kind: str  # "gated delta rule" or "attention"
    lowering: str = "-"
    reason: str = ""


@dataclass
class ConvertReport:
    path: Path
    family: str
    model_type: str
    dtype: str
    tract_version: str
    layers: list[LayerReport] = field(default_factory=list)
    check: LogitCheck | None = None
    seconds: dict[str, float] = field(default_factory=dict)
    reference: str = "transformers"
    weights: str = ""  # what was read from the checkpoint, and what was left out
    generation_files: list[str] = field(default_factory=list)  # tokenizer, chat template... carried in the archive
    check_kind: str = ""
    quantization: str = ""  # what was stored in Q4_0 or int8
    quantized_as: str = ""  # "Q4_0", or "int8" (the reference then rounds the inputs of those layers as tract)
    moe: list[str] = field(default_factory=list)  # MoE feed-forwards: sparse or dense, and why (ops/moe_ffn.py)
    mtp: str = ""  # the checkpoint's MTP head: carried (and checked) or left out, and why (pipeline/mtp.py)
    shared_constants: int = 0  # constants equal to an earlier one, written once (backends/nnef/shared_constants.py)
    float_linears: int = 0  # linear layers on their float weight as stored (backends/nnef/float_linears.py)

    @property
    def quality(self) -> LogitCheck | None:
        """A quantized export against the unquantized reference (reported, not judged)."""
        return self.check.quality if self.check is not None else None

    def __str__(self) -> str:
        gdn = sum(1 for layer in self.layers if layer.kind == "gated delta rule")
        lines = [f"{self.path}: {self.family} ({self.model_type}), {len(self.layers)} layers ({gdn} gated delta rule, "
                 f"{len(self.layers) - gdn} attention), {self.dtype}, tract {self.tract_version}"]
        for layer in self.layers:
            if layer.kind == "gated delta rule":
                lines.append(f"  layer {layer.index}: {layer.lowering} - {layer.reason}")
        lines.extend(f"  {line}" for line in self.moe)
        if self.mtp:
            lines.append(f"  {self.mtp}")
        if self.weights:
            lines.append(f"  weights: {self.weights}")
        if self.shared_constants:
            lines.append(f"  constants: {self.shared_constants} equal to an earlier one, written once (tract's reader "
                         "compares each constant it reads with every node before it)")
        if self.float_linears:
            lines.append(f"  linear layers: {self.float_linears} read their float weight as stored (tract_core_einsum; "
                         "no copy of it per axis op at load)")
        lines.append("  for generation: " + (", ".join(self.generation_files) if self.generation_files else
                                             "no tokenizer, chat template or generation config in the checkpoint: "
                                             "the archive takes token ids"))
        if self.quantization:
            lines.append(f"  quantized: {self.quantization}")
        if self.check is not None:
            against = f" with the same {self.quantized_as} weights" if self.quantization else ""
            lines.append(f"  check vs {self.reference}{against} ({self.check_kind}): {self.check}")
        else:  # a report is returned only once its check passed: no check means check=False
            lines.append("  not checked (check=False / --no-check): tract's logits were not compared with anything")
        if self.quality is not None:
            lines.append(f"  {quality_line(self.quality)}")
        lines.append("  time: " + ", ".join(f"{k} {v:.1f}s" for k, v in self.seconds.items()))
        return "\n".join(lines)


def quality_line(quality: LogitCheck) -> str:
    """A quantized archive's logits against the unquantized model, as ``convert`` and ``check`` print them."""
    return (f"quality vs the unquantized model (reported, not judged): mean KL {quality.mean_kl:.2e} nats, top-1 "
            f"agreement {100 * quality.top1_all:.1f}%, max |logit error| {quality.max_abs_error:.2e}")


def state_names(lm) -> tuple[list[str], list[str], dict]:
    served = serving_inputs(lm.serving, lm.states)
    inputs = ["input_ids"] + served + [f"in_{s.name}" for s in lm.states]
    outputs = ["logits"] + [f"out_{s.name}" for s in lm.states] + (["hidden"] if getattr(lm, "emits_hidden", False)
                                                                   else [])
    dynamic = {"input_ids": {0: "B", 1: "S"}, **{name: {0: "B"} for name in served}}
    dynamic.update({f"in_{s.name}": s.dynamic_axes for s in lm.states})
    return inputs, outputs, dynamic


def example_inputs(lm, vocab_size: int, dtype: torch.dtype, batch: int = 1, seq: int = 3, past: int = 2):
    """Traced example: a non-empty past (so P is a real axis) and random states (so the export check means something);
    a serving graph's ``past_len`` one short of the cache, so that the check sees a padded key masked, and its
    ``seq_len`` all S tokens."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab_size, (batch, seq), generator=gen)
    served = {"past_len": past - 1, "seq_len": seq}
    states = [torch.full((batch,), served[name], dtype=torch.int64) for name in serving_inputs(lm.serving, lm.states)]
    for spec in lm.states:
        shape = [batch if d == "B" else past if d == "P" else d for d in spec.shape]
        states.append((0.1 * torch.randn(shape, generator=gen)).to(spec.dtype))
    return (ids, *states)


def check_output_path(out_path: str | os.PathLike, force: bool) -> Path:
    """Refuse before any work: a wrong suffix, a folder, an existing file without ``force``, or a folder where
    no file can be created."""
    out_path = nnef_tgz_path(out_path)
    if out_path.is_dir():
        raise GdnExportError(f"{out_path} is a directory; the output must name the .nnef.tgz file to write")
    if out_path.exists() and not force:
        raise worded(GdnExportError(f"{out_path} exists; pass force=True to overwrite it"),
                     f"{out_path} exists; pass --force to overwrite it", usage=False)
    folder = out_path.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as err:
        raise GdnExportError(f"cannot write {out_path}: no file can be created in {folder} ({err.strerror})") from None
    return out_path


CHECKS = ("auto", "full", "layerwise")
# what a check's reference is, for the report
CHECK_KINDS = {"full": "whole model in memory", "layerwise": "layer by layer (one decoder layer in memory at a time)"}
# the files of a checkpoint folder that the archive carries to generate text (tract ignores them): GENERATION_FILES


@dataclass(frozen=True)
class BackendChoice:
    """The back-end's options (``targets.BACKENDS``): which one writes the file, where it will run, for which tract
    (NNEF only: the back-end's ``owns``)."""

    format: str  # "nnef" or "onnx"
    runtime: str  # for ONNX "onnxruntime", "tract-onnx" or "any" ("cpu", NNEF's default, means onnxruntime)
    tract_version: str | None


@dataclass(frozen=True)
class GatedDeltaRuleChoice:
    """The gated delta rule's options (validated by ``ops/gated_delta_rule/nnef/options.py``; ONNX takes the
    lowering only, from its own list)."""

    lowering: str
    core_dtype: str | None
    chunk_size: int | None
    tail_chunk: int | None = None


@dataclass(frozen=True)
class WeightChoice:
    """The weight format's options (``weights/formats.py``: ``quantize`` names the format, the others are those a
    format owns, checked and completed by it)."""

    quantize: str | None
    quantize_embeddings: bool
    q4_rule: str
    calibration: str | os.PathLike | None
    calibration_tokens: int
    fold_scales: bool
    int8_passes: int = 1


# ConvertPlan's groups, each by what it configures: plan_conversion fills each from the options by its fields' names
GROUPS = {"backend": BackendChoice, "gated_delta_rule": GatedDeltaRuleChoice, "weights": WeightChoice}


@dataclass(frozen=True)
class ConvertPlan:
    """``convert``'s options, validated once (``plan_conversion``), and the format that carries them out. The
    orchestration (``run_plan``) and the format's steps read only this. Grouped by what they configure: the
    conversion's own here, then the back-end's, the gated delta rule's and the weight format's."""

    checkpoint_dir: str | os.PathLike  # as given (the progress lines and calibration name it so)
    out_path: Path
    dtype: str
    check: str | None  # "auto", "full", "layerwise"; None: no check
    prompt_len: int
    decode_steps: int
    streamed: bool
    logits: str
    serving: bool
    backend: BackendChoice
    gated_delta_rule: GatedDeltaRuleChoice
    weights: WeightChoice
    batch: int = 1

    @property
    def export_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


@dataclass
class Traced:
    """What a format's ``read`` step made of the checkpoint: the exportable module and what its export, report and
    check need (``extras``: the format's own). ``lm`` and ``model`` are dropped before the check."""

    family: object
    layout: object
    model: object
    weights: object
    lm: object
    extras: dict = field(default_factory=dict)


@dataclass
class Staged:
    """A format's export, written in the staging folder: its main file, what publishing moves, and its report."""

    path: Path
    report: ConvertReport
    publish: Callable[[], None]


def convert(
    checkpoint_dir: str | os.PathLike,
    out_path: str | os.PathLike,
    *,
    dtype: str = "float32",
    lowering: str = "auto",
    tract_version: str | None = None,
    check: bool | str = True,
    force: bool = False,
    prompt_len: int = 16,
    decode_steps: int = 8,
    progress: Callable[[str], None] | None = None,
    runtime: str = "cpu",
    core_dtype: str | None = None,
    chunk_size: int | None = None,
    tail_chunk: int | None = None,
    streamed: bool = True,
    quantize: str | None = None,
    quantize_embeddings: bool = False,
    logits: str = "all",
    format: str = "nnef",
    serving: bool = False,
    q4_rule: str | None = None,
    calibration: str | os.PathLike | None = None,
    calibration_tokens: int = 8192,
    fold_scales: bool = False,
    int8_passes: int = 1,
) -> ConvertReport:
    """Convert a local checkpoint (config.json + safetensors) into ``out_path`` and check it in tract.

    The graph serves prefill and decode (symbolic batch, sequence and past); ``runtime`` ("cpu", "cuda",
    "any") picks the fastest exact lowering for where tract will run it. ``streamed`` (the default): the model is
    traced with placeholder weights and every weight is written to the archive straight from the checkpoint's
    files, one tensor at a time, so memory stays bounded by the largest tensor; ``streamed=False`` loads the model
    in memory first (the same archive, byte for byte). ``quantize="q4_0"`` stores every linear layer's weight whose
    inner size is whole blocks of 32 in tract's Q4_0 (``quantize_embeddings``: the embedding table too), each block's
    scale chosen by ``q4_rule`` ("search", least squared error, the default; "gptq", the default with calibration;
    "nearest", llama.cpp's ``d = extreme / -8``);
    ``calibration``: a text file whose first ``calibration_tokens`` tokens measure each linear layer's input channel
    importance and second moments (``gdn_export.hf.calibration``; docs/Q4_0.md), and, with
    ``fold_scales`` (off by default), per-channel scales folded into the norms whose output only linear layers read
    (``gdn_export.hf.folding``: exact in float, verified). ``quantize="int8"``: every linear layer's weight in int8
    with a scale per output channel, its input rounded per row in the graph, in ``int8_passes`` (2: the rounding's
    residual too, a second int8 row per row; docs/INT8.md). ``quantize="f16"``: every linear layer's weight and the
    embedding table in float16 for a float32 graph (on a CPU faster than ``dtype="float16"``; docs/QUANTIZATION.md).
    ``logits``:
    "all" (logits of every new position) or "last" (of the last one only, ``[B, 1, vocab]``: what generation needs;
    the head then runs once per call). ``serving``: the graph ``gdn_export.Engine`` batches requests with (a second
    input ``past_len [B]``, each row's own past length; cache outputs are the new positions only; docs/SERVING.md).
    The check
    then compares tract with the reference computing with the same Q4_0 weights (exactness, the float rule), and
    the report adds the quality against the model as published (mean KL, top-1), which is not judged. ``check``: True or "auto" checks a prefill of
    ``prompt_len`` tokens and ``decode_steps`` single-token steps in tract against transformers' eager model,
    whole in memory where it fits ("full") or else one layer at a time ("layerwise"), beyond tolerance
    ParityError; False runs no check at all. ``format="onnx"``: a ``.onnx`` file checked in onnxruntime
    (``gdn_export.pipeline.onnx_convert``). Every argument is validated before any work (``plan_conversion``);
    ``out_path`` appears only once written and checked: on any error or interruption nothing is left, neither it
    nor a temporary file.
    """
    plan = plan_conversion(checkpoint_dir, out_path, dtype=dtype, lowering=lowering, tract_version=tract_version,
                           check=check, force=force, prompt_len=prompt_len, decode_steps=decode_steps,
                           runtime=runtime, core_dtype=core_dtype, chunk_size=chunk_size, tail_chunk=tail_chunk,
                           streamed=streamed,
                           quantize=quantize, quantize_embeddings=quantize_embeddings, logits=logits, format=format,
                           serving=serving, q4_rule=q4_rule, calibration=calibration,
                           calibration_tokens=calibration_tokens, fold_scales=fold_scales, int8_passes=int8_passes)
    return run_plan(plan, progress)


def plan_conversion(checkpoint_dir: str | os.PathLike, out_path: str | os.PathLike, *, force: bool = False,
                    check: bool | str = True, format: str = "nnef", runtime: str = "cpu", batch: int = 1,
                    calibration: str | os.PathLike | None = None, **options) -> ConvertPlan:
    """Every option of ``convert`` validated, once, before any work: the frozen plan, or a ``GdnExportError``
    naming the option and what it accepts. The options common to both formats are checked here, the others by the
    format (``format_steps(format)``: ``validate``, ``validate_after_check``, ``output_path``). An error about an
    option the command line spells differently carries that wording too (``errors.worded``: ``err.flags``), which
    the CLI prints."""
    defaults = dict(dtype="float32", lowering="auto", prompt_len=16, decode_steps=8, tract_version=None,
                    core_dtype=None, chunk_size=None, tail_chunk=None, streamed=True, quantize=None,
                    quantize_embeddings=False,
                    logits="all", serving=False, q4_rule=None, calibration_tokens=8192, fold_scales=False,
                    int8_passes=1)
    unknown = set(options) - set(defaults)
    if unknown:
        raise TypeError(f"plan_conversion() got unexpected options {sorted(unknown)}")
    target = format_steps(format)
    runtime = target.resolve_runtime(runtime)
    target.validate({**options, "calibration": calibration}, runtime)  # first: what the format cannot honour
    # the options a weight format owns (q4_rule, int8_passes, ...): refused without it, checked and completed by it
    check_owned_options(options.get("quantize"), options, calibration)
    dtype = options.get("dtype", "float32")
    if dtype not in DTYPES:
        raise GdnExportError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    check_mode = "auto" if check is True else check or None
    if check_mode is not None and check_mode not in CHECKS:
        raise GdnExportError(f"check {check!r} is not one of True, False, {', '.join(repr(c) for c in CHECKS)}")
    target.validate_after_check(options, runtime)
    if check_mode:
        validate_check(options.get("prompt_len", 16), options.get("decode_steps", 8), batch)
    out = target.output_path(out_path, force)
    values = {**defaults, **options, "format": format, "runtime": runtime, "calibration": calibration}
    groups = {name: group(**{f.name: values.pop(f.name) for f in dataclasses.fields(group)})
              for name, group in GROUPS.items()}
    return ConvertPlan(checkpoint_dir=checkpoint_dir, out_path=out, check=check_mode, batch=batch, **values, **groups)


def format_steps(format: str):
    """The format-specific steps of a conversion (validate, output path, read, export, check targets)."""
    return load(backend_named(format).steps)


def common_metadata(plan: ConvertPlan, traced: Traced, inputs: list[str], outputs: list[str]) -> dict:
    """The archive metadata both formats write (``gdn_export.json`` / the .onnx's metadata)."""
    layout = traced.layout
    return {
        "format": FORMAT_VERSION, "family": traced.family.name, "model_type": layout.checkpoint_model_type,
        "text_model_type": layout.model_type, "dtype": plan.dtype,
        "core_dtype": plan.gated_delta_rule.core_dtype,
        "vocab_size": layout.config["vocab_size"],
        "context_length": layout.config.get("max_position_embeddings"),  # prompt + new tokens (docs/SERVER.md)
        "inputs": inputs, "outputs": outputs,
    }


def state_metadata(lm) -> list[dict]:
    return [{"name": s.name, "shape": list(s.shape), "dtype": str(s.dtype).removeprefix("torch."), "kind": s.kind,
             "layer": s.layer} for s in lm.states]


def run_plan(plan: ConvertPlan, progress: Callable[[str], None] | None = None) -> ConvertReport:
    """The one conversion: read the checkpoint, export into a staging folder beside ``plan.out_path``, check
    every target the format names against the checkpoint's reference, then publish (rename); on any error nothing
    is left."""
    target = format_steps(plan.backend.format)
    say = progress or (lambda message: None)
    seconds: dict[str, float] = {}
    traced = target.read(plan, say, seconds)
    inputs, outputs, dynamic = state_names(traced.lm)
    plan.out_path.parent.mkdir(parents=True, exist_ok=True)
    with staging_folder(plan.out_path.parent) as staging:
        staged = target.export(plan, traced, Path(staging), inputs, outputs, dynamic, say, seconds)
        result = staged.report
        traced.lm = traced.model = None  # placeholders (or the in-memory model) are not needed by the check
        if plan.check:
            start = time.perf_counter()
            kind = plan.check if plan.check != "auto" else reference_fits(traced.weights, plan.export_dtype)
            layout, weights, options = target.check_reference(traced)
            for where, archive, naming in target.check_targets(plan, staged.path):
                say(f"checking {plan.out_path} in {where}: prefill {plan.prompt_len} + decode {plan.decode_steps} "
                    f"against {traced.family.reference}, {CHECK_KINDS[kind]}")
                outcome = check_with(kind, archive, traced.family, layout, weights, plan.prompt_len,
                                     plan.decode_steps, plan.batch, **options)
                target.checked(result, where)
                if result.check is None or not outcome.ok:
                    result.check = outcome
                if not outcome.ok:
                    raise ParityError({"logits": outcome.error}, {"logits": outcome.tolerance},
                                      f"{plan.out_path} does not match {traced.family.reference}{naming}: {outcome}")
            result.check_kind = CHECK_KINDS[kind]
            seconds["check"] = time.perf_counter() - start
        staged.publish()
    return result


class NnefSteps:
    """The NNEF format: a ``.nnef.tgz`` written by ``gdn_export.export`` (torch-to-nnef), checked in tract; Q4_0 /
    int8 weights, calibration, serving graphs."""

    name = "nnef"

    @staticmethod
    def resolve_runtime(runtime: str) -> str:
        return runtime

    @staticmethod
    def validate(options: dict, runtime: str) -> None:
        RUNTIMES = backend_named("nnef").runtimes  # noqa: N806
        if runtime not in RUNTIMES:
            raise worded(LoweringError(f"runtime {runtime!r} is not one of {', '.join(RUNTIMES)}"),
                         f"--runtime {runtime} is for --format onnx; an NNEF archive runs in tract: "
                         f"{', '.join(RUNTIMES)}")

    @staticmethod
    def validate_after_check(options: dict, runtime: str) -> None:
        from gdn_export.ops.gated_delta_rule.nnef.options import validate_options

        validate_options(options.get("lowering", "auto"), runtime, options.get("core_dtype"),
                         options.get("chunk_size"), options.get("tail_chunk"))
        logits = options.get("logits", "all")
        if logits not in LOGITS:
            raise GdnExportError(f"logits {logits!r} is not one of {', '.join(LOGITS)}")
        weight_format(options.get("quantize")).validate(options.get("dtype", "float32"), runtime,
                                                        options.get("quantize_embeddings", False))
        if options.get("tract_version") is not None:
            try:
                parse_version(options["tract_version"])
            except ValueError as err:
                raise GdnExportError(str(err)) from None

    @staticmethod
    def output_path(out_path, force: bool) -> Path:
        return check_output_path(out_path, force)

    @staticmethod
    def read(plan: ConvertPlan, say, seconds: dict) -> Traced:
        lean_allocator()  # copies of weights are freed as they come (see its docstring)
        start = time.perf_counter()
        say(f"reading {plan.checkpoint_dir}")
        family, layout, model, weights = open_checkpoint(plan.checkpoint_dir)
        materialize(model, weights, plan.export_dtype, placeholders=plan.streamed)
        cast_buffers(model, plan.export_dtype)
        seconds["read"] = time.perf_counter() - start
        measured, folding, exported = None, None, weights  # exported: the weights written (folds applied)
        if plan.weights.calibration is not None:
            from gdn_export.hf.calibration import calibrate

            start = time.perf_counter()
            say(f"calibrating on {plan.weights.calibration} (at most {plan.weights.calibration_tokens} tokens)")
            measured = calibrate(plan.checkpoint_dir, plan.weights.calibration, family, layout, weights,
                                 max_tokens=plan.weights.calibration_tokens,
                                 **weight_format(plan.weights.quantize).calibration_options(plan.weights))
            if plan.weights.fold_scales:
                from gdn_export.hf.folding import fold

                say("choosing the scales folded into norms")
                folding, exported, measured = fold(measured, family, layout, weights, measured.sample)
            seconds["calibrate"] = time.perf_counter() - start
        separated = separate_tied_head(model, plan.weights.quantize, plan.weights.quantize_embeddings)
        lm = family.exportable(model, plan.export_dtype)
        lm.last_logits_only = plan.logits == "last"
        if plan.serving and lm.serving_refusal:
            raise GdnExportError(f"{family.name} has no serving graph (--serving): {lm.serving_refusal}")
        lm.serving = plan.serving
        from gdn_export.pipeline.mtp import mtp_decision

        mtp, mtp_left_out = mtp_decision(plan.checkpoint_dir, layout.model_type, layout.config,
                                         logits=plan.logits, dtype=plan.export_dtype,
                                         fold_scales=folding is not None and any(
                                             reader.endswith("lm_head.weight") for fold in folding.folds
                                             for reader in fold.readers), weights=weights)
        say(f"  {weights.summary()}")  # once the MTP decision counted its tensors as carried or left out
        lm.emits_hidden = mtp is not None  # the main graph's last output: what the MTP head reads
        writers, quantization = plan_writes(lm, model, exported, plan.export_dtype, plan.weights.quantize,
                                            plan.weights.quantize_embeddings,
                                            fused_moe=_fused_moe(plan.backend.runtime, plan.backend.tract_version),
                                            q4_rule=plan.weights.q4_rule, calibration=measured,
                                            int8_passes=plan.weights.int8_passes)
        if not plan.streamed and plan.weights.quantize is None:
            writers = None  # the in-memory model's own values are written
        return Traced(family, layout, model, weights, lm, dict(measured=measured, folding=folding, exported=exported,
                                                               separated=separated, writers=writers,
                                                               quantization=quantization, mtp=mtp,
                                                               mtp_left_out=mtp_left_out))

    @staticmethod
    def export(plan: ConvertPlan, traced: Traced, staging: Path, inputs, outputs, dynamic, say,
               seconds: dict) -> Staged:
        from gdn_export.pipeline.export import export  # imports torch-to-nnef (seconds), which check() does not

        lm, extras, checkpoint_dir = traced.lm, traced.extras, Path(plan.checkpoint_dir)
        measured, folding, quantization = extras["measured"], extras["folding"], extras["quantization"]
        carried = {name: checkpoint_dir / name for name in GENERATION_FILES if (checkpoint_dir / name).is_file()}
        # what the weight format records of itself
        recorded = weight_format(plan.weights.quantize).metadata(plan.weights)
        metadata = {
            **common_metadata(plan, traced, inputs, outputs),
            "generation_files": sorted(carried), "quantize": plan.weights.quantize, "logits": plan.logits,
            "serving": plan.serving,
            "quantized": len(quantization.quantized),
            "q4_rule": recorded.pop("q4_rule", None),  # in the place it had before formats were units
            "calibration": measured.metadata() if measured is not None else None,
            "folded_norms": len(folding.folds) if folding is not None else None,
            "states": state_metadata(lm),
            "runtime": plan.backend.runtime,
        }
        metadata.update(recorded)
        if plan.weights.quantize_embeddings:  # what `check` re-quantizes (absent: False, as every archive before it)
            metadata["quantize_embeddings"] = True
        path = staging / plan.out_path.name
        members, mtp_line = dict(carried), extras["mtp_left_out"] or ""
        if extras["mtp"] is not None:
            from gdn_export.pipeline.mtp import MEMBER, export_head

            say(f"exporting the MTP head ({MEMBER})")
            (staging / "mtp").mkdir()
            choice = plan.weights
            _, metadata["mtp"], words = export_head(extras["mtp"], staging / "mtp" / MEMBER,
                                                    tract_version=plan.backend.tract_version,
                                                    runtime=plan.backend.runtime, check=bool(plan.check),
                                                    quantize=choice.quantize,
                                                    quantize_embeddings=choice.quantize_embeddings,
                                                    q4_rule=choice.q4_rule, int8_passes=choice.int8_passes)
            members[MEMBER] = staging / "mtp" / MEMBER
            mtp_line = (f"MTP head: carried ({MEMBER}; reads the state after the final norm; logits of the last "
                        f"position){words}")
        say(f"exporting {traced.family.name} ({len(lm.layer_types) if hasattr(lm, 'layer_types') else '?'} layers, "
            f"{plan.dtype}{', weights streamed from the checkpoint' if plan.streamed else ''}) to {plan.out_path}")
        report = export(lm, example_inputs(lm, metadata["vocab_size"], plan.export_dtype), path,
                        tract_version=plan.backend.tract_version, lowering=plan.gated_delta_rule.lowering,
                        input_names=inputs,
                        output_names=outputs, dynamic_axes=dynamic, metadata=metadata,
                        check=bool(plan.check) and extras["writers"] is None, runtime=plan.backend.runtime,
                        core_dtype=plan.gated_delta_rule.core_dtype, chunk_size=plan.gated_delta_rule.chunk_size,
                        tail_chunk=plan.gated_delta_rule.tail_chunk,
                        weights=extras["writers"],
                        extra_files=members)
        seconds.update(report.seconds)
        result = ConvertReport(plan.out_path, traced.family.name, metadata["model_type"], plan.dtype,
                               report.tract_version, layers=layer_reports(lm, report.decisions), seconds=seconds,
                               reference=traced.family.reference, weights=traced.weights.summary(),
                               generation_files=sorted(carried),
                               quantization=str(quantization) + (f"; {folding}" if folding is not None else ""),
                               moe=moe_report(report.decisions),
                               quantized_as=weight_format(plan.weights.quantize).reference, mtp=mtp_line,
                               shared_constants=report.shared_constants, float_linears=report.float_linears)
        return Staged(path, result, lambda: os.replace(path, plan.out_path))

    @staticmethod
    def check_reference(traced: Traced) -> tuple[object, object, dict]:
        """A quantized export is checked against the same Q4_0 / int8 weights (folds applied); its quality against
        the model as published."""
        extras, weights, layout = traced.extras, traced.weights, traced.layout
        separated, quantization = extras["separated"], extras["quantization"]
        published, reference_layout = untied_view(weights, layout, separated) if separated else (weights, layout)
        computed = untied_view(extras["exported"], layout, separated)[0] if separated else extras["exported"]
        return reference_layout, dequantized_view(computed, quantization), dict(
            quality_weights=published if quantization.quantized else None,
            rounded_inputs=int8_reference_linears(quantization), int8_passes=quantization.own.get("int8_passes", 1))

    @staticmethod
    def check_targets(plan: ConvertPlan, staged: Path):
        return [("tract", staged, "")]

    @staticmethod
    def checked(result: ConvertReport, where: str) -> None:
        pass


NNEF = NnefSteps()


def _fused_moe(runtime: str, tract_version: str | None):
    """Whether a ``moe_ffn`` node of a gate will run as tract's fused op in this export (the extractor's own rule)."""
    from gdn_export.ops.moe_ffn.nnef import decide
    from gdn_export.ops.moe_ffn.op import OP_NAME, MoeNode
    from gdn_export.ops.options import NnefOptions
    from gdn_export.run.runtime import tract_version as installed

    options = NnefOptions(tract_version=parse_version(tract_version or installed()), runtime=runtime)
    return lambda gate: decide(MoeNode("(before tracing)", gate), options).lowering == OP_NAME


def reference_fits(weights, export_dtype: torch.dtype) -> str:
    """"full" when transformers' float32 model (and its float16 copy for a float16 export) and tract's model fit
    in half of the memory available now, else "layerwise"."""
    numel = sum(int(np.prod(source.shape, dtype=np.int64)) for source in weights.entries.values())
    itemsize = torch.finfo(export_dtype).bits // 8
    needed = numel * (4 + (itemsize if itemsize < 4 else 0) + 2 * itemsize)  # reference(s) + tract (packed + file)
    available = _available_memory()
    return "full" if available is None or needed < available / 2 else "layerwise"


def _available_memory() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_with(kind: str, archive, family, layout, weights, prompt_len: int, decode_steps: int, batch: int = 1,
               quality_weights=None, rounded_inputs: frozenset = frozenset(), int8_passes: int = 1) -> LogitCheck:
    """The check of ``archive`` against the checkpoint's model: "full" (the whole model in memory, prefill then
    decode with its cache) or "layerwise" (``gdn_export.hf.layerwise``: one layer in memory, one causal pass).
    ``quality_weights``: a second set of weights (a quantized export's unquantized ones) compared with the same tract
    logits, into the result's ``quality``. ``rounded_inputs``: names of the reference's ``nn.Linear`` modules whose
    input is rounded as an int8 graph rounds it (``gdn_export.weights.int8``, in ``int8_passes``), in the judged
    reference only."""
    from gdn_export.weights import int8
    from gdn_export.weights.int8 import reference_hooks

    def references(source, rounded=frozenset(), jitter_seed=None):
        if kind == "full":
            model = model_in_memory(family, layout, source)
            reference_hooks(model, rounded, jitter_seed, int8_passes)
            return transformers_references(model, prompt_len)

        def logits(dtype: torch.dtype, tokens: np.ndarray) -> np.ndarray:
            model = empty_model(family, layout)
            reference_hooks(model, rounded, jitter_seed, int8_passes)
            return layerwise_logits(model, source, tokens, dtype)

        return partial(logits, torch.float32), logits

    reference, half_reference = references(weights, rounded_inputs)
    judged = {}  # the judged reference's logits of the last tokens: the int8 baseline is measured from them too

    def judged_reference(tokens: np.ndarray) -> np.ndarray:
        key = tokens.tobytes()
        if key not in judged:
            judged.clear()
            judged[key] = reference(tokens)
        return judged[key]

    def rounding_baseline(tokens: np.ndarray) -> np.ndarray:  # the int8 reference, its rounding inputs perturbed
        return int8.rounding_envelope(judged_reference(tokens),
                                      [references(weights, rounded_inputs, jitter_seed=seed)[0](tokens)
                                       for seed in range(int8.ROUNDING_SEEDS)])

    def quality(tokens: np.ndarray) -> np.ndarray:  # its model is built only once the export's logits are in
        return references(quality_weights)[0](tokens)

    return check_archive(archive, layout.config["vocab_size"], prompt_len, decode_steps, batch, 0,
                         judged_reference, half_reference,
                         quality_reference=quality if quality_weights is not None else None,
                         rounding_baseline=rounding_baseline if rounded_inputs else None)


def check(path: str | os.PathLike, checkpoint_dir: str | os.PathLike, prompt_len: int = 16,
          decode_steps: int = 8, batch: int = 1, kind: str = "auto",
          calibration: str | os.PathLike | None = None,
          progress: Callable[[str], None] | None = None) -> LogitCheck:
    """Re-check an exported model against the checkpoint it came from; an archive converted from another kind of
    model (model type or vocabulary) is refused before anything runs. ``kind``: see ``convert``'s ``check``.

    A quantized archive (Q4_0, int8) is checked as ``convert`` checked it: its weights quantized again from the
    checkpoint by the rule its metadata records (so a damaged weight file fails too), the int8 inputs rounded as its
    graph rounds them, and its quality against the unquantized model reported. An archive calibrated on a text
    needs that text again (``calibration``; its digest must match the one recorded). An archive with an MTP head has
    it checked too (``pipeline.mtp.check_member``, as ``convert`` checked it): the result's ``mtp``, which its
    ``ok`` includes."""
    result = _check_model(path, checkpoint_dir, prompt_len, decode_steps, batch, kind, calibration, progress)
    metadata = load(backend_for(path).metadata)(path)
    if isinstance(metadata.get("mtp"), dict):
        from gdn_export.pipeline.mtp import check_member

        if progress is not None:
            progress(f"checking the MTP head ({metadata['mtp'].get('member')}) against {checkpoint_dir}'s mtp.*")
        layout = resolve_layout(read_config(checkpoint_dir))
        result.mtp = check_member(Path(path), metadata, checkpoint_dir, layout.model_type, layout.config)
    return result


def _check_model(path, checkpoint_dir, prompt_len: int, decode_steps: int, batch: int, kind: str, calibration,
                 progress) -> LogitCheck:
    validate_check(prompt_len, decode_steps, batch)
    if kind not in CHECKS:
        raise GdnExportError(f"check kind {kind!r} is not one of {', '.join(CHECKS)}")
    metadata = load(backend_for(path).metadata)(path)  # the file's back-end by its suffix (.onnx: onnxruntime's)
    if not metadata or "states" not in metadata:
        raise GdnExportError(f"{path} was not written by gdn-export convert (no gdn_export.json with states)")
    config = read_config(checkpoint_dir)
    family = family_for(config["model_type"])
    if metadata.get("model_type") != config["model_type"]:
        raise GdnExportError(f"{path} holds a {metadata.get('family')} model ({metadata.get('model_type')}); "
                             f"{checkpoint_dir} is {family.name} ({config['model_type']})")
    vocab = resolve_layout(config).config.get("vocab_size")
    if vocab is not None and metadata.get("vocab_size") != vocab:
        raise GdnExportError(f"{path} has a vocabulary of {metadata.get('vocab_size')} tokens; {checkpoint_dir}'s "
                             f"config.json says {vocab}")
    if metadata.get("quantize"):
        return _check_quantized(path, checkpoint_dir, metadata, prompt_len, decode_steps, batch, kind, calibration,
                                progress or (lambda message: None))
    if calibration is not None:
        raise GdnExportError(f"{path} is not quantized: calibration text is only read to re-check a calibrated "
                             "Q4_0 archive")
    family, layout, _, weights = open_checkpoint(checkpoint_dir, family, config)
    kind = kind if kind != "auto" else reference_fits(weights, getattr(torch, metadata.get("dtype", "float32")))
    return check_with(kind, path, family, layout, weights, prompt_len, decode_steps, batch)


RECHECK_CALIBRATION_TOKENS = 1 << 22  # the most calibration tokens a re-check reads (an archive's record is untrusted)


def _check_quantized(path, checkpoint_dir, metadata: dict, prompt_len: int, decode_steps: int, batch: int,
                     kind: str, calibration, say: Callable[[str], None]) -> LogitCheck:
    """``check`` of a Q4_0 / int8 archive: the plan its metadata records, read as ``run_plan`` reads it (the
    calibration included), checked against ``check_reference``'s weights as ``run_plan`` checks."""
    from gdn_export.hf.calibration import DEFAULT_CTX

    # what every archive records (quantize_embeddings absent: False), then what its format records of itself
    options = dict(quantize=metadata["quantize"], dtype=metadata.get("dtype") or "float32",
                   quantize_embeddings=bool(metadata.get("quantize_embeddings", False)),
                   **weight_format(metadata["quantize"]).options_from_metadata(metadata))
    recorded = metadata.get("calibration")
    if recorded:  # from the archive: its shape checked before anything is read with it
        named = isinstance(recorded, dict) and all(isinstance(recorded.get(k), str) for k in ("file", "sha256"))
        bound = recorded.get("max_tokens", recorded.get("tokens")) if named else None
        if not (isinstance(bound, int) and 0 < bound <= RECHECK_CALIBRATION_TOKENS):
            raise GdnExportError(f"{path}'s gdn_export.json has a malformed calibration record (expected file, "
                                 f"sha256 and 1 to {RECHECK_CALIBRATION_TOKENS} tokens): it cannot be re-checked")
        if calibration is None:
            raise worded(GdnExportError(f"{path} was calibrated on {recorded['file']} (sha256 "
                                        f"{recorded['sha256'][:12]}..): its Q4_0 scales can only be computed again "
                                        "from that text: pass calibration=FILE"),
                         f"{path} was calibrated on {recorded['file']} (sha256 {recorded['sha256'][:12]}..): pass "
                         "--calibration FILE with that text", usage=False)
        if recorded.get("ctx", DEFAULT_CTX) != DEFAULT_CTX:
            raise GdnExportError(f"{path} was calibrated in windows of {recorded['ctx']} tokens; this gdn_export "
                                 f"reads windows of {DEFAULT_CTX}")
        options["calibration_tokens"] = bound
    elif calibration is not None:
        raise GdnExportError(f"{path} was not calibrated: drop the calibration text")
    # the plan is only read, never written: its output path is a name in the temporary folder
    plan = plan_conversion(checkpoint_dir, Path(tempfile.gettempdir()) / "gdn_export_check.nnef.tgz", force=True,
                           check=False, calibration=calibration, **options)
    say(f"quantizing {checkpoint_dir} again as {path} records it ({plan.weights.quantize}"
        f"{', rule ' + plan.weights.q4_rule if plan.weights.q4_rule else ''})")
    traced = NNEF.read(plan, say, {})
    measured = traced.extras["measured"]
    if measured is not None and measured.sha256 != recorded["sha256"]:
        raise GdnExportError(f"{calibration} is not the text {path} was calibrated on (sha256 {measured.sha256[:12]}.. "
                             f"of the bytes read, {recorded['sha256'][:12]}.. recorded)")
    traced.lm = traced.model = None
    layout, weights, check_options = NNEF.check_reference(traced)
    kind = kind if kind != "auto" else reference_fits(traced.weights, plan.export_dtype)
    return check_with(kind, path, traced.family, layout, weights, prompt_len, decode_steps, batch, **check_options)


def layer_reports(lm, decisions) -> list[LayerReport]:
    rules = [d for d in decisions if d.dims is not None]
    layers = []
    for index, kind in enumerate(lm.hf.config.layer_types):
        if kind == "linear_attention":
            decision = rules.pop(0) if rules else None
            layers.append(LayerReport(index, "gated delta rule", decision.lowering if decision else "-",
                                      decision.reason if decision else ""))
        else:
            layers.append(LayerReport(index, "attention"))
    return layers


__all__ = ["CheckpointError", "ConvertPlan", "ConvertReport", "check", "convert", "plan_conversion"]
