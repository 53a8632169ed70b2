"""Perplexity of an exported model on a text, llama-perplexity's way, and its divergence from the checkpoint.

The text goes through the archive's tokenizer (no special tokens added) and is cut into ``len(ids) // ctx``
non-overlapping windows of ``ctx`` tokens (the tail shorter than a window is left out). Each window runs from an
empty state, and only its second half is scored, as llama.cpp's ``llama-perplexity`` does: the logits at positions
``ctx/2 .. ctx-2`` predict tokens ``ctx/2+1 .. ctx-1`` (``ctx/2 - 1`` tokens a window), so that every scored token
sees at least ``ctx/2`` tokens of context. perplexity = exp(mean negative log-likelihood over the scored tokens).

With a reference (the checkpoint in transformers, float32), the same windows give the reference's perplexity and,
at each scored position, KL(reference || export) of the next-token distributions (llama.cpp's
``--kl-divergence``: its mean and 99th percentile) and whether the two models' most likely tokens agree (top-1).

The run side: numpy, tokenizers and the model's runtime (tract, or onnxruntime for a ``.onnx``). The reference's
logits come from the convert side (``gdn_export.checkpoints.reference``, torch and transformers), which the caller passes in.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from gdn_export.errors import GdnExportError

Logits = Callable[[np.ndarray], np.ndarray]  # one window's ids [ctx] -> logits [ctx, vocab]


class PerplexityError(GdnExportError):
    """The text, the archive or the options cannot give a perplexity (too short a text, no tokenizer, ...)."""


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """log softmax over the last axis, in the input's precision (float64 for the figures here)."""
    shifted = logits - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def scored_slice(ctx: int) -> slice:
    """The positions of a window whose logits are scored: ``ctx/2 .. ctx-2`` (each predicts the next token)."""
    return slice(ctx // 2, ctx - 1)


def text_windows(ids: Iterable[int], ctx: int, chunks: int | None = None) -> np.ndarray:
    """The token ids as ``[windows, ctx]`` (the first ``chunks`` windows when given); PerplexityError when the text
    is shorter than one window."""
    if ctx < 4:
        raise PerplexityError(f"--ctx must be at least 4 tokens (half of each window is context), got {ctx}")
    ids = np.asarray(list(ids) if not isinstance(ids, np.ndarray) else ids, dtype=np.int64)
    count = ids.size // ctx
    if count == 0:
        raise PerplexityError(f"the text is {ids.size} tokens, shorter than one window of --ctx {ctx} tokens")
    if chunks is not None:
        count = min(count, chunks)
    return ids[: count * ctx].reshape(count, ctx)


@dataclass
class Perplexity:
    """The figures over ``windows`` windows of ``ctx`` tokens, ``tokens`` of them scored."""

    ppl: float
    tokens: int
    windows: int
    ctx: int
    ref_ppl: float | None = None
    kld_mean: float | None = None
    kld_p99: float | None = None
    top1: float | None = None
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        out = {"ppl": self.ppl, "tokens": self.tokens, "windows": self.windows, "ctx": self.ctx}
        if self.ref_ppl is not None:
            out.update(ref_ppl=self.ref_ppl, kld_mean=self.kld_mean, kld_p99=self.kld_p99, top1=self.top1)
        return {**out, **self.extra}

    def lines(self) -> list[str]:
        lines = [f"perplexity {self.ppl:.4f} over {self.tokens} tokens ({self.windows} windows of {self.ctx}, "
                 f"the second half of each scored)"]
        if self.ref_ppl is not None:
            lines += [f"reference perplexity {self.ref_ppl:.4f} (transformers, float32; ratio "
                      f"{self.ppl / self.ref_ppl:.5f})",
                      f"KL divergence from the reference: mean {self.kld_mean:.6g}, 99th percentile "
                      f"{self.kld_p99:.6g} nats",
                      f"top-1 agreement with the reference: {100 * self.top1:.2f}%"]
        return lines


def perplexity(logits_of: Logits, windows: np.ndarray, reference: Logits | None = None,
               progress: Callable[[int, int, float], None] | None = None) -> Perplexity:
    """The figures for ``windows`` ([n, ctx]) from ``logits_of`` (the export) and, when given, ``reference``;
    ``progress(done, total, running_ppl)`` after each window."""
    n, ctx = windows.shape
    scored = scored_slice(ctx)
    nll, ref_nll, kls, agree = 0.0, 0.0, [], 0
    count = 0
    for index, window in enumerate(windows):
        targets = window[scored.start + 1:]
        log_q = log_softmax(np.asarray(logits_of(window), dtype=np.float64)[scored])
        if not np.isfinite(log_q).all():
            raise PerplexityError(f"the model's logits are not finite in window {index}")
        picked = np.arange(targets.size)
        nll -= float(log_q[picked, targets].sum())
        if reference is not None:
            log_p = log_softmax(np.asarray(reference(window), dtype=np.float64)[scored])
            ref_nll -= float(log_p[picked, targets].sum())
            kls.append((np.exp(log_p) * (log_p - log_q)).sum(-1))
            agree += int((log_p.argmax(-1) == log_q.argmax(-1)).sum())
        count += targets.size
        if progress is not None:
            progress(index + 1, n, math.exp(nll / count))
    result = Perplexity(ppl=math.exp(nll / count), tokens=count, windows=n, ctx=ctx)
    if reference is not None:
        kl = np.concatenate(kls)
        result.ref_ppl, result.top1 = math.exp(ref_nll / count), agree / count
        result.kld_mean, result.kld_p99 = float(kl.mean()), float(np.percentile(kl, 99))
    return result


# --- the export and its tokenizer ----------------------------------------------------------------------------------

def open_export(path: str | os.PathLike, onnx_runtime: str = "onnxruntime",
                loading: Callable[[str], None] | None = None):
    """A session over an ``.nnef.tgz`` (tract) or an ``.onnx`` (onnxruntime, or tract's ONNX loader) archive that
    computes every position's logits; ``loading(message)``: told when tract loads and plans an ``.nnef.tgz``."""
    path = Path(path)
    if not path.is_file():
        raise PerplexityError(f"no file at {path} (expected a .nnef.tgz or .onnx written by gdn-export convert)")
    from gdn_export.run.runner import open_runner

    session = open_runner(path, offered={"runtime": onnx_runtime, "progress": loading})
    if session.metadata.get("logits") == "last":
        raise PerplexityError(f"{path.name} computes the last position's logits only (converted with --logits last); "
                              f"perplexity needs every position's: convert it again without --logits last")
    return session


def tokenizer_for(session, tokenizer_path: str | os.PathLike | None = None, reference_dir=None):
    """The tokenizer: ``tokenizer_path`` (a tokenizer.json, or a folder holding one) when given, else the archive's,
    else (an ``.onnx``, which carries none) the reference checkpoint's; PerplexityError when there is none."""
    if tokenizer_path is not None:
        return _tokenizer_file(tokenizer_path)
    carried = getattr(session, "tokenizer", None)  # an NNEF archive's (an OnnxSession has none)
    if carried is not None:
        return carried
    if reference_dir is not None:
        return _tokenizer_file(reference_dir)
    what = ("an .onnx file carries no tokenizer" if str(session.path).endswith(".onnx") else
            f"{session.path.name} carries no tokenizer (its checkpoint had no tokenizer.json)")
    raise PerplexityError(f"{what}: give --tokenizer TOKENIZER_JSON (or --reference CHECKPOINT_DIR)")


def _tokenizer_file(path: str | os.PathLike):
    from tokenizers import Tokenizer

    file = Path(path)
    file = file / "tokenizer.json" if file.is_dir() else file
    if not file.is_file():
        raise PerplexityError(f"no tokenizer.json at {path}")
    try:
        return Tokenizer.from_file(str(file))
    except Exception as err:  # the tokenizers library's own exception type
        raise PerplexityError(f"{file} is not a tokenizer.json the tokenizers library reads ({err})") from None


def export_logits(session) -> Logits:
    """One window through the export from an empty state: its logits [ctx, vocab]."""
    def run(window: np.ndarray) -> np.ndarray:
        session.reset()
        return np.asarray(session.prefill(window[None, :]))[0]

    return run


def read_text(path: str | os.PathLike) -> str:
    path = Path(path)
    if not path.is_file():
        raise PerplexityError(f"no text file at {path}")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise PerplexityError(f"{path} is not UTF-8 text (byte {err.start}: {err.reason})") from None


def measure(archive, text_file, ctx: int = 256, reference: Callable[[], Logits] | None = None, reference_dir=None,
            tokenizer_path=None, chunks: int | None = None, onnx_runtime: str = "onnxruntime",
            progress: Callable[[int, int, float], None] | None = None,
            loading: Callable[[str], None] | None = None) -> Perplexity:
    """``gdn-export perplexity``: the figures for ``archive`` on ``text_file``. ``reference()`` makes the reference's
    window logits (``gdn_export.checkpoints.reference.eager_window_logits``: the convert side, which the run side
    does not import), called once the inputs are checked; ``reference_dir`` is its checkpoint (a tokenizer for an
    .onnx); ``loading(message)``: told when tract loads and plans the model (before the first window)."""
    text = read_text(text_file)
    session = open_export(archive, onnx_runtime, loading)
    context = session.metadata.get("context_length")
    if context is not None and ctx > context:  # positions past it were never trained: a figure of nothing
        raise PerplexityError(f"--ctx {ctx} is longer than the model's context of {context} tokens "
                              "(gdn_export.json's context_length)")
    tokenizer = tokenizer_for(session, tokenizer_path, reference_dir)
    vocab = session.metadata.get("vocab_size")
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    if vocab is not None and ids and max(ids) >= vocab:
        raise PerplexityError(f"the tokenizer gives id {max(ids)}, outside the model's vocabulary [0, {vocab}): "
                              f"not this model's tokenizer")
    windows = text_windows(ids, ctx, chunks)
    return perplexity(export_logits(session), windows, reference() if reference is not None else None, progress)


def progress_bar(stream) -> Callable[[int, int, float], None]:
    """A one-line progress bar on ``stream`` (stderr): windows done, running perplexity."""
    def show(done: int, total: int, ppl: float) -> None:
        width = 30
        filled = width * done // total
        stream.write(f"\rperplexity [{'#' * filled}{'.' * (width - filled)}] {done}/{total} windows, ppl {ppl:.4f}")
        if done == total:
            stream.write("\n")
        stream.flush()

    return show
