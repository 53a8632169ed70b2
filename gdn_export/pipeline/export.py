"""``gdn_export.export``: a torch module to the file of one back-end (``format``: ``targets.BACKENDS``), checked.

What is the ops' here and not the back-ends': the ops' registrations with the back-end (``ops/nnef_handlers.py``,
``ops/onnx_handlers.py``) and the NNEF plan the ops' handlers read (``ops.options.NnefOptions``, each op's own
values in its ``ops``: the pipeline is what names the ops). The export
loops are the back-ends' own (``backends/nnef/exporter.py``, ``backends/onnx/exporter.py``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping, Sequence

import torch

from gdn_export.backends.dynamic_axes import traced_outputs, validate_dynamic_axes
from gdn_export.backends.nnef.exporter import ExportReport, export_nnef
from gdn_export.backends.nnef.target import OfflineTractTarget
from gdn_export.targets import parse_version
from gdn_export.ops.gated_delta_rule.nnef.options import OP as GATED_DELTA_RULE, GatedDeltaRuleOptions, validate_options
from gdn_export.ops.options import NnefOptions
from gdn_export.run.runtime import tract_version as installed_tract_version
from gdn_export.targets import backend_named, load, refuse_others
from gdn_export.weights.streamed import StreamedWeights

__all__ = ["ExportReport", "export", "nnef_target", "traced_outputs", "validate_dynamic_axes"]


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
    tail_chunk: int | None = None,
    weights: StreamedWeights | None = None,
    extra_files: Mapping[str, Path] | None = None,
    format: str = "nnef",
):
    """Export ``module(*args)`` to ``path`` (a ``.nnef.tgz``) for tract.

    ``tract_version`` defaults to the installed tract; ``lowering`` is "auto" (the fastest exact lowering
    for ``runtime``: see gdn_export/ops/gated_delta_rule/nnef/policy.py), "native" (the fused op, LoweringError where it
    cannot be exact), or one portable lowering forced ("scan", "recurrent", "chunked"). ``runtime`` is
    where tract will run: "any" (fused op where exact, else the scan), "cpu" or "cuda".
    ``core_dtype="float16"`` lets the fused op take f16 q/k/v/beta in an f32 model (tract's CUDA kernel exists
    for f16 only): inexact, never chosen unless asked, stated in the report, and checked with the float16
    tolerance. ``chunk_size`` sets the tokens per chunk of the chunked lowering (a multiple of 16; None: 64, or
    32 with per-channel decay); ``tail_chunk`` the tokens per short chunk of its tail, the last S mod C tokens (1, 2,
    4, 8 or 16; None: 4; 1: token by token, which tract loads faster and runs a verify call of k tokens slower).
    ``metadata`` (JSON-serializable) is stored in the archive as ``gdn_export.json``
    beside the graph, with the lowering decisions added. With ``check``, the file is run in tract on ``args``
    and every output compared with torch; beyond tolerance ParityError is raised. The file appears at ``path``
    only once written and checked: on any error or interruption nothing is left there.

    ``weights`` (``gdn_export.weights.streamed``): writers of the parameters' variables by parameter name, for a
    ``module`` traced with placeholder parameters; ``check`` must then be False (the module's values are not the
    model's) and the caller checks the archive against its own reference. ``extra_files`` (archive name -> file)
    are stored beside the graph (a tokenizer, a chat template: tract ignores them).
    """
    to = load(backend_named(format).export)  # the one seam between the back-ends: the registry's entry
    return to(module, args, path, lowering=lowering, input_names=input_names, output_names=output_names,
              dynamic_axes=dynamic_axes, check=check, metadata=metadata, runtime=runtime, core_dtype=core_dtype,
              chunk_size=chunk_size, tail_chunk=tail_chunk, tract_version=tract_version, weights=weights,
              extra_files=extra_files)


def to_nnef(module, args, path, *, lowering, input_names, output_names, dynamic_axes, check, metadata, runtime,
            core_dtype, chunk_size, tail_chunk, tract_version, weights, extra_files) -> ExportReport:
    """``format="nnef"``: the ops' handlers registered, the plan validated (LoweringError), then the NNEF back-end's
    export (``backends.nnef.exporter.export_nnef``) carrying it."""
    import gdn_export.ops.nnef_handlers  # noqa: F401  (every op registers its handlers with the NNEF back-end)

    validate_options(lowering, runtime, core_dtype, chunk_size, tail_chunk)
    return export_nnef(
        module, args, path, tract_version=tract_version or installed_tract_version(),
        plan=lambda version: lowering_options(version, lowering=lowering, runtime=runtime, core_dtype=core_dtype,
                                              chunk_size=chunk_size, tail_chunk=tail_chunk,
                                              dynamic_axes=dynamic_axes),
        input_names=input_names, output_names=output_names, dynamic_axes=dynamic_axes, check=check,
        metadata=metadata, half=core_dtype == "float16", weights=weights, extra_files=extra_files)


def lowering_options(version: str, *, lowering: str = "auto", runtime: str = "any", core_dtype: str | None = None,
                     chunk_size: int | None = None, tail_chunk: int | None = None,
                     dynamic_axes: dict | None = None) -> NnefOptions:
    """The NNEF plan every op's ``decide`` reads, for tract ``version``, with the gated delta rule's own values
    (validated by its options class: LoweringError on a bad value)."""
    plan = NnefOptions(tract_version=parse_version(version), runtime=runtime, seq_may_vary=bool(dynamic_axes),
                       ops={GATED_DELTA_RULE: {"lowering": lowering, "core_dtype": core_dtype,
                                               "chunk_size": chunk_size, "tail_chunk": tail_chunk}})
    GatedDeltaRuleOptions.of(plan)  # validated now, before anything is traced
    return plan


def nnef_target(version: str, *, lowering: str = "auto", dynamic_axes: dict | None = None, runtime: str = "any",
                core_dtype: str | None = None, chunk_size: int | None = None, tail_chunk: int | None = None,
                graph_passes: Sequence = ()) -> OfflineTractTarget:
    """The torch-to-nnef target of an export, carrying its plan (``lowering_options``) and the passes over the
    translated graph (``OfflineTractTarget``): for a torch-to-nnef export of one's own."""
    options = lowering_options(version, lowering=lowering, runtime=runtime, core_dtype=core_dtype,
                               chunk_size=chunk_size, tail_chunk=tail_chunk, dynamic_axes=dynamic_axes)
    return OfflineTractTarget(version, options=options, dynamic_axes=dynamic_axes, graph_passes=graph_passes)


def to_onnx(module, args, path, *, lowering, input_names, output_names, dynamic_axes, check, metadata, runtime,
            core_dtype, chunk_size, tail_chunk, tract_version, weights, extra_files):
    """``format="onnx"``: ``gdn_export.backends.onnx.export_onnx`` (runtime "onnxruntime", "tract-onnx" or "any"); the NNEF
    options it has no use for are refused rather than ignored."""
    refuse_others("onnx", {"core_dtype": core_dtype, "chunk_size": chunk_size, "tail_chunk": tail_chunk,
                           "tract_version": tract_version,
                           "weights": weights, "extra_files": extra_files}, export=True)
    import gdn_export.ops.onnx_handlers  # noqa: F401  (every op registers its ONNX lowering)
    from gdn_export.backends.onnx import export_onnx

    validate_dynamic_axes(dynamic_axes, list(input_names) if input_names else
                          [f"input_{i}" for i in range(len(args))], tuple(args), output_names,
                          traced_outputs(module, tuple(args)))
    return export_onnx(module, args, path, input_names=input_names, output_names=output_names,
                       dynamic_axes=dynamic_axes, check=check, metadata=metadata, runtime=runtime, lowering=lowering)
