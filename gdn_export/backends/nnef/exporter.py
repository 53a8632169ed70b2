"""The NNEF back-end's export: a traced torch module to a ``.nnef.tgz`` that tract runs, checked against torch.

torch-to-nnef translates the module (the ops' handlers, registered in ``registry.CUSTOM_OPS``, write the custom
ops), the export's graph passes complete the translated graph before it is written (the weight formats' passes,
``--logits last``), the weights are written (streamed from their sources where given), tract's output names are
kept, and the archive is packed in a staging folder and renamed only once checked. The plan the ops' handlers read
is the caller's (``plan(version)``, carried by the target): this module names no op and reads nothing of it.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from gdn_export.backends.dynamic_axes import validate_dynamic_axes, traced_outputs
from gdn_export.backends.nnef.output_names import declared_outputs, growth_bound, keep_output_names
from gdn_export.backends.nnef.target import OfflineTractTarget
from gdn_export.errors import GdnExportError
from gdn_export.parity import RELATIVE_TOLERANCE, ParityResult, check_parity
from gdn_export.run.archive import ArchiveWriter, nnef_tgz_path
from gdn_export.run.runtime import alongside, load_tract_model, run_tract
from gdn_export.backends.staging import staging_folder
from gdn_export.weights.casts import fold_weight_casts, weights_cast_before_use
from gdn_export.weights.streamed import (StreamedWeights, annotate_compressed_gathers, archive_members,
                                         check_all_written, streamed_writes, variable_labels, write_deferred)


@dataclass
class ExportReport:
    """What an export wrote and decided."""

    path: Path
    tract_version: str
    decisions: list = field(default_factory=list)  # ops.protocol.Decision, one per custom-op node
    parity: ParityResult | None = None
    # trace (torch-to-nnef), write (streamed weights), names (tract's output names; while most weights are written),
    # pack
    seconds: dict[str, float] = field(default_factory=dict)
    shared_constants: int = 0  # constant variables equal to an earlier one, read from it (shared_constants.py)
    float_linears: int = 0  # linear layers written as an einsum on their float weight as stored (float_linears.py)

    def lowerings(self) -> list[str]:
        return [d.lowering for d in self.decisions]

    def __str__(self) -> str:
        lines = [f"wrote {self.path} for tract {self.tract_version}"]
        for d in self.decisions:
            lines.append(f"  {d.node} ({d.entry}): {d.lowering} - {d.reason}")
        if self.shared_constants:
            lines.append(f"  constants: {self.shared_constants} equal to an earlier one, written once")
        if self.float_linears:
            lines.append(f"  linear layers: {self.float_linears} on their float weight as stored (tract_core_einsum)")
        if self.parity is not None:
            lines.append(str(self.parity))
        return "\n".join(lines)


def export_nnef(
    module: torch.nn.Module,
    args: Sequence[torch.Tensor],
    path: str | os.PathLike,
    *,
    plan: Callable[[str], Any],
    tract_version: str,
    input_names: Sequence[str] | None = None,
    output_names: Sequence[str] | None = None,
    dynamic_axes: dict[str, dict[int, str]] | None = None,
    check: bool = True,
    metadata: dict | None = None,
    half: bool = False,
    weights: StreamedWeights | None = None,
    extra_files: Mapping[str, Path] | None = None,
) -> ExportReport:
    """Export ``module(*args)`` to ``path`` (a ``.nnef.tgz``) for tract ``tract_version``; ``plan(version)``: the
    export's plan the ops' handlers read (``target.gdn_options``). ``half``: the check compares with the float16
    tolerance (an f16 core was asked for). The other arguments are ``gdn_export.export``'s."""
    from torch_to_nnef import export_model_to_nnef

    from gdn_export.backends.compat.torch_to_nnef import conversion
    from gdn_export.backends.nnef.last_step import LAST_STEP, rewrite_last_step
    from gdn_export.backends.nnef.registry import CUSTOM_OPS
    from gdn_export.backends.nnef.float_linears import write_float_linears
    from gdn_export.backends.nnef.shared_constants import share_identical_constants

    if weights is not None and check:
        raise GdnExportError("an export with streamed weights cannot be checked against its module (its parameters "
                             "are placeholders): pass check=False and check the archive against the model")
    path = nnef_tgz_path(path)
    args = tuple(args)
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

    def is_float_weight(label: str, tensor) -> bool:  # stored as float32 or float16 (not int8 codes, Q4_0 blocks)
        if weights is not None:
            return label in weights.deferrable
        return tensor.data is not None and np.asarray(tensor.data).dtype in (np.float32, np.float16)

    linears = {"rewritten": 0}  # after the formats' and last step's passes: what they left in float
    passes.append(lambda graph: linears.update(rewritten=write_float_linears(graph, is_float_weight)))

    # what output_names.py needs of the outputs' types: a bool output is its renaming select's condition itself, a
    # cast that changes the type keeps its name (a cast to the same type is removed)
    bool_outputs: set[str] = set()
    retyped: set[str] = set()

    def output_types(graph) -> None:
        bool_outputs.update(t.name for t in graph.outputs if _is_bool(t.dtype))
        retyped.update(t.name for t in graph.outputs if t.producers and t.producer.type == "tract_core_cast"
                       and not _same_type(t.producer.inputs[0].dtype, t.dtype))

    passes.append(output_types)
    shared = {"constants": 0}  # last: every constant written, each distinct one once
    passes.append(lambda graph: shared.update(constants=share_identical_constants(graph)))
    target = OfflineTractTarget(tract_version, options=plan(tract_version), dynamic_axes=dynamic_axes,
                                graph_passes=passes)

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
        if deferred:  # the weights the cast folding reads first; the others straight into the archive
            seconds["write"] += write_deferred(weights, [d for d in deferred if d[1] in cast])
            deferred = [d for d in deferred if d[1] not in cast]
        folded = fold_weight_casts(folder, cast)
        pending = {label: weights.deferrable[label] for _, label in deferred}
        streamed, unsized = archive_members(weights, deferred, (folder / "graph.nnef").read_text()) \
            if deferred else ({}, [])
        seconds["write"] += write_deferred(weights, unsized)
        extra = {}
        for name, source in (extra_files or {}).items():
            if (folder / name).exists() or name in streamed or "/" in name:
                raise GdnExportError(f"extra file {name!r} would overwrite a file of the graph or leave the archive root")
            extra[name] = Path(source)
        decisions = [d.summary() for d in target.gdn_decisions]
        # gdn_export.json as long as it may be: every declared output's name kept
        draft = None if metadata is None else {**metadata, "output_names_kept": declared_outputs(folder),
                                               "weights_stored_as_cast": folded, "decisions": decisions}
        staged = Path(tmp) / "model.nnef.tgz"
        # unchecked, the archive is not read back here: its body goes past the page cache (run/archive.py)
        with ArchiveWriter(staged, folder, streamed, extra, draft, graph_growth=growth_bound(folder),
                           direct=not check) as writer:
            # no weight matrix is read (and it loads faster); tract loads in a thread while this one writes the
            # archive's weights, each from its writer or its file
            (renamed, seconds["names"]), body = alongside(
                lambda: keep_output_names(folder, inputs_from_bytes=0, pending=pending,
                                          bool_outputs=frozenset(bool_outputs), retyped=frozenset(retyped)),
                lambda: _timed(writer.write_body))
            seconds["write"] += body
            if metadata is not None:
                metadata = {**metadata, "output_names_kept": renamed, "weights_stored_as_cast": folded,
                            "decisions": decisions}
            start = time.perf_counter()
            writer.finish(metadata)
            seconds["pack"] = time.perf_counter() - start
        report = ExportReport(path=path, tract_version=tract_version, decisions=list(target.gdn_decisions),
                              seconds=seconds, shared_constants=shared["constants"],
                              float_linears=linears["rewritten"])
        if check:
            declared = declared_outputs(folder)
            report.parity = _check_against_torch(module, args, staged, declared, half=half)
            report.parity.raise_if_failed()
        os.replace(staged, path)
    return report


def _timed(work: Callable[[], Any]) -> float:
    """The seconds ``work()`` took."""
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


def _is_bool(dtype) -> bool:
    """Whether an NNEF graph tensor's ``dtype`` (a numpy or Python type, or None) is bool."""
    try:
        return dtype is not None and np.dtype(dtype) == np.bool_
    except TypeError:
        return False


def _same_type(a, b) -> bool:
    """Whether two NNEF graph tensors' ``dtype``s are one type (unknown: not the same)."""
    try:
        return a is not None and b is not None and np.dtype(a) == np.dtype(b)
    except TypeError:
        return False


def sequence_extent(dynamic_axes: dict | None, input_names: Sequence[str], args: Sequence) -> int | None:
    """The traced length of the new tokens' axis (the first input's axis named ``S``), or None without one."""
    axes = (dynamic_axes or {}).get(input_names[0], {}) if input_names else {}
    axis = next((axis for axis, name in axes.items() if name == "S"), None)
    if axis is None or not hasattr(args[0], "shape"):
        return None
    return int(args[0].shape[axis])


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
