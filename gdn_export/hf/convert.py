"""``gdn_export.convert``: a local Hugging Face checkpoint to a checked ``.nnef.tgz`` in one call."""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from gdn_export.errors import GdnExportError, ParityError
from gdn_export.archive import nnef_tgz_path, read_metadata
from gdn_export.exporter import export
from gdn_export.lowering.options import validate_options
from gdn_export.lowering.capabilities import parse_version
from gdn_export.hf.check import LogitCheck, check_against_transformers, validate_check
from gdn_export.hf.checkpoint import CheckpointError, copy_in_dtype, load_model, read_config
from gdn_export.hf.families import family_for

DTYPES = {"float32": torch.float32, "float16": torch.float16}
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

    def __str__(self) -> str:
        gdn = sum(1 for layer in self.layers if layer.kind == "gated delta rule")
        lines = [f"{self.path}: {self.family} ({self.model_type}), {len(self.layers)} layers ({gdn} gated delta rule, "
                 f"{len(self.layers) - gdn} attention), {self.dtype}, tract {self.tract_version}"]
        for layer in self.layers:
            if layer.kind == "gated delta rule":
                lines.append(f"  layer {layer.index}: {layer.lowering} - {layer.reason}")
        if self.check is not None:
            lines.append(f"  check vs {self.reference}: {self.check}")
        else:  # a report is returned only once its check passed: no check means check=False
            lines.append("  not checked (check=False / --no-check): tract's logits were not compared with anything")
        lines.append("  time: " + ", ".join(f"{k} {v:.1f}s" for k, v in self.seconds.items()))
        return "\n".join(lines)


def state_names(lm) -> tuple[list[str], list[str], dict]:
    inputs = ["input_ids"] + [f"in_{s.name}" for s in lm.states]
    outputs = ["logits"] + [f"out_{s.name}" for s in lm.states]
    dynamic = {"input_ids": {0: "B", 1: "S"}}
    dynamic.update({f"in_{s.name}": s.dynamic_axes for s in lm.states})
    return inputs, outputs, dynamic


def example_inputs(lm, vocab_size: int, dtype: torch.dtype, batch: int = 1, seq: int = 3, past: int = 2):
    """Traced example: a non-empty past (so P is a real axis) and random states (so the export check means something)."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab_size, (batch, seq), generator=gen)
    states = []
    for spec in lm.states:
        shape = [batch if d == "B" else past if d == "P" else d for d in spec.shape]
        states.append((0.1 * torch.randn(shape, generator=gen)).to(spec.dtype))
    return (ids, *states)


def check_output_path(out_path: str | os.PathLike, force: bool, force_hint: str = "force=True") -> Path:
    """Refuse before any work: a wrong suffix, a folder, an existing file without ``force``, or a folder where
    no file can be created; ``force_hint`` names the option that overwrites (the CLI says ``--force``)."""
    out_path = nnef_tgz_path(out_path)
    if out_path.is_dir():
        raise GdnExportError(f"{out_path} is a directory; the output must name the .nnef.tgz file to write")
    if out_path.exists() and not force:
        raise GdnExportError(f"{out_path} exists; pass {force_hint} to overwrite it")
    folder = out_path.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as err:
        raise GdnExportError(f"cannot write {out_path}: no file can be created in {folder} ({err.strerror})") from None
    return out_path


def convert(
    checkpoint_dir: str | os.PathLike,
    out_path: str | os.PathLike,
    *,
    dtype: str = "float32",
    lowering: str = "auto",
    tract_version: str | None = None,
    check: bool = True,
    force: bool = False,
    prompt_len: int = 16,
    decode_steps: int = 8,
    progress: Callable[[str], None] | None = None,
    runtime: str = "cpu",
    core_dtype: str | None = None,
    chunk_size: int | None = None,
) -> ConvertReport:
    """Convert a local checkpoint (config.json + safetensors) into ``out_path`` and check it in tract.

    The graph serves prefill and decode (symbolic batch, sequence and past); ``runtime`` ("cpu", "cuda",
    "any") picks the fastest exact lowering for where tract will run it. With ``check``, the export is first
    checked against the exportable module in torch, then a prefill of ``prompt_len`` tokens and ``decode_steps``
    single-token steps run in tract and in transformers' eager model; beyond tolerance ParityError is raised.
    ``check=False`` runs no check at all. Every argument is validated before any work; ``out_path`` appears
    only once written and checked: on any error or interruption nothing is left, neither it nor a temporary file.
    """
    say = progress or (lambda message: None)
    if dtype not in DTYPES:
        raise GdnExportError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    validate_options(lowering, runtime, core_dtype, chunk_size)
    if tract_version is not None:
        try:
            parse_version(tract_version)
        except ValueError as err:
            raise GdnExportError(str(err)) from None
    if check:
        validate_check(prompt_len, decode_steps)
    out_path = check_output_path(out_path, force)
    seconds: dict[str, float] = {}

    start = time.perf_counter()
    say(f"reading {checkpoint_dir}")
    config = read_config(checkpoint_dir)
    family = family_for(config["model_type"])
    hf_model = load_model(checkpoint_dir, family, config)
    seconds["load"] = time.perf_counter() - start

    start = time.perf_counter()
    export_model = hf_model if dtype == "float32" else copy_in_dtype(hf_model, DTYPES[dtype])
    lm = family.exportable(export_model, DTYPES[dtype])
    inputs, outputs, dynamic = state_names(lm)
    vocab_size = hf_model.config.vocab_size
    metadata = {
        "format": FORMAT_VERSION, "family": family.name, "model_type": config["model_type"], "dtype": dtype,
        "core_dtype": core_dtype, "vocab_size": vocab_size, "inputs": inputs, "outputs": outputs,
        "states": [{"name": s.name, "shape": list(s.shape), "dtype": str(s.dtype).removeprefix("torch."),
                    "kind": s.kind, "layer": s.layer} for s in lm.states],
    }
    out_path.parent.mkdir(parents=True, exist_ok=True)
    handle, staged_name = tempfile.mkstemp(prefix=".gdn_export_", suffix=".nnef.tgz", dir=out_path.parent)
    os.close(handle)
    staged = Path(staged_name)
    try:
        say(f"exporting {family.name} ({len(lm.hf.config.layer_types)} layers, {dtype}) to {out_path}")
        report = export(lm, example_inputs(lm, vocab_size, DTYPES[dtype]), staged, tract_version=tract_version,
                        lowering=lowering, input_names=inputs, output_names=outputs, dynamic_axes=dynamic,
                        metadata={**metadata, "runtime": runtime}, check=check, runtime=runtime,
                        core_dtype=core_dtype, chunk_size=chunk_size)
        seconds["export"] = time.perf_counter() - start
        result = ConvertReport(out_path, family.name, config["model_type"], dtype, report.tract_version,
                               layers=_layer_reports(lm, report.decisions), seconds=seconds,
                               reference=family.reference)
        if check:
            start = time.perf_counter()
            say(f"checking {out_path} in tract: prefill {prompt_len} + decode {decode_steps} against "
                f"{family.reference}")
            result.check = check_against_transformers(
                staged, hf_model, prompt_len, decode_steps,
                half_model=export_model if export_model is not hf_model else None)
            seconds["check"] = time.perf_counter() - start
            if not result.check.ok:
                raise ParityError({"logits": result.check.error}, {"logits": result.check.tolerance},
                                  f"{out_path} does not match {family.reference}: {result.check}")
        os.replace(staged, out_path)
    finally:
        staged.unlink(missing_ok=True)
    return result


def check(path: str | os.PathLike, checkpoint_dir: str | os.PathLike, prompt_len: int = 16,
          decode_steps: int = 8, batch: int = 1) -> LogitCheck:
    """Re-check an exported model against the checkpoint it came from; an archive converted from another kind of
    model (model type or vocabulary) is refused before anything runs."""
    validate_check(prompt_len, decode_steps, batch)
    metadata = read_metadata(path)
    if not metadata or "states" not in metadata:
        raise GdnExportError(f"{path} was not written by gdn-export convert (no gdn_export.json with states)")
    config = read_config(checkpoint_dir)
    family = family_for(config["model_type"])
    if metadata.get("model_type") != config["model_type"]:
        raise GdnExportError(f"{path} holds a {metadata.get('family')} model ({metadata.get('model_type')}); "
                             f"{checkpoint_dir} is {family.name} ({config['model_type']})")
    vocab = config.get("vocab_size", config.get("text_config", {}).get("vocab_size"))
    if vocab is not None and metadata.get("vocab_size") != vocab:
        raise GdnExportError(f"{path} has a vocabulary of {metadata.get('vocab_size')} tokens; {checkpoint_dir}'s "
                             f"config.json says {vocab}")
    hf_model = load_model(checkpoint_dir, family, config)
    return check_against_transformers(path, hf_model, prompt_len, decode_steps, batch)


def _layer_reports(lm, decisions) -> list[LayerReport]:
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


__all__ = ["CheckpointError", "ConvertReport", "check", "convert"]
