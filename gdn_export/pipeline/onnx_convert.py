"""``convert(..., format="onnx")``: a local Hugging Face checkpoint to a checked ``.onnx`` file.

The same pipeline as the NNEF conversion (hf/convert.py): the family's exportable module with explicit state
inputs and outputs, ``state_names``, the example inputs, the check against transformers (prefill + decode, the f32
and f16 rules of hf/check.py), here run in onnxruntime (and also in tract's ONNX loader for
``runtime="tract-onnx"``). The ONNX back-end (``gdn_export.backends.onnx``) writes the graph. Weights are streamed as
for NNEF: parameters of 1 MiB or more are traced as placeholders and written from the checkpoint into
``OUT.onnx.data`` (``gdn_export.backends.onnx.streamed``); a model without any (the test fixtures), or converted with
``streamed=False``, is exported from memory, its weights in ``OUT.onnx.data`` above 1 GiB only.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from gdn_export.errors import GdnExportError, ParityError
from gdn_export.pipeline.convert import ConvertReport
import gdn_export.ops.onnx_handlers  # noqa: F401  (every op registers its ONNX lowering)
from gdn_export.backends.onnx.registry import validate
from gdn_export.ops.causal_conv1d.onnx import CONV_QUALNAME
from gdn_export.weights import ONNX_QUANTIZE_REFUSAL


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


def convert_onnx(checkpoint_dir, out_path, *, dtype: str = "float32", lowering: str = "auto", check=True,
                 force: bool = False, prompt_len: int = 16, decode_steps: int = 8, progress=None,
                 runtime: str = "onnxruntime", quantize: str | None = None, quantize_embeddings: bool = False,
                 core_dtype: str | None = None, chunk_size: int | None = None, tract_version: str | None = None,
                 batch: int = 1, logits: str = "all", streamed: bool = True):
    """See ``gdn_export.convert``; ``runtime``: "onnxruntime" (contrib ops where exact), "tract-onnx" or "any"
    (portable forms). NNEF-only options (quantize, core_dtype, chunk_size, tract_version) are refused.
    ``streamed`` (the default): parameters of 1 MiB or more are traced as placeholders and written from the
    checkpoint into ``OUT.onnx.data`` a slice at a time (``gdn_export.backends.onnx.streamed``); where the exporter made
    an initializer no known recipe writes, the export is redone from the model in memory and the report says
    why. ``streamed=False``: the model in memory (external data above 1 GiB of weights only)."""
    from gdn_export.pipeline import convert as nnef_convert
    from gdn_export.hf.check import validate_check
    from gdn_export.backends.onnx.exporter import onnx_path, publish, write_onnx
    from gdn_export.backends.onnx.streamed import StreamingRefused
    from gdn_export.run.runtime import lean_allocator
    from gdn_export.run.onnx_session import OnnxSession
    from gdn_export.ops.moe_ffn.op import moe_report

    say = progress or (lambda message: None)
    for name, value in (("quantize", quantize), ("core_dtype", core_dtype), ("chunk_size", chunk_size),
                        ("tract_version", tract_version)):
        if value is not None:
            hint = f" ({ONNX_QUANTIZE_REFUSAL.get(value, '')})" if name == "quantize" else ""
            raise GdnExportError(f"{name}={value!r} is an NNEF option: not available with format='onnx'{hint}")
    if logits != "all":
        raise GdnExportError(f"logits={logits!r} is not available with format='onnx' (its graph returns the logits of "
                             f"every new position)")
    if quantize_embeddings:
        raise GdnExportError("quantize_embeddings is an NNEF option: not available with format='onnx'")
    if dtype not in nnef_convert.DTYPES:
        raise GdnExportError(f"dtype {dtype!r} is not one of {', '.join(nnef_convert.DTYPES)}")
    validate(runtime, lowering)
    check_mode = "auto" if check is True else check or None
    if check_mode is not None and check_mode not in nnef_convert.CHECKS:
        raise GdnExportError(f"check {check!r} is not one of True, False, "
                             f"{', '.join(repr(c) for c in nnef_convert.CHECKS)}")
    if check_mode:
        validate_check(prompt_len, decode_steps, batch)
    out_path = onnx_path(out_path)
    if out_path.is_dir():
        raise GdnExportError(f"{out_path} is a directory; the output must name the .onnx file to write")
    if out_path.exists() and not force:
        raise GdnExportError(f"{out_path} exists; pass force=True (--force) to overwrite it")
    export_dtype = nnef_convert.DTYPES[dtype]
    seconds: dict[str, float] = {}

    if streamed:  # placeholders untouched (their own maps), copies freed as they come (0.8 GiB peak against 2.1
        lean_allocator()  # on the 580M model); not in memory: its map per copy doubled the system time there
    start = time.perf_counter()
    say(f"reading {checkpoint_dir}")
    family, layout, model, weights, lm, sources = _exportable(checkpoint_dir, export_dtype, streamed)
    seconds["read"] = time.perf_counter() - start
    inputs, outputs, dynamic = nnef_convert.state_names(lm)
    vocab_size = layout.config["vocab_size"]
    metadata = {
        "format": nnef_convert.FORMAT_VERSION, "container": "onnx", "family": family.name,
        "model_type": layout.checkpoint_model_type, "text_model_type": layout.model_type, "dtype": dtype,
        "core_dtype": None, "vocab_size": vocab_size, "context_length": layout.config.get("max_position_embeddings"),
        "inputs": inputs, "outputs": outputs, "runtime": runtime,
        "states": [{"name": s.name, "shape": list(s.shape), "dtype": str(s.dtype).removeprefix("torch."),
                    "kind": s.kind, "layer": s.layer} for s in lm.states],
    }
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".gdn_export_", dir=out_path.parent) as tmp:
        say(f"exporting {family.name} ({dtype}{', weights streamed from the checkpoint' if sources else ''}) to "
            f"{out_path} (ONNX, runtime {runtime})")

        def export(lm, sources):
            return write_onnx(lm, nnef_convert.example_inputs(lm, vocab_size, export_dtype), Path(tmp), out_path.name,
                              input_names=inputs, output_names=outputs, dynamic_axes=dynamic, runtime=runtime,
                              lowering=lowering, metadata=metadata, output_dims=onnx_output_dims(lm, vocab_size),
                              sources=sources)

        in_memory = None
        try:
            staged, data, decisions, export_seconds = export(lm, sources)
        except StreamingRefused as refusal:  # nothing written yet: the same export from the model in memory
            in_memory = f"weights read into memory: {refusal}"
            say(f"  {in_memory}")
            del lm, model
            for f in Path(tmp).iterdir():
                f.unlink()
            _, _, model, _, lm, sources = _exportable(checkpoint_dir, export_dtype, False)
            staged, data, decisions, export_seconds = export(lm, sources)
        seconds.update(export_seconds)
        result = OnnxConvertReport(out_path, family.name, metadata["model_type"], dtype, "-",
                                   layers=nnef_convert._layer_reports(lm, decisions), seconds=seconds,
                                   reference=family.reference, weights=weights.summary(),
                                   moe=moe_report(decisions))
        result.onnx = _OnnxExtras(runtime, _conv_report(decisions), out_path.with_name(data.name) if data else None,
                                  weights=in_memory or (f"{len(sources)} weights streamed from the checkpoint"
                                                        if sources else ""))
        del lm, model
        if check_mode:
            start = time.perf_counter()
            kind = check_mode if check_mode != "auto" else nnef_convert.reference_fits(weights, export_dtype)
            for where in ["onnxruntime"] + (["tract-onnx"] if runtime == "tract-onnx" else []):
                say(f"checking {out_path} in {where}: prefill {prompt_len} + decode {decode_steps} against "
                    f"{family.reference}, {nnef_convert.CHECK_KINDS[kind]}")
                outcome = nnef_convert.check_with(kind, OnnxSession(staged, where), family, layout, weights,
                                                  prompt_len, decode_steps, batch)
                result.onnx.checked_in.append(where)
                if result.check is None or not outcome.ok:
                    result.check = outcome
                if not outcome.ok:
                    raise ParityError({"logits": outcome.error}, {"logits": outcome.tolerance},
                                      f"{out_path} does not match {family.reference} in {where}: {outcome}")
            result.check_kind = nnef_convert.CHECK_KINDS[kind]
            seconds["check"] = time.perf_counter() - start
        publish(staged, data, out_path)
    return result


def _exportable(checkpoint_dir, export_dtype: torch.dtype, placeholders: bool):
    """(family, layout, model, weights, exportable module, placeholder sources): with ``placeholders``, large
    parameters traced as placeholders (the sources say where each is read); else the model in memory."""
    from gdn_export.hf.checkpoint import cast_buffers, materialize, open_checkpoint

    family, layout, model, weights = open_checkpoint(checkpoint_dir)
    materialize(model, weights, export_dtype, placeholders=placeholders)
    cast_buffers(model, export_dtype)
    lm = family.exportable(model, export_dtype)
    return family, layout, model, weights, lm, placeholder_sources(lm, model, weights) if placeholders else {}


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
