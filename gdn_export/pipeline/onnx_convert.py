"""``convert(..., format="onnx")``: a local Hugging Face checkpoint to a checked ``.onnx`` file.

The ONNX steps of the one conversion (``gdn_export.pipeline.convert.run_plan`` over a ``ConvertPlan``, which
owns the validation, the staging, the metadata common to both formats and the check against transformers): the
ONNX-only validation, the read, the export and the targets checked, onnxruntime (and also tract's ONNX loader for
``runtime="tract-onnx"``). The ONNX back-end (``gdn_export.backends.onnx``) writes the graph. Weights are streamed as
for NNEF: parameters of 1 MiB or more are traced as placeholders and written from the checkpoint into
``OUT.onnx.data`` (``gdn_export.backends.onnx.streamed``); a model without any (the test fixtures), or converted with
``streamed=False``, is exported from memory, its weights in ``OUT.onnx.data`` above 1 GiB only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from gdn_export.errors import GdnExportError, LoweringError, worded
from gdn_export.targets import refuse_others
from gdn_export.pipeline.convert import ConvertReport, Staged, Traced
import gdn_export.ops.onnx_handlers  # noqa: F401  (every op registers its ONNX lowering)
from gdn_export.backends.onnx.registry import LOWERINGS, RUNTIMES, validate
from gdn_export.ops.causal_conv1d.op import QUALNAME as CONV_QUALNAME
from gdn_export.weights.formats import weight_format


@dataclass
class _OnnxExtras:
    runtime: str = "any"
    convs: list[str] = field(default_factory=list)
    external_data: Path | None = None
    checked_in: list[str] = field(default_factory=list)
    weights: str = ""  # streamed, or read into memory and why


def _conv_report(decisions) -> list[str]:
    counts: dict[tuple[str, str], int] = {}
    for d in decisions:
        if d.entry == CONV_QUALNAME:
            counts[d.lowering, d.reason] = counts.get((d.lowering, d.reason), 0) + 1
    return [f"short conv ({n} node{'s' if n > 1 else ''}): {lowering} - {reason}"
            for (lowering, reason), n in counts.items()]


def onnx_output_dims(lm, vocab_size: int) -> dict[str, list]:
    """The declared shapes of the outputs: logits [B, S, vocab]; each state as its input, P+S left unnamed."""
    dims = {"logits": ["B", "S", int(vocab_size)]}
    for spec in lm.states:
        dims[f"out_{spec.name}"] = [d if d == "B" else None if d == "P" else int(d) for d in spec.shape]
    return dims


def placeholder_sources(lm: torch.nn.Module, model: torch.nn.Module, weights) -> dict[int, object]:
    """Where each parameter of ``lm`` traced as a placeholder is read, by its storage's data_ptr: its checkpoint
    tensor, or the rows of one it was re-laid from (``model``: the checkpoint's model inside ``lm``)."""
    from gdn_export.hf.weight_writers import DerivedSource, checkpoint_source
    from gdn_export.models.derived import PLACEHOLDER

    names = {id(param): name for name, param in model.named_parameters()}
    sources = {}
    for label, param in lm.named_parameters(remove_duplicate=False):
        if not getattr(param, PLACEHOLDER, False):
            continue
        entry, recipe = checkpoint_source(label, param, names, weights)
        source = entry if recipe is None else DerivedSource(entry, recipe)
        if tuple(source.shape) != tuple(param.shape):
            raise GdnExportError(f"parameter {label} is {list(param.shape)}, its source {source.name} "
                                 f"{list(source.shape)}")
        sources[param.untyped_storage().data_ptr()] = source
    return sources


class OnnxSteps:
    """The ONNX format's steps of ``gdn_export.pipeline.convert.run_plan``: ``runtime`` "onnxruntime" (contrib ops
    where exact), "tract-onnx" or "any" (portable forms); NNEF-only options (quantize, core_dtype, chunk_size,
    tract_version, logits="last") are refused. ``streamed`` (the default): parameters of 1 MiB or more are traced as
    placeholders and written from the checkpoint into ``OUT.onnx.data`` a slice at a time
    (``gdn_export.backends.onnx.streamed``); where the exporter made an initializer no known recipe writes, the
    export is redone from the model in memory and the report says why. ``streamed=False``: the model in memory
    (external data above 1 GiB of weights only)."""

    name = "onnx"

    @staticmethod
    def resolve_runtime(runtime: str) -> str:
        return "onnxruntime" if runtime == "cpu" else runtime  # "cpu", NNEF's default, is onnxruntime

    @staticmethod
    def validate(options: dict, runtime: str) -> None:
        """The runtime, then every option only another back-end takes refused (rather than ignored: the weight
        format, then ``refuse_others``), then what ONNX cannot do, then the lowering; each error worded for the
        command line too."""
        if runtime not in RUNTIMES:
            raise worded(LoweringError(f"runtime {runtime!r} is not one of {', '.join(RUNTIMES)} for an ONNX export"),
                         f"--runtime {runtime} is tract's (NNEF); an ONNX file runs in: {', '.join(RUNTIMES)}")
        quantize = options.get("quantize")
        refusal = weight_format(quantize).onnx_refusal
        if quantize is not None:  # a weight format's own reason
            raise worded(GdnExportError(f"quantize={quantize!r} is an NNEF option: not available with format='onnx'"
                                        f" ({refusal})"), f"--quantize is not available with --format onnx ({refusal})")
        refuse_others("onnx", options)  # what only another back-end takes (targets.BACKENDS: its owns)
        logits, lowering = options.get("logits", "all"), options.get("lowering", "auto")
        refused = [  # (API message, flag, why), in the command line's order
            (f"logits={logits!r} is not available with format='onnx' (its graph returns the logits of every new "
             "position)", logits != "all", "--logits last", "the ONNX graph returns every new position's logits"),
            ("serving=True (--serving) builds the NNEF graph gdn_export.Engine runs; it is not available with "
             "format='onnx'", bool(options.get("serving")), "--serving",
             "the serving graph is the NNEF graph gdn_export.Engine runs"),
            (f"lowering {lowering!r} is not available for an ONNX export (one of {', '.join(LOWERINGS)}; 'native' is "
             "onnxruntime's contrib op)", lowering not in LOWERINGS, f"--lowering {lowering}",
             f"ONNX lowerings are {', '.join(LOWERINGS)} (native: onnxruntime's contrib op)"),
        ]
        for message, given, flag, why in refused:
            if given:
                error = LoweringError if flag.startswith("--lowering") else GdnExportError
                raise worded(error(message), f"{flag} is not available with --format onnx ({why})")

    @staticmethod
    def validate_after_check(options: dict, runtime: str) -> None:
        validate(runtime, options.get("lowering", "auto"))

    @staticmethod
    def output_path(out_path, force: bool) -> Path:
        from gdn_export.backends.onnx.exporter import onnx_path

        try:
            out_path = onnx_path(out_path)
        except GdnExportError as err:
            raise worded(err, f"--format onnx writes a .onnx file; got -o {out_path}") from None
        if out_path.is_dir():
            raise GdnExportError(f"{out_path} is a directory; the output must name the .onnx file to write")
        if out_path.exists() and not force:
            raise worded(GdnExportError(f"{out_path} exists; pass force=True to overwrite it"),
                         f"{out_path} exists; pass --force to overwrite it", usage=False)
        return out_path

    @staticmethod
    def read(plan, say, seconds: dict):
        from gdn_export.run.runtime import lean_allocator

        if plan.streamed:  # placeholders untouched (their own maps), copies freed as they come (0.8 GiB peak against
            lean_allocator()  # 2.1 on the 580M model); not in memory: its map per copy doubled the system time there
        start = time.perf_counter()
        say(f"reading {plan.checkpoint_dir}")
        traced = _exportable(plan.checkpoint_dir, plan.export_dtype, plan.streamed)
        seconds["read"] = time.perf_counter() - start
        return traced

    @staticmethod
    def export(plan, traced, staging: Path, inputs, outputs, dynamic, say, seconds: dict):
        from gdn_export.backends.onnx.exporter import publish, write_onnx
        from gdn_export.backends.onnx.streamed import StreamingRefused
        from gdn_export.ops.moe_ffn.op import moe_report
        from gdn_export.pipeline.convert import common_metadata, example_inputs, layer_reports, state_metadata

        common = common_metadata(plan, traced, inputs, outputs)
        metadata = {"format": common.pop("format"), "container": "onnx", **common, "runtime": plan.backend.runtime,
                    "states": state_metadata(traced.lm)}
        vocab_size, out_path = metadata["vocab_size"], plan.out_path
        say(f"exporting {traced.family.name} ({plan.dtype}"
            f"{', weights streamed from the checkpoint' if traced.extras['sources'] else ''}) to {out_path} (ONNX, "
            f"runtime {plan.backend.runtime})")

        def export(lm, sources):
            return write_onnx(lm, example_inputs(lm, vocab_size, plan.export_dtype), staging, out_path.name,
                              input_names=inputs, output_names=outputs, dynamic_axes=dynamic,
                              runtime=plan.backend.runtime,
                              lowering=plan.gated_delta_rule.lowering, metadata=metadata,
                              output_dims=onnx_output_dims(lm, vocab_size), sources=sources)

        in_memory = None
        try:
            staged, data, decisions, export_seconds = export(traced.lm, traced.extras["sources"])
        except StreamingRefused as refusal:  # nothing written yet: the same export from the model in memory
            in_memory = f"weights read into memory: {refusal}"
            say(f"  {in_memory}")
            traced.lm = traced.model = None
            for f in staging.iterdir():
                f.unlink()
            again = _exportable(plan.checkpoint_dir, plan.export_dtype, False)
            traced.model, traced.lm, traced.extras = again.model, again.lm, again.extras
            staged, data, decisions, export_seconds = export(traced.lm, traced.extras["sources"])
        seconds.update(export_seconds)
        sources = traced.extras["sources"]
        result = OnnxConvertReport(out_path, traced.family.name, metadata["model_type"], plan.dtype, "-",
                                   layers=layer_reports(traced.lm, decisions), seconds=seconds,
                                   reference=traced.family.reference, weights=traced.weights.summary(),
                                   moe=moe_report(decisions))
        result.onnx = _OnnxExtras(plan.backend.runtime, _conv_report(decisions),
                                  out_path.with_name(data.name) if data else None,
                                  weights=in_memory or (f"{len(sources)} weights streamed from the checkpoint"
                                                        if sources else ""))
        return Staged(staged, result, lambda: publish(staged, data, out_path))

    @staticmethod
    def check_reference(traced) -> tuple[object, object, dict]:
        return traced.layout, traced.weights, {}

    @staticmethod
    def check_targets(plan, staged: Path):
        from gdn_export.run.onnx_session import OnnxSession

        return [(where, OnnxSession(staged, where), f" in {where}")
                for where in ["onnxruntime"] + (["tract-onnx"] if plan.backend.runtime == "tract-onnx" else [])]

    @staticmethod
    def checked(result, where: str) -> None:
        result.onnx.checked_in.append(where)


ONNX = OnnxSteps()


def _exportable(checkpoint_dir, export_dtype: torch.dtype, placeholders: bool) -> Traced:
    """The checkpoint read and its exportable module; with ``placeholders``, large parameters traced as
    placeholders (``extras["sources"]`` says where each is read); else the model in memory."""
    from gdn_export.checkpoints import open_checkpoint
    from gdn_export.hf.checkpoint import cast_buffers, materialize

    family, layout, model, weights = open_checkpoint(checkpoint_dir)
    materialize(model, weights, export_dtype, placeholders=placeholders)
    cast_buffers(model, export_dtype)
    lm = family.exportable(model, export_dtype)
    return Traced(family, layout, model, weights, lm,
                  {"sources": placeholder_sources(lm, model, weights) if placeholders else {}})


class OnnxConvertReport(ConvertReport):
    """A ConvertReport whose header says ONNX and its runtime, with the short convs' decisions."""

    onnx: _OnnxExtras | None = None

    def __str__(self) -> str:
        lines = super().__str__().splitlines()
        extras = self.onnx or _OnnxExtras()
        lines[0] = lines[0].replace(", tract -", f", ONNX opset 17 for runtime {extras.runtime}")
        lines = [line for line in lines if not line.startswith("  for generation: ")]  # no tokenizer in an .onnx
        if extras.external_data is not None:
            lines.insert(1, f"  weights stored in {extras.external_data.name} (external data)"
                            + (f"; {extras.weights}" if extras.weights else ""))
        elif extras.weights:
            lines.insert(1, f"  {extras.weights}")
        lines[1:1] = [f"  {line}" for line in extras.convs]
        if extras.checked_in:
            lines = [line.replace("  check vs ", f"  check in {' and '.join(extras.checked_in)} vs ", 1)
                     for line in lines]
        return "\n".join(lines)
