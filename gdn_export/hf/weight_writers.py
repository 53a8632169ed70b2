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
from functools import partial
from typing import Callable

import numpy as np
import torch
from torch import nn

from gdn_export.errors import GdnExportError
from gdn_export.hf.blocks import ExpertStacks
from gdn_export.hf.tensors import TORCH_TO_NUMPY, write_nnef_rows
from gdn_export.models.derived import PLACEHOLDER, RECIPE, Recipe, rows_of
from gdn_export.targets import NNEF_DATUM
from gdn_export.weights import f16, int8, q4_0
from gdn_export.weights.streamed import StreamedWeights

SCHEMES = {q4_0.NAME: q4_0, int8.NAME: int8, f16.NAME: f16}
QUANTIZATIONS = tuple(SCHEMES)


@dataclass
class QuantizationReport:
    """What a quantized export stored in Q4_0, and what it left in the export dtype."""

    scheme: str | None = None
    rule: str = q4_0.RULES[0]  # how each block's scale was chosen (gdn_export.weights.q4_0.RULES)
    calibration: str = ""  # the calibration that weighted the search, in words ("" for none)
    importance: dict[str, np.ndarray] = field(default_factory=dict)  # checkpoint name -> weight of each input channel
    grams: dict[str, np.ndarray] = field(default_factory=dict)  # checkpoint name -> E[a a^T] (rule "gptq")
    quantized: list[str] = field(default_factory=list)  # checkpoint parameter names
    kept: Counter = field(default_factory=Counter)  # reason -> count of 2-D weights left unquantized
    bytes_before: int = 0  # of the quantized tensors, in the export dtype
    bytes_after: int = 0
    int8_tables: list[str] = field(default_factory=list)  # checkpoint names of embedding tables stored in int8
    table_bytes: tuple[int, int] = (0, 0)  # their bytes in the export dtype, and in int8 (codes and scales)
    int8_passes: int = 1  # int8: each linear layer's input rounded in 1 or 2 passes (int8.round_activations)
    f16_tables: list[str] = field(default_factory=list)  # f16: checkpoint names of embedding tables stored in f16

    def __str__(self) -> str:
        if self.scheme is None:
            return ""
        how = f"{self.rule} scales" if self.rule != "gptq" else f"GPTQ for {len(self.grams)} of them, the others search"
        if self.calibration:
            how += f", {self.calibration}, {len(self.importance)} of them weighted by input channel"
        text = (f"{len(self.quantized)} weights in {self.scheme.upper()} ({_size(self.bytes_before)} -> "
                f"{_size(self.bytes_after)}{f'; {how}' if self.scheme == q4_0.NAME else ''}"
                f"{'; inputs rounded in 2 passes (codes and residual)' if self.int8_passes == 2 else ''})")
        if self.f16_tables:
            text += (f"; {len(self.f16_tables)} embedding table in F16 (negated, the gathered rows negated back: "
                     f"{_size(self.table_bytes[0])} -> {_size(self.table_bytes[1])})")
        if self.int8_tables:
            text += (f"; {len(self.int8_tables)} embedding table in int8 (a scale per row, applied to the gathered "
                     f"rows: {_size(self.table_bytes[0])} -> {_size(self.table_bytes[1])})")
        if self.kept:
            text += "; kept in the export dtype: " + ", ".join(f"{n} {why}" for why, n in sorted(self.kept.items()))
        if self.scheme == int8.NAME and (warning := int8.slow_here_warning()):
            text += f"; WARNING: {warning}"
        return text


    def q4_0_rule(self, name: str) -> tuple[str, np.ndarray | None, np.ndarray | None]:
        """(rule, importance, second moments) the weight of checkpoint name ``name`` was stored with: GPTQ needs
        its input's second moments, a weight without them is searched."""
        if name in self.grams:
            return "gptq", self.importance.get(name), self.grams[name]
        return ("search" if self.rule == "gptq" else self.rule), self.importance.get(name), None


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
    scheme = SCHEMES.get(quantize, q4_0)
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
    if not scheme.quantizable(tuple(head.weight.shape)):
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
                q4_rule: str = q4_0.RULES[0], calibration=None,
                int8_passes: int = 1) -> tuple[StreamedWeights, QuantizationReport]:
    """The writers of ``lm``'s parameters (``model`` is the checkpoint's model inside it) and what was quantized.

    ``q4_rule``: how each Q4_0 block's scale is chosen (``q4_0.RULES``); ``calibration`` (a
    ``gdn_export.hf.calibration.Calibration``): the search weighs each weight's error by its input channel's
    importance, for the weights it measured whose columns the export keeps as they are (no ``part`` or ``pad``
    recipe); the others are searched unweighted.

    ``fused_moe(gate)``: whether a ``moe_ffn`` node of that gate runs as tract's ``tract_moe_ffn`` in this export
    (``ops.moe_ffn.nnef.decide``): only then are its expert stacks quantized (the op's Q4_0 path, all three
    stacks or none); the dense form would read them through reshapes and slices, which a Q4_0 constant cannot take."""
    if quantize is not None and quantize not in QUANTIZATIONS:
        raise GdnExportError(f"quantize {quantize!r} is not one of {', '.join(QUANTIZATIONS)}")
    scheme = SCHEMES.get(quantize)
    names = {id(param): name for name, param in model.named_parameters()}
    labels: dict[int, list[str]] = {}  # a tied tensor has several names: torch-to-nnef may write it under any
    for label, param in lm.named_parameters(remove_duplicate=False):
        labels.setdefault(id(param), []).append(label)
    params = {id(param): param for param in lm.parameters()}
    tables = {id(m.weight) for m in lm.modules() if isinstance(m, nn.Embedding)}
    linear = {id(m.weight) for m in lm.modules() if isinstance(m, nn.Linear)}
    if q4_rule not in q4_0.RULES:
        raise GdnExportError(f"Q4_0 rule {q4_rule!r} is not one of {', '.join(q4_0.RULES)}")
    report = QuantizationReport(scheme=quantize, rule=q4_rule, calibration=str(calibration or ""),
                                int8_passes=int8_passes)
    chosen: set[int] = set()
    table8: set[int] = set()
    table16: set[int] = set()
    if quantize is not None:  # a head still tied to the table (no block-sized rows) is the table: kept with it
        candidates = (linear | tables) if quantize_embeddings else linear - tables
        chosen = {key for key in candidates if scheme.quantizable(tuple(params[key].shape))}
        if scheme is q4_0:
            report.kept[f"with an inner size not a multiple of {q4_0.BLOCK}"] = len(candidates - chosen)
        elif scheme is int8:
            emulable = {key for key in chosen if _int8_reference_is_linear(params[key], names, model)}
            report.kept["whose reference is no nn.Linear of transformers' model, or re-laid beyond a choice of rows"] \
                = len(chosen - emulable)
            chosen = emulable
        stacks = [m for m in lm.modules() if isinstance(m, ExpertStacks)]
        for module in stacks:
            trio = [module.gate_proj, module.up_proj, module.down_proj]
            keys = {id(p) for p in trio}
            if scheme is int8:
                report.kept["expert stacks (tract_moe_ffn takes f32, f16 or Q4_0 stacks: no operand for int8 "
                            "scales)"] += len(trio)
            elif scheme is f16:
                report.kept["expert stacks (f16 stacks in a float32 tract_moe_ffn not measured)"] += len(trio)
            elif not fused_moe(module.gate):
                report.kept["expert stacks of a MoE that runs dense (no tract_moe_ffn: see the MoE lines)"] += len(trio)
            elif not all(_quantizable_derived(p) for p in trio):
                report.kept[f"expert stacks with an inner size not a multiple of {q4_0.BLOCK}"] += len(trio)
            else:
                chosen |= keys
            candidates |= keys
            # the checkpoint's own stacks the derived ones replace: never read by the graph
            candidates |= {id(getattr(p, RECIPE).source) for p in trio if hasattr(p, RECIPE)}
        report.kept["not a linear layer's weight (embeddings, convolutions, MoE routers)"] = sum(
            p.dim() >= 2 and key not in candidates for key, p in params.items())
        report.kept = +report.kept  # without the zero counts
        gathered_only = tables - chosen - linear  # a table only gathered from (not a tied head's too)
        if scheme is f16:  # its rows in f16, negated (f16.lower_gathers)
            table16 = {key for key in gathered_only if f16.quantizable(tuple(params[key].shape))}
        elif dtype == torch.float32:  # codes and scales gathered
            table8 = {key for key in gathered_only if int8.quantizable(tuple(params[key].shape))}
    int8_weights = int8.Int8Weights(frozenset(label for key in chosen for label in labels[key]),
                                    passes=int8_passes) if scheme is int8 else None
    # an int8 archive's tables are stored negated: a tied head's int8 copy would otherwise be the same constant as its
    # table for tract (Int8Weights)
    int8_tables = int8.Int8Weights(frozenset(label for key in table8 for label in labels[key]),
                                   negated=scheme is int8) if table8 else None
    writers = {}
    for key, group in labels.items():
        param = params[key]
        stored = scheme.NAME if key in chosen else int8.NAME if key in table8 else f16.NAME if key in table16 \
            else None
        if key in chosen:
            source = _source_name(param, names)
            recipe = getattr(param, RECIPE, None)
            if scheme is q4_0 and calibration is not None and source in calibration.importance and (
                    recipe is None or (recipe.part is None and recipe.pad is None)):
                report.importance[source] = calibration.importance[source]
                if q4_rule == "gptq" and source in calibration.grams and param.dim() == 2:
                    report.grams[source] = calibration.grams[source]
        writer = _writer(group[0], param, names, weights, dtype, stored,
                         int8_tables if key in table8 else int8_weights, tuple(group),
                         report.q4_0_rule(source) if stored == q4_0.NAME else None, negated=key in table16)
        if key in chosen:
            report.quantized.append(source)
            report.bytes_before += param.numel() * dtype.itemsize
            report.bytes_after += scheme.nbytes(tuple(param.shape))
        elif key in table8 or key in table16:
            (report.int8_tables if key in table8 else report.f16_tables).append(_source_name(param, names))
            report.table_bytes = (report.table_bytes[0] + param.numel() * dtype.itemsize, report.table_bytes[1] +
                                  (int8 if key in table8 else f16).nbytes(tuple(param.shape)))
        writers.update(dict.fromkeys(group, writer))
    placeholders = tuple(frozenset(group) for key, group in labels.items() if getattr(params[key], PLACEHOLDER, False))
    storages = frozenset(p.untyped_storage().data_ptr() for p in params.values() if getattr(p, PLACEHOLDER, False))
    compressed = {label: NNEF_DATUM[str(dtype).removeprefix("torch.")] for key in tables & chosen for label in labels[key]}
    deferrable = {label: NNEF_DATUM[str(dtype).removeprefix("torch.")] for key, group in labels.items()
                  if key not in chosen | table8 | table16 and params[key].dim() >= 2 for label in group}
    for quantized in (int8_weights, int8_tables):  # int8 scales: written once the graph pass gave their shapes
        if quantized is not None:
            scales = int8.scale_writers(quantized)
            writers.update(scales)
            deferrable.update(dict.fromkeys(scales, NNEF_DATUM["float32"]))
    f16_tables = frozenset(label for key in table16 for label in labels[key])
    return StreamedWeights(writers, placeholders, storages, compressed, deferrable, int8_weights, int8_tables,
                           f16_tables), report


def _int8_reference_is_linear(param, names: dict, model: nn.Module) -> bool:
    """The check's reference rounds the input of transformers' own ``nn.Linear`` (``int8.reference_hooks``): the
    weight must be one (the checkpoint parameter itself, or rows of it: a scale per row is the same either way)."""
    recipe = getattr(param, RECIPE, None)
    if recipe is not None and (recipe.part is not None or recipe.pad is not None or id(recipe.source) not in names):
        return False
    name = _source_name(param, names)
    module = model.get_submodule(name.rpartition(".")[0]) if "." in name else None
    return isinstance(module, nn.Linear) and name.endswith(".weight")


def _quantizable_derived(param) -> bool:
    """Q4_0 blocks of the parameter are blocks of its source too (so that the check's reference, the source read
    through Q4_0, computes with what tract does): both inner sizes whole blocks."""
    recipe = getattr(param, RECIPE, None)
    return q4_0.quantizable(tuple(param.shape)) and (recipe is None or q4_0.quantizable(tuple(recipe.source.shape)))


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


def _writer(label: str, param, names: dict, weights, dtype: torch.dtype, stored: str | None,
            int8_weights: int8.Int8Weights | None = None, aliases: tuple[str, ...] = (),
            q4_0_rule: tuple | None = None, negated: bool = False):
    """Writes parameter ``label`` from the checkpoint: its tensor, or its recipe's result; in ``stored`` ("q4_0",
    "int8": then its scales go to ``int8_weights``), else in the export dtype; a slice of rows at a time
    (memory: one slice, or the one source a conversion makes whole). ``aliases``: every label of the parameter.
    ``q4_0_rule``: (rule, importance, second moments) of a Q4_0 weight (``QuantizationReport.q4_0_rule``);
    ``negated``: an f16 table's values negated (``gdn_export.weights.f16``)."""
    entry, recipe = checkpoint_source(label, param, names, weights)
    shape = tuple(param.shape)
    aliases = aliases or (label,)
    quantized = stored in SCHEMES

    def write(file) -> None:
        source = entry if recipe is None else DerivedSource(entry, recipe)
        target = np.dtype(np.float32 if quantized else TORCH_TO_NUMPY[dtype])
        read = lambda start, stop: source.rows(start, stop, target).reshape(stop - start, *shape[1:])  # noqa: E731
        try:
            if stored == int8.NAME:
                scales = int8.write_nnef(file, shape, read, negated=int8_weights.negated)
                int8_weights.scales.update(dict.fromkeys(aliases, scales))
            elif stored == f16.NAME:
                f16.write_nnef(file, shape, read, negated=negated, name=f"weight {label}")
            elif quantized:
                q4_0.write_nnef(file, shape, read, *(q4_0_rule or ()))
            else:
                write_nnef_rows(file, shape, target, read)
        finally:
            getattr(source, "release", lambda: None)()

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
    """``weights`` with the quantized parameters (and the tables stored in int8) read as tract reads them: the
    check's reference of a quantized export."""
    if not report.quantized and not report.int8_tables and not report.f16_tables:
        return weights
    entries = dict(weights.entries)
    for name in report.quantized:
        round_trip = SCHEMES[report.scheme].round_trip
        if report.scheme == q4_0.NAME:  # with the rule, importance and second moments it was written with
            round_trip = partial(q4_0.round_trip, **dict(zip(("rule", "importance", "gram"), report.q4_0_rule(name))))
        entries[name] = _Dequantized(weights.entries[name], round_trip)
    for name in report.int8_tables:
        entries[name] = _Dequantized(weights.entries[name], int8.round_trip)
    for name in report.f16_tables:
        entries[name] = _Dequantized(weights.entries[name], f16.round_trip)
    return replace(weights, entries=entries)


def int8_reference_linears(report: QuantizationReport) -> frozenset:
    """The names of transformers' ``nn.Linear`` modules whose input the reference of an int8 export rounds."""
    if report.scheme != int8.NAME:
        return frozenset()
    return frozenset(name.rpartition(".")[0] for name in report.quantized)
