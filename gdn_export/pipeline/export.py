"""``gdn_export.export``: a torch module to a ``.nnef.tgz`` that tract runs, checked against torch."""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Sequence

import numpy as np
import torch

from gdn_export.run.archive import METADATA_FILE, nnef_tgz_path, pack
from gdn_export.errors import GdnExportError
from gdn_export.ops.protocol import Decision
from gdn_export.ops.gated_delta_rule.nnef.capabilities import parse_version
from gdn_export.ops.options import LoweringOptions, validate_options
from gdn_export.backends.nnef.output_names import declared_outputs, keep_output_names
from gdn_export.parity import RELATIVE_TOLERANCE, ParityResult, check_parity
from gdn_export.weights.casts import fold_weight_casts, weights_cast_before_use
from gdn_export.weights.streamed import (StreamedWeights, annotate_compressed_gathers, check_all_written,
                                         streamed_writes, variable_labels, write_deferred)
from gdn_export.run.runtime import alongside, load_tract_model, run_tract, tract_version as installed_tract_version
from gdn_export.backends.nnef.target import OfflineTractTarget
from gdn_export.pipeline.staging import staging_folder


@dataclass
class ExportReport:
    """What an export wrote and decided."""

    path: Path
    tract_version: str
    decisions: list[Decision] = field(default_factory=list)
    parity: ParityResult | None = None
    # trace (torch-to-nnef), write (streamed weights), names (tract's output names; while most weights are written),
    # pack
    seconds: dict[str, float] = field(default_factory=dict)

    def lowerings(self) -> list[str]:
        return [d.lowering for d in self.decisions]

    def __str__(self) -> str:
        lines = [f"wrote {self.path} for tract {self.tract_version}"]
        for d in self.decisions:
            lines.append(f"  {d.node} ({d.entry}): {d.lowering} - {d.reason}")
        if self.parity is not None:
            lines.append(str(self.parity))
        return "\n".join(lines)


def validate_dynamic_axes(dynamic_axes: dict | None, input_names: Sequence[str], args: Sequence,
                          output_names: Sequence[str] | None = None,
                          outputs: Callable[[], Sequence] | None = None) -> None:
    """Every dynamic axis names an input or an output (as ``torch.onnx.export`` and torch-to-nnef accept) and one
    of its axes, and one symbol never stands for two traced lengths (tract would fail deep in its loader, e.g. "T
    should be equal to 2*T"). ``outputs()`` gives the traced outputs, called only when an output is named."""
    seen: dict[str, tuple[str, int, int]] = {}  # symbol -> (input or output, axis, traced length)
    output_names = list(output_names or ())
    traced: list | None = None
    for name, axes in (dynamic_axes or {}).items():
        if name in input_names:
            arg, kind = args[list(input_names).index(name)], "input"
        elif name in output_names:
            if traced is None:
                traced = list(outputs()) if outputs is not None else []
            index = output_names.index(name)
            if index >= len(traced):
                raise GdnExportError(f"dynamic_axes names output {name!r} (output {index} of output_names), but the "
                                     f"module returns {len(traced)} output{'s' if len(traced) != 1 else ''}")
            arg, kind = traced[index], "output"
        else:
            outputs_named = ", ".join(output_names) if output_names else "none named: pass output_names"
            raise GdnExportError(f"dynamic_axes names {name!r}, which is neither an input ({', '.join(input_names)}) "
                                 f"nor an output ({outputs_named})")
        rank = arg.dim() if isinstance(arg, torch.Tensor) else 0
        for axis, symbol in axes.items():
            if not isinstance(axis, int) or not -rank <= axis < rank:
                raise GdnExportError(f"dynamic_axes[{name!r}]: axis {axis!r} does not exist on a rank-{rank} {kind}")
            length = int(arg.shape[axis])
            if symbol in seen and seen[symbol][2] != length:
                other, other_axis, other_length = seen[symbol]
                raise GdnExportError(
                    f"dynamic_axes: symbol {symbol!r} names axis {other_axis} of {other!r} (traced length {other_length}) "
                    f"and axis {axis} of {name!r} (traced length {length}); one symbol must have one length "
                    f"(name the other axis with its own symbol or an expression such as '2*{symbol}')")
            seen.setdefault(symbol, (name, axis, length))


def traced_outputs(module: torch.nn.Module, args: Sequence) -> Callable[[], list]:
    """The module's outputs on ``args`` (run once, on first call): what ``dynamic_axes`` naming an output is
    checked against."""

    @functools.cache
    def run() -> list:
        with torch.no_grad():
            out = module(*args)
        return [out] if isinstance(out, torch.Tensor) else list(out)

    return run


def export(
    module: torch.nn.Module,
    args: Sequence[torch.Tensor],
    path: str | os.PathLike,
    *,
    tract_version: str | None = None,
    lowering: str = "auto",
    input_names: Sequence[str] | None = None,
    output_names: Sequence[str] | None = None,
    dynamic_axes: dict[str, dict[int, str]] | None = None,
    check: bool = True,
    metadata: dict | None = None,
    runtime: str = "any",
    core_dtype: str | None = None,
    chunk_size: int | None = None,
    weights: StreamedWeights | None = None,
    extra_files: Mapping[str, Path] | None = None,
    format: str = "nnef",
) -> ExportReport:
    """Export ``module(*args)`` to ``path`` (a ``.nnef.tgz``) for tract.

    ``tract_version`` defaults to the installed tract; ``lowering`` is "auto" (the fastest exact lowering
    for ``runtime``: see gdn_export/ops/gated_delta_rule/nnef/policy.py), "native" (the fused op, LoweringError where it
    cannot be exact), or one portable lowering forced ("scan", "recurrent", "chunked"). ``runtime`` is
    where tract will run: "any" (fused op where exact, else the scan), "cpu" or "cuda".
    ``core_dtype="float16"`` lets the fused op take f16 q/k/v/beta in an f32 model (tract's CUDA kernel exists
    for f16 only): inexact, never chosen unless asked, stated in the report, and checked with the float16
    tolerance. ``chunk_size`` sets the tokens per chunk of the chunked lowering (a multiple of 16; None: 64, or
    32 with per-channel decay). ``metadata`` (JSON-serializable) is stored in the archive as ``gdn_export.json``
    beside the graph, with the lowering decisions added. With ``check``, the file is run in tract on ``args``
    and every output compared with torch; beyond tolerance ParityError is raised. The file appears at ``path``
    only once written and checked: on any error or interruption nothing is left there.

    ``weights`` (``gdn_export.weights.streamed``): writers of the parameters' variables by parameter name, for a
    ``module`` traced with placeholder parameters; ``check`` must then be False (the module's values are not the
    model's) and the caller checks the archive against its own reference. ``extra_files`` (archive name -> file)
    are stored beside the graph (a tokenizer, a chat template: tract ignores them).
    """
    if format != "nnef":  # the one seam between the back-ends: format="onnx" is gdn_export/backends/onnx (a ``.onnx`` file)
        return _export_other_format(format, module, args, path, lowering=lowering, input_names=input_names,
                                    output_names=output_names, dynamic_axes=dynamic_axes, check=check,
                                    metadata=metadata, runtime=runtime, core_dtype=core_dtype, chunk_size=chunk_size,
                                    tract_version=tract_version, weights=weights, extra_files=extra_files)
    from gdn_export.backends.compat.torch_to_nnef import conversion, import_torch_to_nnef

    import_torch_to_nnef()  # first, with its compile at import held back
    import gdn_export.ops.nnef_handlers  # noqa: F401  (every op registers its handlers with the NNEF back-end)
    from torch_to_nnef import export_model_to_nnef

    from gdn_export.backends.nnef.last_step import LAST_STEP, rewrite_last_step
    from gdn_export.backends.nnef.registry import CUSTOM_OPS

    validate_options(lowering, runtime, core_dtype, chunk_size)
    if weights is not None and check:
        raise GdnExportError("an export with streamed weights cannot be checked against its module (its parameters "
                             "are placeholders): pass check=False and check the archive against the model")
    path = nnef_tgz_path(path)
    args = tuple(args)
    version = tract_version or installed_tract_version()
    input_names = list(input_names) if input_names else [f"input_{i}" for i in range(len(args))]
    validate_dynamic_axes(dynamic_axes, input_names, args, output_names, traced_outputs(module, args))
    cast: dict[str, str] = {}  # the weights only cast before use (weights/casts.py), found on the graph
    passes = [lambda graph: cast.update(weights_cast_before_use(graph))]
    read: set[str] = set()  # the labels of the graph's variables, before any rewrite (check_all_written)
    if weights is not None:
        passes.append(lambda graph: read.update(variable_labels(graph)))
        if weights.compressed:
            passes.append(lambda graph: annotate_compressed_gathers(graph, weights.compressed))
        passes.extend(weights.graph_passes)  # what the weight formats' encodings need of the graph
    extent = sequence_extent(dynamic_axes, input_names, args) if getattr(module, "last_logits_only", False) else None
    if extent is not None:  # --logits last: the decoder's last position gathered, not sliced (last_step.py)
        def last_step(graph) -> None:  # run by the target below, once the graph is traced: its fragment then
            if rewrite_last_step(graph, extent):
                target.pass_fragments[LAST_STEP.name] = LAST_STEP.definition

        passes.append(last_step)
    target = nnef_target(version, lowering=lowering, dynamic_axes=dynamic_axes, runtime=runtime,
                         core_dtype=core_dtype, chunk_size=chunk_size, graph_passes=passes)

    path.parent.mkdir(parents=True, exist_ok=True)
    with staging_folder(path.parent) as tmp:
        folder = Path(tmp) / "model.nnef"
        start = time.perf_counter()
        with torch.no_grad(), conversion(CUSTOM_OPS), streamed_writes(weights) as written:
            export_model_to_nnef(
                model=module, args=args, file_path_export=folder, inference_target=target,
                input_names=input_names, output_names=list(output_names) if output_names else None,
                compression_level=None, log_level=logging.ERROR,
            )
        if weights is not None and (folder / "graph.nnef").is_file():
            check_all_written(weights, written, read)
        seconds = {"trace": time.perf_counter() - start - written["seconds"], "write": written["seconds"]}
        if not (folder / "graph.nnef").is_file():
            raise GdnExportError(f"torch-to-nnef wrote no graph for {path}")
        deferred = written["deferred"]
        if deferred:  # the weights the cast folding reads first; the others while tract reads the graph
            seconds["write"] += write_deferred(weights, [d for d in deferred if d[1] in cast])
            deferred = [d for d in deferred if d[1] not in cast]
        folded = fold_weight_casts(folder, cast)
        pending = {label: weights.deferrable[label] for _, label in deferred}
        # no weight matrix is read (and it loads faster); tract loads in a thread while this one writes the rest
        (renamed, seconds["names"]), late_writes = alongside(
            lambda: keep_output_names(folder, inputs_from_bytes=0, pending=pending),
            lambda: write_deferred(weights, deferred) if deferred else 0.0)
        seconds["write"] += late_writes
        if metadata is not None:
            metadata = {**metadata, "output_names_kept": renamed, "weights_stored_as_cast": folded,
                        "decisions": [d.summary() for d in target.gdn_decisions]}
            (folder / METADATA_FILE).write_text(json.dumps(metadata, indent=1))
        for name, source in (extra_files or {}).items():
            if (folder / name).exists() or "/" in name:
                raise GdnExportError(f"extra file {name!r} would overwrite a file of the graph or leave the archive root")
            shutil.copyfile(source, folder / name)
        staged = Path(tmp) / "model.nnef.tgz"
        start = time.perf_counter()
        pack(folder, staged)
        seconds["pack"] = time.perf_counter() - start
        report = ExportReport(path=path, tract_version=version, decisions=list(target.gdn_decisions),
                              seconds=seconds)
        if check:
            declared = declared_outputs(folder)
            report.parity = _check_against_torch(module, args, staged, declared, half=core_dtype == "float16")
            report.parity.raise_if_failed()
        os.replace(staged, path)
    return report


def sequence_extent(dynamic_axes: dict | None, input_names: Sequence[str], args: Sequence) -> int | None:
    """The traced length of the new tokens' axis (the first input's axis named ``S``), or None without one."""
    axes = (dynamic_axes or {}).get(input_names[0], {}) if input_names else {}
    axis = next((axis for axis, name in axes.items() if name == "S"), None)
    if axis is None or not hasattr(args[0], "shape"):
        return None
    return int(args[0].shape[axis])


def nnef_target(version: str, *, lowering: str = "auto", dynamic_axes: dict | None = None, runtime: str = "any",
                core_dtype: str | None = None, chunk_size: int | None = None,
                graph_passes: Sequence = ()) -> OfflineTractTarget:
    """The torch-to-nnef target of an export, carrying its plan (validated here: LoweringError on a bad value) and
    the passes over the translated graph (``OfflineTractTarget``)."""
    options = LoweringOptions(tract_version=parse_version(version), lowering=lowering, runtime=runtime,
                              core_dtype=core_dtype, chunk_size=chunk_size, seq_may_vary=bool(dynamic_axes))
    return OfflineTractTarget(version, options=options, dynamic_axes=dynamic_axes, graph_passes=graph_passes)


def _export_other_format(format: str, module, args, path, *, lowering, input_names, output_names, dynamic_axes,
                         check, metadata, runtime, core_dtype, chunk_size, tract_version, weights, extra_files):
    """``format="onnx"``: ``gdn_export.backends.onnx.export_onnx`` (runtime "onnxruntime", "tract-onnx" or "any"); the NNEF
    options it has no use for are refused rather than ignored."""
    if format != "onnx":
        raise GdnExportError(f"format {format!r} is not one of nnef, onnx")
    unused = {"core_dtype": core_dtype, "chunk_size": chunk_size, "tract_version": tract_version, "weights": weights,
              "extra_files": extra_files}
    for name, value in unused.items():
        if value is not None:
            raise GdnExportError(f"{name} is an NNEF option: not available with format='onnx'")
    import gdn_export.ops.onnx_handlers  # noqa: F401  (every op registers its ONNX lowering)
    from gdn_export.backends.onnx import export_onnx

    validate_dynamic_axes(dynamic_axes, list(input_names) if input_names else
                          [f"input_{i}" for i in range(len(args))], tuple(args), output_names,
                          traced_outputs(module, tuple(args)))
    return export_onnx(module, args, path, input_names=input_names, output_names=output_names,
                       dynamic_axes=dynamic_axes, check=check, metadata=metadata, runtime=runtime, lowering=lowering)


def _check_against_torch(module, args: tuple, archive: Path, names: list[str], half: bool) -> ParityResult:
    """Every output of the archive run in tract on ``args`` against ``module(*args)`` in torch; tract must report
    the declared output ``names``."""
    with torch.no_grad():
        expected = module(*args)
    expected = [expected] if isinstance(expected, torch.Tensor) else list(expected)
    actual = run_tract(load_tract_model(archive, expect_outputs=names), [a.detach().numpy() for a in args])
    # an output computed from f16 inputs (or through an f16 core) carries f16 rounding, whatever its own dtype
    half = half or any(isinstance(a, torch.Tensor) and a.dtype == torch.float16 for a in args)
    relative = RELATIVE_TOLERANCE[np.dtype(np.float16 if half else np.float32)]
    return check_parity(names, [e.detach().numpy() for e in expected], actual, relative)
