"""``convert(..., format="onnx")``: a local Hugging Face checkpoint to a checked ``.onnx`` file.

The same pipeline as the NNEF conversion (hf/convert.py): the family's exportable module with explicit state
inputs and outputs, ``state_names``, the example inputs, the check against transformers (prefill + decode, the f32
and f16 rules of hf/check.py), here run in onnxruntime (and also in tract's ONNX loader for
``runtime="tract-onnx"``). The ONNX back-end (``gdn_export.onnx``) writes the graph. Weights are read into memory
(the NNEF path's streaming writes into an NNEF archive); above 1 GiB they go to ``OUT.onnx.data``.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from gdn_export.errors import GdnExportError, ParityError
from gdn_export.hf.convert import ConvertReport
from gdn_export.lowering import onnx_decisions


@dataclass
class _OnnxExtras:
    runtime: str = "any"
    convs: list[str] = field(default_factory=list)
    external_data: Path | None = None
    checked_in: list[str] = field(default_factory=list)


def _conv_report(decisions) -> list[str]:
    counts: dict[tuple[str, str], int] = {}
    for d in decisions:
        if d.entry == onnx_decisions.CONV_QUALNAME:
            counts[d.lowering, d.reason] = counts.get((d.lowering, d.reason), 0) + 1
    return [f"short conv ({n} node{'s' if n > 1 else ''}): {lowering} - {reason}"
            for (lowering, reason), n in counts.items()]


def onnx_output_dims(lm, vocab_size: int) -> dict[str, list]:
    """The declared shapes of the outputs: logits [B, S, vocab]; each state as its input, P+S left unnamed."""
    dims = {"logits": ["B", "S", int(vocab_size)]}
    for spec in lm.states:
        dims[f"out_{spec.name}"] = [d if d == "B" else None if d == "P" else int(d) for d in spec.shape]
    return dims


# families whose exportable module the TorchScript exporter cannot trace generically, and why
ONNX_UNSUPPORTED = {
    "qwen4_exp_text": "the TorchScript exporter bakes the traced batch and length into some of its reshapes (its QSA "
                      "indexer's query.shape[:2], and transformers' own hyper-connection module, whose unflatten of "
                      "the hc_count streams is exported as a Reshape to the traced [B, S, hc_count, hidden]), so the "
                      "file would fail at any other shape",
}


def convert_onnx(checkpoint_dir, out_path, *, dtype: str = "float32", lowering: str = "auto", check=True,
                 force: bool = False, prompt_len: int = 16, decode_steps: int = 8, progress=None,
                 runtime: str = "onnxruntime", quantize: str | None = None, quantize_embeddings: bool = False,
                 core_dtype: str | None = None, chunk_size: int | None = None, tract_version: str | None = None,
                 batch: int = 1, logits: str = "all"):
    """See ``gdn_export.convert``; ``runtime``: "onnxruntime" (contrib ops where exact), "tract-onnx" or "any"
    (portable forms). NNEF-only options (quantize, core_dtype, chunk_size, tract_version) are refused."""
    from gdn_export.hf import convert as nnef_convert
    from gdn_export.hf.check import validate_check
    from gdn_export.hf.checkpoint import cast_buffers, materialize, open_checkpoint
    from gdn_export.onnx.exporter import onnx_path, publish, write_onnx
    from gdn_export.onnx.session import OnnxSession
    from gdn_export.ops.moe_ffn import moe_report

    say = progress or (lambda message: None)
    for name, value in (("quantize", quantize), ("core_dtype", core_dtype), ("chunk_size", chunk_size),
                        ("tract_version", tract_version)):
        if value is not None:
            hint = " (tract's Q4_0 format; an ONNX export keeps float weights)" if name == "quantize" else ""
            raise GdnExportError(f"{name}={value!r} is an NNEF option: not available with format='onnx'{hint}")
    if logits != "all":
        raise GdnExportError(f"logits={logits!r} is not available with format='onnx' (its graph returns the logits of "
                             f"every new position)")
    if quantize_embeddings:
        raise GdnExportError("quantize_embeddings is an NNEF option: not available with format='onnx'")
    if dtype not in nnef_convert.DTYPES:
        raise GdnExportError(f"dtype {dtype!r} is not one of {', '.join(nnef_convert.DTYPES)}")
    onnx_decisions.validate(runtime, lowering)
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

    start = time.perf_counter()
    say(f"reading {checkpoint_dir}")
    family, layout, model, weights = open_checkpoint(checkpoint_dir)
    if layout.model_type in ONNX_UNSUPPORTED:
        raise GdnExportError(f"{family.name} ({layout.model_type}) cannot be exported to ONNX yet: "
                             f"{ONNX_UNSUPPORTED[layout.model_type]}; convert it to NNEF (.nnef.tgz)")
    materialize(model, weights, export_dtype)
    cast_buffers(model, export_dtype)
    seconds["read"] = time.perf_counter() - start
    lm = family.exportable(model, export_dtype)
    inputs, outputs, dynamic = nnef_convert.state_names(lm)
    vocab_size = layout.config["vocab_size"]
    metadata = {
        "format": nnef_convert.FORMAT_VERSION, "container": "onnx", "family": family.name,
        "model_type": layout.checkpoint_model_type, "text_model_type": layout.model_type, "dtype": dtype,
        "core_dtype": None, "vocab_size": vocab_size, "inputs": inputs, "outputs": outputs, "runtime": runtime,
        "states": [{"name": s.name, "shape": list(s.shape), "dtype": str(s.dtype).removeprefix("torch."),
                    "kind": s.kind, "layer": s.layer} for s in lm.states],
    }
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".gdn_export_", dir=out_path.parent) as tmp:
        say(f"exporting {family.name} ({dtype}) to {out_path} (ONNX, runtime {runtime})")
        staged, data, decisions, export_seconds = write_onnx(
            lm, nnef_convert.example_inputs(lm, vocab_size, export_dtype), Path(tmp), out_path.name,
            input_names=inputs, output_names=outputs, dynamic_axes=dynamic, runtime=runtime, lowering=lowering,
            metadata=metadata, output_dims=onnx_output_dims(lm, vocab_size))
        seconds.update(export_seconds)
        result = OnnxConvertReport(out_path, family.name, metadata["model_type"], dtype, "-",
                                   layers=nnef_convert._layer_reports(lm, decisions), seconds=seconds,
                                   reference=family.reference, weights=weights.summary(),
                                   moe=moe_report(decisions))
        result.onnx = _OnnxExtras(runtime, _conv_report(decisions), out_path.with_name(data.name) if data else None)
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


class OnnxConvertReport(ConvertReport):
    """A ConvertReport whose header says ONNX and its runtime, with the short convs' decisions."""

    onnx: _OnnxExtras | None = None

    def __str__(self) -> str:
        lines = super().__str__().splitlines()
        extras = self.onnx or _OnnxExtras()
        lines[0] = lines[0].replace(", tract -", f", ONNX opset 17 for runtime {extras.runtime}")
        lines = [line for line in lines if not line.startswith("  for generation: ")]  # no tokenizer in an .onnx
        if extras.external_data is not None:
            lines.insert(1, f"  weights stored in {extras.external_data.name} (external data)")
        lines[1:1] = [f"  {line}" for line in extras.convs]
        if extras.checked_in:
            lines = [line.replace("  check vs ", f"  check in {' and '.join(extras.checked_in)} vs ", 1)
                     for line in lines]
        return "\n".join(lines)
