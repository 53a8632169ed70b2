"""Weights written from their source, not from the traced module: how a model bigger than memory is exported.

The module is traced with its large parameters as placeholders (``torch.empty``: pages never written take no
memory) and its small ones (up to ``REAL_BYTES``) with their real values, and torch-to-nnef writes the graph as
usual; each variable it would write from a parameter is instead written by a ``StreamedWeights`` writer (e.g.
straight from a memory-mapped safetensors file, cast tensor by tensor). torch-to-nnef's ``write_nnef_tensor`` is
that seam: while ``streamed_writes`` is active, a variable whose label has a writer goes to that writer, any other
variable (constants of the graph, buffers such as rotary tables) is written as usual.

Why small parameters are real: torch-to-nnef reads some values while it translates. It drops a ``mul``/``div`` by
a constant that is all ones (``remap_if_neutral_op``: a ``(1 + w)`` norm whose ``w`` is zero) and folds a product
of two constants. Real small tensors (norm weights, biases, gates, where such values occur) make the same graph as
an in-memory export. A large placeholder must never take part: ``streamed_writes`` refuses the export if a neutral
op is dropped on a constant of ``GUARD_BYTES`` or more, or if a constant of that size is written that is no
streamed weight (it could only come from a placeholder).
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Callable, Iterator, Mapping

import torch

from gdn_export.errors import GdnExportError
from gdn_export.run.archive import VARIABLE


@dataclass(frozen=True)
class StreamedWeights:
    """``writers``: label (a parameter's name in the traced module) -> writes its whole NNEF tensor file (header and
    values); ``placeholders``: the labels of each parameter traced as a placeholder (its names, several when tied):
    each must be written under one of them."""

    writers: Mapping[str, Callable[[BinaryIO], None]]
    placeholders: tuple[frozenset, ...] = ()
    storages: frozenset = frozenset()  # data pointers of the placeholders' storages
    compressed: Mapping[str, str] = field(default_factory=dict)  # label of a block-quantized weight -> float type
    # label -> tract type ("f32", "f16") of each weight matrix (rank >= 2) written in a float type: it may be
    # written after the trace, straight into the archive (``archive_members``; its file where it cannot be sized:
    # ``write_deferred``), while tract reads the graph for its output names, which
    # declares such weights as inputs of that type and never opens their files (gdn_export/backends/nnef/output_names.py)
    deferrable: Mapping[str, str] = field(default_factory=dict)
    # the passes over torch-to-nnef's graph that the weight formats' encodings need, in order (e.g. the linears of
    # int8 weights to tract's integer matmul, the gathers of an int8 or f16 table): each takes the graph
    graph_passes: tuple = ()


REAL_BYTES = 1 << 20  # parameters below this size are traced with their values
# a graph constant this large that is no weight can only come from a placeholder (the lowerings' own constants,
# chunk masks of 64 x 64, are far smaller)
GUARD_BYTES = 1 << 20

_ACTIVE = threading.local()


@contextmanager
def streamed_writes(weights: StreamedWeights | None) -> Iterator[dict]:
    """Route torch-to-nnef's writes of the variables labelled in ``weights.writers`` to them, in this thread; yields
    a dict that collects ``{"written": set of labels, "seconds": time spent in the writers, "deferred": [(file,
    label)]}``: the ``deferrable`` weights are not written yet but listed (``write_deferred`` writes them)."""
    from gdn_export.backends.compat import patched
    from gdn_export.backends.compat.torch_to_nnef import streamed_weight_patches

    record = {"written": set(), "seconds": 0.0, "deferred": []}
    with patched(*streamed_weight_patches(_dispatching, _guarded_neutral, _placeholder_clone)):
        _ACTIVE.weights, _ACTIVE.record = weights, record
        try:
            yield record
        finally:
            _ACTIVE.weights = None


def _active() -> StreamedWeights | None:
    """The streamed weights of this thread's export, or None (an ordinary export: the wrappers do nothing)."""
    return getattr(_ACTIVE, "weights", None)


def _dispatching(original):
    def write_nnef_tensor(array, filename, quantized):
        weights = _active()
        label = Path(filename).name.removesuffix(".dat")
        if weights is None or label not in weights.writers:
            if weights is not None and weights.writers and array.nbytes >= GUARD_BYTES:
                raise GdnExportError(f"torch-to-nnef wrote a constant {label!r} of {array.nbytes} bytes that is no "
                                     "weight of the model: computed from weight placeholders, it would be wrong; "
                                     "export this model in memory instead (streamed=False)")
            return original(array, filename, quantized)
        record = _ACTIVE.record
        record["written"].add(label)
        if label in weights.deferrable:
            record["deferred"].append((Path(filename), label))
            return
        start = time.perf_counter()
        _write(weights, Path(filename), label)
        record["seconds"] += time.perf_counter() - start

    return write_nnef_tensor


def _write(weights: StreamedWeights, path: Path, label: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as file:
        weights.writers[label](file)


def write_deferred(weights: StreamedWeights, deferred: list[tuple[Path, str]]) -> float:
    """Write the files ``streamed_writes`` deferred (``record["deferred"]``); return the seconds it took."""
    start = time.perf_counter()
    for path, label in deferred:
        _write(weights, path, label)
    return time.perf_counter() - start


# the bytes per value of the float types a deferred weight is written in (``StreamedWeights.deferrable``)
DEFERRED_ITEM_BYTES = {"f32": 4, "f16": 2}
NNEF_HEADER_BYTES = 128


def archive_members(weights: StreamedWeights, deferred: list[tuple[Path, str]], graph: str
                    ) -> tuple[dict[str, tuple[int, Callable[[BinaryIO], None]]], list[tuple[Path, str]]]:
    """The deferred weights (``record["deferred"]``) as members an archive writer writes straight from their
    writers (``run.archive.ArchiveWriter``'s ``streamed``: ``"<label>.dat" -> (size, write)``), their sizes from
    the variables of ``graph`` (graph.nnef's text) and their float types; and those it cannot size (to be written
    to their files, ``write_deferred``)."""
    shapes = {m.group(2): m.group(3) for m in VARIABLE.finditer(graph)}
    members, unsized = {}, []
    for path, label in deferred:
        item = DEFERRED_ITEM_BYTES.get(weights.deferrable[label])
        extents = shapes.get(label, "").replace(" ", "").split(",")
        if item is None or not all(extent.isdigit() for extent in extents):
            unsized.append((path, label))
            continue
        count = 1
        for extent in extents:
            count *= int(extent)
        members[path.name] = (NNEF_HEADER_BYTES + count * item, weights.writers[label])
    return members, unsized


def _placeholder_clone(original):
    """torch-to-nnef runs every op on copies of the module's tensors (``NamedTensor.clone`` on each read, in the jit
    trace and in the shape inference after it): most of its time, and memory that grows with the largest weight
    (a 1.2 GB head copied per op). A placeholder's values are not the model's, so its copy need not be one: in the
    trace it is the placeholder itself (the traced graph reads the parameter, as through a clone), elsewhere a new
    placeholder of the same shape and strides."""

    def clone(self, *args, **kwargs):
        weights = _active()
        if weights is None or args or kwargs or self.untyped_storage().data_ptr() not in weights.storages:
            return original(self, *args, **kwargs)
        plain = torch.Tensor.as_subclass(self, torch.Tensor)
        if not torch._C._get_tracing_state():
            plain = torch.empty_like(plain)
        return self.__class__(plain, nnef_name=self.nnef_name)

    return clone


def _guarded_neutral(original):
    def remap_if_neutral_op(torch_graph, node, a, b):
        weights = _active()
        if weights is None or not weights.writers or a.data is None:
            return original(torch_graph, node, a, b)
        data = a.into_tensor_variable().data
        if isinstance(data, torch.Tensor) and data.numel() * data.element_size() >= GUARD_BYTES \
                and bool((data == 1.0).all()):
            raise GdnExportError(f"torch-to-nnef would drop an op by a large all-ones constant (in "
                                 f"{getattr(node, 'kind', '?')}), a value of weight placeholders; export this model "
                                 "in memory instead (streamed=False)")
        return original(torch_graph, node, a, b)

    return remap_if_neutral_op


def variable_labels(graph) -> set[str]:
    """The labels of the variables of torch-to-nnef's NNEF graph (``nnef_tools.model.Graph``; a graph pass of the
    export's target, run before any rewrite): the weights the graph reads."""
    return {op.attribs["label"] for op in graph.operations if op.type == "variable"}


def check_all_written(weights: StreamedWeights, record: dict, read: set[str]) -> None:
    """Every placeholder weight that the graph reads (``read``: its variables' labels, ``variable_labels``) must
    have been written by its writer: one that was not means torch-to-nnef wrote it another way, from the
    placeholder: a wrong model, refused. A weight the graph does not read (a family's re-laid copy replaces it, or,
    traced with its real value, it was dropped as an in-memory export drops it: a multiplication by ones) needs
    nothing."""
    missing = sorted(min(group) for group in weights.placeholders if group & read and not group & record["written"])
    if missing:
        raise GdnExportError(f"{len(missing)} streamed weights were not written as variables of their own name "
                             f"(e.g. {missing[0]}): the export would carry placeholder values; export this model "
                             "in memory instead")


def annotate_compressed_gathers(graph, compressed: Mapping[str, str]) -> None:
    """tract's gather over a block-quantized constant (a Q4_0 embedding table) needs the type of its output
    (``datum_type``): given to every ``tract_core_gather`` whose table is a variable of ``compressed`` (label ->
    type). ``graph``: torch-to-nnef's NNEF graph before it is written (a graph pass of the export's target,
    ``backends.nnef.target.OfflineTractTarget``): torch-to-nnef's ``embedding`` handler gives ``datum_type`` only to
    a table of its own quantized tensors, and a streamed table is a placeholder to it."""
    for op in graph.operations:
        if op.type != "tract_core_gather" or "datum_type" in op.attribs or not op.inputs:
            continue
        table = op.inputs[0].producer
        if table is not None and table.type == "variable" and table.attribs.get("label") in compressed:
            op.attribs["datum_type"] = compressed[table.attribs["label"]]
