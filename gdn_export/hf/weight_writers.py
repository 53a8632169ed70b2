"""How each parameter of the exportable model is written from the checkpoint: in the export dtype, in Q4_0, in int8
or in float16.

``plan_writes`` pairs every parameter the traced graph may write (under each of its names: a tied tensor has two)
with a writer that reads the checkpoint: the parameter's own tensor, or rows of one for the weights a family
re-lays (``gdn_export.models.derived``). With ``quantize="q4_0"`` the weight of every ``nn.Linear`` whose inner
size is whole blocks of 32 is written in tract's Q4_0 (``gdn_export.weights.q4_0``), and the embedding table too
with ``quantize_embeddings``. A head tied to the table is a linear layer like any other: ``separate_tied_head``
gives it a Q4_0 copy of the table of its own. ``dequantized_view`` gives the check the same weights as tract will
compute with. With ``quantize="int8"`` (``gdn_export.weights.int8``) the weight of every ``nn.Linear`` whose
reference is transformers' own ``nn.Linear`` is written in int8 with a scale per output channel, and the graph's
``linear`` of it becomes tract's integer matmul (``int8.lower_linears``, a pass over torch-to-nnef's graph). In a
quantized export of float32 the embedding table, which only a gather reads, is stored in int8 with a scale per row, and the gather takes codes and
scales (``int8.lower_gathers``): a quarter of its float32 bytes, the largest tensor a quantized archive had left.
With ``quantize="f16"`` (``gdn_export.weights.f16``) every linear layer's weight and every table is stored in float16
for a float32 graph (the tables negated, a tied head with a copy of its own, ``f16.lower_gathers``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Callable

import numpy as np
import torch
from torch import nn

from gdn_export.errors import GdnExportError
from gdn_export.hf.blocks import ExpertStacks
from gdn_export.hf.tensors import TORCH_TO_NUMPY, write_nnef_rows
from gdn_export.models.derived import PLACEHOLDER, RECIPE, Recipe, rows_of
from gdn_export.targets import NNEF_DATUM
from gdn_export.weights.encoding import Encoding
from gdn_export.weights.formats import weight_format
from gdn_export.weights.streamed import StreamedWeights

@dataclass
class QuantizationReport:
    """What a quantized export stored in its weight format, and what it left in the export dtype."""

    scheme: str | None = None
    own: dict = field(default_factory=dict)  # the weight format's own values (its codec's report_fields), its codec's
    quantized: list[str] = field(default_factory=list)  # checkpoint parameter names
    kept: Counter = field(default_factory=Counter)  # reason -> count of 2-D weights left unquantized
    bytes_before: int = 0  # of the quantized tensors, in the export dtype
    bytes_after: int = 0
    tables: list[str] = field(default_factory=list)  # checkpoint names of embedding tables stored beside the weights
    table_words: str = ""  # how they are stored, in the report's words (the tables' encoding's)
    table_bytes: tuple[int, int] = (0, 0)  # their bytes in the export dtype, and stored
    round_trips: dict = field(default_factory=dict)  # checkpoint name -> its reading once stored (the reference's)
    describe: Callable = lambda report: ""  # the weight format's own words (its codec's describe)

    def __str__(self) -> str:
        if self.scheme is None:
            return ""
        details = self.describe(self)
        label = weight_format(self.scheme).label
        text = (f"{len(self.quantized)} weights in {label} ({_size(self.bytes_before)} -> "
                f"{_size(self.bytes_after)}{details})")
        if self.tables:
            text += (f"; {len(self.tables)} embedding table in {self.table_words}: {_size(self.table_bytes[0])} -> "
                     f"{_size(self.table_bytes[1])})")
        if self.kept:
            text += "; kept in the export dtype: " + ", ".join(f"{n} {why}" for why, n in sorted(self.kept.items()))
        if warning := getattr(weight_format(self.scheme).codec_module(), "slow_here_warning", lambda: "")():
            text += f"; WARNING: {warning}"
        return text


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def separate_tied_head(model: nn.Module, quantize: str | None, quantize_embeddings: bool) -> tuple[str, str] | None:
    """With ``quantize``, give a head tied to the embedding table a weight of its own (a copy recorded as derived
    from the table, so it is written from the checkpoint, in Q4_0 as every linear layer); return the names of the
    table and of the head when it did.

    Why: decode reads the whole head once per token and only a few rows of the table, so a tied head left in the
    export dtype (622 MB in f32 for vocab 151936 x 1024) would dominate a Q4_0 model's decode step; its Q4_0 copy
    costs 4.5 bits a weight more on disk and in memory. Not with ``quantize_embeddings``: the table and the head
    would then be the same Q4_0 constant, which tract merges into one with two readers and re-packs for the head
    on every call (see ``models/decoder.py`` ``vocab_projection``), and tract 0.23.9 cannot slice a Q4_0 table to
    avoid that."""
    if quantize is None:
        return None
    codec = weight_format(quantize).codec_module()
    names = {id(param): name for name, param in model.named_parameters()}
    tables = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    heads = [(name, module) for name, module in model.named_modules()
             if isinstance(module, nn.Linear) and id(module.weight) in tables]
    if not heads:
        return None
    if quantize_embeddings:
        raise GdnExportError("--quantize-embeddings with a head tied to the embedding table: tract 0.23.9 cannot slice "
                             "a Q4_0 table (the tied head reads it as two slices, see models/decoder.py); quantize "
                             "without --quantize-embeddings (the head then gets a Q4_0 copy of its own, the table "
                             "stays in the export dtype)")
    if len(heads) != 1:  # several linear layers read the table: left as it is (its slices stay in --dtype)
        return None
    (head_name, head), = heads
    if not codec.quantizable(tuple(head.weight.shape)):
        return None
    table_name = names[id(head.weight)]
    head.weight = rows_of(head.weight, None)
    return table_name, f"{head_name}.weight"


def untied_view(weights, layout, names: tuple[str, str]):
    """``weights`` and ``layout`` for the reference of an export whose tied head got its own copy of the table
    (``separate_tied_head`` gave ``names``: table, head): the same values, the table's tensor under both names."""
    table, head = names
    entries = {**weights.entries, head: weights.entries[table]}
    return replace(weights, entries=entries), replace(layout, config={**layout.config, "tie_word_embeddings": False})


def plan_writes(lm: nn.Module, model: nn.Module, weights, dtype: torch.dtype, quantize: str | None = None,
                quantize_embeddings: bool = False, fused_moe: Callable[[str], bool] = lambda gate: False,
                q4_rule: str | None = None, calibration=None,
                int8_passes: int = 1) -> tuple[StreamedWeights, QuantizationReport]:
    """The writers of ``lm``'s parameters (``model`` is the checkpoint's model inside it) and what was quantized.

    ``q4_rule``: how each Q4_0 block's scale is chosen (``q4_0.RULES``; None: the first); ``calibration`` (a
    ``gdn_export.hf.calibration.Calibration``): the search weighs each weight's error by its input channel's
    importance, for the weights it measured whose columns the export keeps as they are (no ``part`` or ``pad``
    recipe); the others are searched unweighted.

    ``fused_moe(gate)``: whether a ``moe_ffn`` node of that gate runs as tract's ``tract_moe_ffn`` in this export
    (``ops.moe_ffn.nnef.decide``): only then are its expert stacks quantized (the op's Q4_0 path, all three
    stacks or none); the dense form would read them through reshapes and slices, which a Q4_0 constant cannot take."""
    fmt = weight_format(quantize)  # an unknown name: its one-line error
    codec = fmt.codec_module() if quantize is not None else None
    names = {id(param): name for name, param in model.named_parameters()}
    labels: dict[int, list[str]] = {}  # a tied tensor has several names: torch-to-nnef may write it under any
    for label, param in lm.named_parameters(remove_duplicate=False):
        labels.setdefault(id(param), []).append(label)
    params = {id(param): param for param in lm.parameters()}
    tables = {id(m.weight) for m in lm.modules() if isinstance(m, nn.Embedding)}
    linear = {id(m.weight) for m in lm.modules() if isinstance(m, nn.Linear)}
    report = QuantizationReport(scheme=quantize, describe=getattr(codec, "describe", lambda report: ""))
    if hasattr(codec, "report_fields"):  # the format's own values, given its options
        report.own.update(codec.report_fields(q4_rule=q4_rule, calibration=calibration, int8_passes=int8_passes))
    chosen: set[int] = set()
    table_keys: set[int] = set()
    tables_encoding = None
    if codec is not None:  # a head still tied to the table (no block-sized rows) is the table: kept with it
        candidates = (linear | tables) if quantize_embeddings else linear - tables
        chosen = {key for key in candidates if codec.quantizable(tuple(params[key].shape))}
        if hasattr(codec, "select"):  # the format narrows the choice (e.g. to weights its check can emulate)
            chosen, kept = codec.select(chosen, candidates,
                                        lambda key: _reference_is_linear(params[key], names, model))
            report.kept.update(kept)
        stacks = [m for m in lm.modules() if isinstance(m, ExpertStacks)]
        for module in stacks:
            trio = [module.gate_proj, module.up_proj, module.down_proj]
            keys = {id(p) for p in trio}
            shapes = [(tuple(p.shape), tuple(getattr(p, RECIPE).source.shape) if hasattr(p, RECIPE) else None)
                      for p in trio]
            kept_why = codec.expert_stacks_kept(shapes, fused_moe(module.gate)) \
                if hasattr(codec, "expert_stacks_kept") else "expert stacks (this weight format stores none)"
            if kept_why:
                report.kept[kept_why] += len(trio)
            else:
                chosen |= keys
            candidates |= keys
            # the checkpoint's own stacks the derived ones replace: never read by the graph
            candidates |= {id(getattr(p, RECIPE).source) for p in trio if hasattr(p, RECIPE)}
        report.kept["not a linear layer's weight (embeddings, convolutions, MoE routers)"] = sum(
            p.dim() >= 2 and key not in candidates for key, p in params.items())
        report.kept = +report.kept  # without the zero counts
        gathered_only = tables - chosen - linear  # a table only gathered from (not a tied head's too)

        def pick(table_codec) -> frozenset:
            table_keys.update(key for key in gathered_only if table_codec.quantizable(tuple(params[key].shape)))
            return frozenset(label for key in table_keys for label in labels[key])

        tables_encoding = codec.tables_encoding(str(dtype).removeprefix("torch."), pick) \
            if hasattr(codec, "tables_encoding") else None
        if tables_encoding is None or not tables_encoding.labels:  # no table stored beside the weights
            tables_encoding = None
            table_keys.clear()
    weights_encoding = None
    if codec is not None:
        chosen_labels = frozenset(label for key in chosen for label in labels[key])
        weights_encoding = codec.weights_encoding(chosen_labels, report) if hasattr(codec, "weights_encoding") \
            else Encoding(codec, chosen_labels)
    if tables_encoding is not None:
        report.table_words = tables_encoding.table_words
    writers = {}
    for key, group in labels.items():
        param = params[key]
        encoding = weights_encoding if key in chosen else tables_encoding if key in table_keys else None
        source = _source_name(param, names) if encoding is not None else None
        if key in chosen and calibration is not None and hasattr(codec, "note_calibrated"):
            recipe = getattr(param, RECIPE, None)
            codec.note_calibrated(report.own, source, calibration, matrix=param.dim() == 2,
                                  columns_kept=recipe is None or (recipe.part is None and recipe.pad is None))
        writer = _writer(group[0], param, names, weights, dtype, encoding, tuple(group), source)
        if key in chosen:
            report.quantized.append(source)
            report.bytes_before += param.numel() * dtype.itemsize
            report.bytes_after += encoding.nbytes(tuple(param.shape))
        elif key in table_keys:
            report.tables.append(source)
            report.table_bytes = (report.table_bytes[0] + param.numel() * dtype.itemsize, report.table_bytes[1] +
                                  encoding.nbytes(tuple(param.shape)))
        writers.update(dict.fromkeys(group, writer))
    for encoding in (weights_encoding, tables_encoding):  # what the reference reads of each stored tensor
        if encoding is not None:
            names_stored = report.quantized if encoding is weights_encoding else report.tables
            report.round_trips.update({name: encoding.round_trip(name) for name in names_stored})
    placeholders = tuple(frozenset(group) for key, group in labels.items() if getattr(params[key], PLACEHOLDER, False))
    storages = frozenset(p.untyped_storage().data_ptr() for p in params.values() if getattr(p, PLACEHOLDER, False))
    compressed = {label: NNEF_DATUM[str(dtype).removeprefix("torch.")] for key in tables & chosen
                  for label in labels[key]}
    deferrable = {label: NNEF_DATUM[str(dtype).removeprefix("torch.")] for key, group in labels.items()
                  if key not in chosen | table_keys and params[key].dim() >= 2 for label in group}
    for keys, encoding in ((chosen, weights_encoding), (table_keys, tables_encoding)):  # stored in a float type too
        if encoding is not None and encoding.float_type is not None:
            deferrable.update({label: encoding.float_type for key in keys if params[key].dim() >= 2
                               for label in labels[key]})
    graph_passes: tuple = ()
    for encoding in (weights_encoding, tables_encoding):  # their own tensors (int8 scales): written after the passes
        if encoding is not None:
            writers.update(encoding.extra)
            deferrable.update(dict.fromkeys(encoding.extra, NNEF_DATUM["float32"]))
            graph_passes += encoding.graph_passes
    return StreamedWeights(writers, placeholders, storages, compressed, deferrable, graph_passes), report


def _reference_is_linear(param, names: dict, model: nn.Module) -> bool:
    """The check's reference rounds the input of transformers' own ``nn.Linear`` (``int8.reference_hooks``): the
    weight must be one (the checkpoint parameter itself, or rows of it: a scale per row is the same either way)."""
    recipe = getattr(param, RECIPE, None)
    if recipe is not None and (recipe.part is not None or recipe.pad is not None or id(recipe.source) not in names):
        return False
    name = _source_name(param, names)
    module = model.get_submodule(name.rpartition(".")[0]) if "." in name else None
    return isinstance(module, nn.Linear) and name.endswith(".weight")


def _source_name(param, names: dict) -> str:
    if id(param) in names:  # a checkpoint weight, or a whole copy of one under its own name (a separated head)
        return names[id(param)]
    return names[id(getattr(param, RECIPE).source)]


def checkpoint_source(label: str, param, names: dict, weights):
    """(the checkpoint tensor parameter ``label`` is written from, the ``Recipe`` that derives it or None for the
    tensor as it is): the tensor itself, or the one its recipe names (``names``: id of a checkpoint parameter ->
    its name)."""
    recipe = getattr(param, RECIPE, None)
    if recipe is None and id(param) in names:
        return weights.entries[names[id(param)]], None
    if recipe is None or id(recipe.source) not in names:
        raise GdnExportError(f"the exportable model's parameter {label} is no checkpoint weight and records no "
                             "recipe (gdn_export.models.derived); it cannot be written from the checkpoint: "
                             "convert with streamed=False (--in-memory)")
    return weights.entries[names[id(recipe.source)]], recipe


@dataclass(frozen=True)
class DerivedSource:
    """A checkpoint tensor through a ``Recipe`` (``gdn_export.models.derived``: a weight a family re-lays), read a
    slice of the result's rows at a time: picked rows by runs of consecutive ones, a recipe without picked rows on
    the same run of the source's rows."""

    entry: object  # a TensorEntry or ParameterSource: anything with rows(start, stop, target)
    recipe: Recipe

    @property
    def name(self) -> str:
        return f"{self.entry.name}, derived"

    @property
    def shape(self) -> tuple[int, ...]:
        return self.recipe.shape

    def release(self) -> None:
        getattr(self.entry, "release", lambda: None)()

    def rows(self, start: int, stop: int, target: np.dtype) -> np.ndarray:
        """Rows ``start:stop`` of the result as ``target``, flat."""
        inner = tuple(self.entry.shape[1:])
        if self.recipe.rows is None:
            value = self.entry.rows(start, stop, target).reshape(stop - start, *inner)
        else:
            parts, wanted, run = [], [int(r) for r in self.recipe.rows[start:stop]], 0
            for i in range(1, len(wanted) + 1):
                if i == len(wanted) or wanted[i] != wanted[i - 1] + 1:
                    parts.append(self.entry.rows(wanted[run], wanted[i - 1] + 1, target))
                    run = i
            value = (np.concatenate(parts) if parts else np.empty(0, target)).reshape(len(wanted), *inner)
        return np.ascontiguousarray(self.recipe.apply(value, rows_applied=True)).reshape(-1)


def _writer(label: str, param, names: dict, weights, dtype: torch.dtype, encoding: Encoding | None,
            aliases: tuple[str, ...] = (), source: str | None = None):
    """Writes parameter ``label`` from the checkpoint: its tensor, or its recipe's result; stored by ``encoding``
    (a weight format's: codes, blocks, float16...; ``source``: its checkpoint name), else in the export dtype; a
    slice of rows at a time (memory: one slice, or the one source a conversion makes whole). ``aliases``: every
    label of the parameter."""
    entry, recipe = checkpoint_source(label, param, names, weights)
    shape = tuple(param.shape)
    aliases = aliases or (label,)

    def write(file) -> None:
        source_rows = entry if recipe is None else DerivedSource(entry, recipe)
        target = np.dtype(np.float32 if encoding is not None else TORCH_TO_NUMPY[dtype])
        read = lambda start, stop: source_rows.rows(start, stop, target).reshape(stop - start, *shape[1:])  # noqa: E731
        try:
            if encoding is not None:
                encoding.write(file, shape, read, label, aliases, source)
            else:
                write_nnef_rows(file, shape, target, read)
        finally:
            getattr(source_rows, "release", lambda: None)()

    return write


@dataclass
class _Dequantized:
    """A checkpoint tensor read as tract computes with it once stored: through ``round_trip`` (Q4_0 or int8)."""

    source: object
    round_trip: Callable[[torch.Tensor], torch.Tensor]

    def __getattr__(self, name):
        return getattr(self.source, name)

    def read(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.round_trip(self.source.read(torch.float32)).to(dtype)


def dequantized_view(weights, report: QuantizationReport):
    """``weights`` with the parameters stored in a weight format (and the tables stored beside them) read as tract
    reads them: the check's reference of a quantized export."""
    if not report.quantized and not report.tables:
        return weights
    codec = weight_format(report.scheme).codec_module()
    entries = dict(weights.entries)
    for name in [*report.quantized, *report.tables]:
        entries[name] = _Dequantized(weights.entries[name], report.round_trips.get(name, codec.round_trip))
    return replace(weights, entries=entries)


def int8_reference_linears(report: QuantizationReport) -> frozenset:
    """The names of transformers' ``nn.Linear`` modules whose input the reference rounds (a format whose graph
    rounds the inputs of its layers: int8, its codec's ``ROUNDS_INPUTS``)."""
    if report.scheme is None or not getattr(weight_format(report.scheme).codec_module(), "ROUNDS_INPUTS", False):
        return frozenset()
    return frozenset(name.rpartition(".")[0] for name in report.quantized)
