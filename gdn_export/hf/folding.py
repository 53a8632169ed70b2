"""Per-channel scales folded into a norm and the linear layers that read it: exact in float, better Q4_0 blocks.

A norm whose output ``y`` is read only by linear layers (a decoder layer's input norm and its projections, the
post-attention norm and the MLP's gate and up, the final norm and the head) can divide its output by a scale
``s_j`` per channel (its weight ``w / s``, or ``(1 + w) / s - 1`` for the ``normed * (1 + w)`` form of Qwen's
norms) while each reader multiplies its weight's column ``j`` by ``s_j``: ``(W diag(s)) (y / s) = W y``, the same
model in float (AWQ's transformation). Quantized, the columns of large ``s_j`` get a finer grid relative to their
values: with ``s_j = E[y_j^2]^(alpha / 2)`` (normalized to a geometric mean of 1) the channels that carry large
activations, whose weight errors cost most, are quantized more finely. ``alpha`` is chosen per norm among
``ALPHAS`` by the expected squared output error of its readers (``sum_j E[y_j^2] / s_j^2 * |Q(W s)_j - (W s)_j|^2``
over a sample of rows), 0 (no fold) included, so a fold is made only where it lowers that error.

Only what calibration saw is folded (``Calibration.readers``: the linear layers whose input is the norm's output
tensor itself, and the norm's form, found by running it), only norms all of whose recorded readers are checkpoint
weights of their own (not a tied head), and the whole is verified: the folded float model's logits must equal the
published model's within the float32 rule (``gdn_export.parity``) on the calibration's first tokens, else nothing
is folded and the report says why.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import torch

from gdn_export.weights import q4_0

ALPHAS = (0.0, 0.25, 0.5, 0.75)
SAMPLE_ROWS = 512  # rows of each reader the choice of alpha is measured on


@dataclass(frozen=True)
class Fold:
    norm: str  # the norm weight's checkpoint name
    form: str  # "scale" or "one_plus" (Calibration.forms)
    readers: tuple[str, ...]
    scale: np.ndarray  # s per channel (float32)
    alpha: float


@dataclass
class Folded:
    """A checkpoint tensor with a fold applied: a norm weight divided by ``scale`` (in its ``form``), or a linear
    weight's columns multiplied by it. ``read`` and ``rows`` as the tensor's own (what the writers and the check's
    reference read)."""

    source: object
    scale: np.ndarray
    form: str  # "scale" / "one_plus" for a norm, "columns" for a reader

    def __getattr__(self, name):
        return getattr(self.source, name)

    def _apply(self, values: np.ndarray, start: int, stop: int) -> np.ndarray:
        if self.form == "columns":
            return (values.reshape(stop - start, -1) * self.scale).reshape(-1)
        scale = self.scale[start:stop]
        return values / scale if self.form == "scale" else (1 + values) / scale - 1

    def rows(self, start: int, stop: int, target: np.dtype) -> np.ndarray:
        values = self.source.rows(start, stop, np.dtype(np.float32))
        return self._apply(values, start, stop).astype(target, copy=False)

    def read(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        rows = self.source.shape[0] if self.source.shape else 1
        return torch.from_numpy(self.rows(0, rows, np.dtype(np.float32)).reshape(self.source.shape)).to(dtype)


@dataclass
class FoldReport:
    folds: list[Fold] = field(default_factory=list)
    refused: str = ""  # why nothing was folded, when the float check failed

    def __str__(self) -> str:
        if self.refused:
            return f"no scales folded ({self.refused})"
        if not self.folds:
            return "no scales folded (none lowered the expected error)"
        alphas = sorted({f.alpha for f in self.folds})
        return (f"scales folded into {len(self.folds)} norms and their {sum(len(f.readers) for f in self.folds)} "
                f"readers (alpha {', '.join(f'{a:g}' for a in alphas)})")


def expected_error(weight: np.ndarray, importance: np.ndarray, scale: np.ndarray) -> float:
    """``sum_j importance_j / s_j^2 * |Q(W s)_j - (W s)_j|^2``: the expected squared output error of the reader
    quantized with the fold ``scale`` (the search weighted by the folded input's importance)."""
    folded = weight * scale
    weights = importance / scale ** 2
    back = q4_0.dequantize(q4_0.quantize(folded, "search", weights), folded.shape)
    return float((np.square(back - folded) * weights).sum(dtype=np.float64))


def choose_folds(calibration, weights) -> list[Fold]:
    """The fold of each norm calibration saw whose ``alpha`` lowers its readers' expected error."""
    folds = []
    for norm, readers in calibration.readers.items():
        form = calibration.forms.get(norm)
        if form is None or norm not in weights.entries or not all(
                r in weights.entries and r in calibration.importance and q4_0.quantizable(
                    tuple(weights.entries[r].shape)) for r in readers):
            continue
        importance = calibration.importance[readers[0]].astype(np.float64)
        if not all(np.array_equal(calibration.importance[r], calibration.importance[readers[0]]) for r in readers):
            continue  # one input, one importance: anything else is not what was measured
        samples = []
        for name in readers:
            entry = weights.entries[name]
            index = np.unique(np.linspace(0, entry.shape[0] - 1, min(entry.shape[0], SAMPLE_ROWS)).astype(int))
            samples.append(np.stack([entry.rows(i, i + 1, np.dtype(np.float32)) for i in index]))
        floor = importance[importance > 0].min() if (importance > 0).any() else 1.0
        positive = np.maximum(importance, floor)
        best, best_error = None, None
        for alpha in ALPHAS:
            scale = positive ** (alpha / 2)
            scale = (scale / np.exp(np.log(scale).mean())).astype(np.float32)
            error = sum(expected_error(w, importance.astype(np.float32), scale) for w in samples)
            if best_error is None or error < best_error:
                best, best_error = (alpha, scale), error
        if best[0] > 0:
            folds.append(Fold(norm, form, tuple(readers), best[1], best[0]))
    return folds


def folded_view(weights, folds: list[Fold]):
    """``weights`` with every fold applied (the norm's and its readers' entries wrapped in ``Folded``)."""
    entries = dict(weights.entries)
    for fold in folds:
        entries[fold.norm] = Folded(weights.entries[fold.norm], fold.scale, fold.form)
        for name in fold.readers:
            entries[name] = Folded(weights.entries[name], fold.scale, "columns")
    return replace(weights, entries=entries)


def fold_importance(calibration, folds: list[Fold]):
    """The calibration with each folded reader's importance (and second moments) those of its folded input
    (``E[y^2] / s^2``, ``E[y y^T] / (s s^T)``)."""
    importance, grams = dict(calibration.importance), dict(calibration.grams)
    for fold in folds:
        inverse = 1 / fold.scale.astype(np.float64)
        for name in fold.readers:
            importance[name] = (calibration.importance[name] * inverse ** 2).astype(np.float32)
        if fold.readers[0] in grams:
            folded = (grams[fold.readers[0]] * np.outer(inverse, inverse)).astype(np.float32)
            grams.update(dict.fromkeys(fold.readers, folded))
    return replace(calibration, importance=importance, grams=grams)


def fold(calibration, family, layout, weights, tokens: np.ndarray):
    """``(FoldReport, weights to export, calibration for the search)``: the folds chosen, verified in float on
    ``tokens`` ([1, S]) against the published model (nothing folded when they disagree beyond the float32 rule)."""
    from gdn_export.hf.checkpoint import empty_model
    from gdn_export.hf.layerwise import layerwise_logits
    from gdn_export.parity import max_abs_error, tolerance_for

    folds = choose_folds(calibration, weights)
    if not folds:
        return FoldReport(), weights, calibration
    view = folded_view(weights, folds)
    expected = layerwise_logits(empty_model(family, layout), weights, tokens)
    got = layerwise_logits(empty_model(family, layout), view, tokens)
    error, tolerance = max_abs_error(got, expected), tolerance_for(expected)
    if not error <= tolerance:
        return FoldReport(refused=f"the folded float model's logits differ by {error:.2e} > {tolerance:.2e}"), \
            weights, calibration
    return FoldReport(folds), view, fold_importance(calibration, folds)
