"""Checking an exported model against transformers' eager model: a prefill, then token-by-token decode.

float32: the max abs logit error is at most ``F32_TOLERANCE * max(1, max |logit|)``.

float16 (any reduced ``dtype``): the export is judged against the float32 reference *and* against the error
that the reference framework's own float16 model makes on the same tokens (``copy_in_dtype(hf_model,
float16)``: what f16 rounding alone does to this model). The judged quantity is the *typical* per-position
error: at each position (batch row, step) the max abs logit error over the vocabulary, and of those the
first quartile (``F16_QUANTILE``), within the prefill and within the decode positions, the worse phase judged. A discrete choice that is near-tied at some position (MoE top-k routing,
an indexer's top-k keys) flips under f16 rounding in one model and not in the other, machine by machine,
and its error carries on to later positions; an export that is wrong is wrong at every position and moves
the quartile as much as the max. Accepted when that error is at most ``F16_MULTIPLE`` times the
framework's own, plus one f16 rounding of the largest logit (``F16_ULP``); and the top-1 token agrees
with the reference's wherever its top-2 gap exceeds twice the larger of the two f16 errors at that position.
That last part follows from the errors themselves (no error below half the gap reorders the pair): a top-1
condition judged against the framework's error alone would fail on every flip that tract makes and transformers
happens not to (Qwen4-Exp's indexer did so in 4 of 16 token draws on one machine), so it is no more than that.
The report adds llama.cpp's figures (mean KL divergence of the next-token distribution, top-1 agreement over
every position) for the export and for the framework's own float16 model.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import numpy as np
import torch

from gdn_export.errors import GdnExportError
from gdn_export.run.perplexity import log_softmax

F32_TOLERANCE = 1e-4  # x max(1, max |logit|), on the max abs logit error
# float16: an export may round each value once more than the reference framework does (tract keeps pieces of a
# lowered op in the model dtype where torch computes the op in f32 and rounds once): twice the roundings, whose
# errors add in quadrature (x1.4) and at worst linearly (x2)
F16_MULTIPLE = 2.0
F16_QUANTILE = 0.25  # the typical position: the first quartile of per-position errors
F16_ULP = 2.0 ** -11  # unit roundoff of float16: one rounding of the output logits, x max(1, max |logit|)
HALF_DTYPES = {"float16": torch.float16}


@dataclass
class LogitCheck:
    max_abs_error: float  # over every position and token
    max_abs_logit: float  # of the float32 reference
    top1_agreement: float  # over decisive positions: the export picks the reference's token
    tolerance: float  # allowed value of ``error``
    need_top1: bool = False  # reduced precision: the f16 rule (top-1 on decisive positions included)
    ambiguous: int = 0  # positions whose reference top-2 gap is too close to the errors there (top-1 not compared)
    error: float = float("nan")  # the judged error: max_abs_error (float32), typical per-position error (float16)
    dtype: str = "float32"
    positions: int = 0  # batch x steps compared
    mean_kl: float = float("nan")  # mean over positions of KL(reference || export), next-token distributions, nats
    top1_all: float = float("nan")  # top-1 agreement over every position
    # the reference framework's own float16 model against the float32 reference, on the same tokens (float16 only)
    baseline_error: float = float("nan")
    baseline_max_abs_error: float = float("nan")
    baseline_mean_kl: float = float("nan")
    baseline_top1_all: float = float("nan")
    # against a second reference (a quantized export's unquantized model): figures reported, not judged
    quality: "LogitCheck | None" = None
    mtp: "LogitCheck | None" = None  # ``gdn-export check`` of an archive with an MTP head: the head's own check

    @property
    def ok(self) -> bool:
        return bool(self.error <= self.tolerance and (not self.need_top1 or self.top1_agreement == 1.0)
                    and (self.mtp is None or self.mtp.ok))

    @property
    def ratio(self) -> float:
        """The judged error over the framework's own float16 error (float16 only)."""
        return self.error / self.baseline_error if self.baseline_error > 0 else float("inf")

    def __str__(self) -> str:
        if not self.need_top1:
            return (f"max |logit error| {self.max_abs_error:.2e} (allowed {self.tolerance:.2e}, max |logit| "
                    f"{self.max_abs_logit:.2f}), mean KL {self.mean_kl:.1e}, top-1 agreement "
                    f"{100 * self.top1_all:.1f}%")
        ambiguous = f", {self.ambiguous} near-tied not compared" if self.ambiguous else ""
        return (f"typical |logit error| {self.error:.2e} (per-position max, first quartile of {self.positions}; "
                f"reference's own {self.dtype} {self.baseline_error:.2e}, ratio {self.ratio:.2f}, allowed "
                f"{self.tolerance:.2e}), max {self.max_abs_error:.2e} (own {self.dtype} "
                f"{self.baseline_max_abs_error:.2e}, max |logit| {self.max_abs_logit:.2f}), mean KL "
                f"{self.mean_kl:.1e} (own {self.baseline_mean_kl:.1e}), top-1 agreement {100 * self.top1_all:.1f}% "
                f"(own {100 * self.baseline_top1_all:.1f}%; decisive positions {100 * self.top1_agreement:.1f}%"
                f"{ambiguous})")


def sample_tokens(vocab_size: int, batch: int, length: int, seed: int = 0) -> np.ndarray:
    return torch.randint(0, vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed)).numpy()


def transformers_logits(hf_model, tokens: np.ndarray, prompt_len: int, decode_seconds: list | None = None) -> np.ndarray:
    """transformers' eager model on a prefill of prompt_len tokens, then one token at a time with its own cache;
    the decode loop's duration is appended to ``decode_seconds`` when given (for the benchmarks)."""
    ids = torch.from_numpy(tokens)
    with torch.no_grad():
        out = hf_model(input_ids=ids[:, :prompt_len], use_cache=True)
        cache = getattr(out, "cache", None) or out.past_key_values
        logits = [out.logits]
        start = time.perf_counter()
        for t in range(prompt_len, ids.shape[1]):
            out = hf_model(input_ids=ids[:, t : t + 1], cache=cache, use_cache=True)
            cache = getattr(out, "cache", None) or out.past_key_values
            logits.append(out.logits)
        if decode_seconds is not None:
            decode_seconds.append(time.perf_counter() - start)
    return torch.cat(logits, dim=1).float().numpy()


def session_logits(session, tokens: np.ndarray, prompt_len: int, decode_seconds: list | None = None) -> np.ndarray:
    """The same through a ``Session``."""
    session.reset()
    logits = [session.prefill(tokens[:, :prompt_len])]
    start = time.perf_counter()
    for t in range(prompt_len, tokens.shape[1]):
        logits.append(session.decode(tokens[:, t : t + 1]))
    if decode_seconds is not None:
        decode_seconds.append(time.perf_counter() - start)
    return np.concatenate(logits, axis=1).astype(np.float32)


def _against(logits: np.ndarray, expected: np.ndarray, log_p: np.ndarray):
    """Per-position max abs error, mean KL(reference || logits) and top-1 agreement over every position."""
    per_position = np.abs(logits - expected).max(-1).ravel()
    per_position[~np.isfinite(logits).all(-1).ravel()] = np.inf
    with np.errstate(invalid="ignore", over="ignore"):
        kl = float((np.exp(log_p) * (log_p - log_softmax(logits))).sum(-1).mean())
    top1 = float((logits.argmax(-1) == expected.argmax(-1)).mean())
    return per_position, kl, top1


def _typical(errors: np.ndarray, phases: list[slice]) -> list[float]:
    """The first quartile of per-position errors ([B, S]) within each phase (a non-finite one: inf)."""
    out = []
    for phase in phases:
        e = errors[:, phase].ravel()
        out.append(float(np.quantile(e, F16_QUANTILE)) if np.isfinite(e).all() else float("inf"))
    return out


def compare_logits(actual: np.ndarray, expected: np.ndarray, dtype: str,
                   baseline: np.ndarray | None = None, prompt_len: int | None = None,
                   allowance: float = F16_ULP) -> LogitCheck:
    """Judge ``actual`` (the export's logits, [B, S, vocab]) against ``expected`` (the float32 reference).

    float32: max abs error against ``F32_TOLERANCE * max(1, max |logit|)``. Reduced ``dtype``: ``baseline`` is
    the reference framework's own model in that dtype on the same tokens, and the rule is the module's, applied to
    the prefill positions (the first ``prompt_len``) and to the decode positions separately, the worst phase
    reported: a defect of the decode steps alone (a fraction of the positions) must not hide under the quartile.
    """
    half = dtype != "float32"
    if half and baseline is None:
        raise GdnExportError(f"a {dtype} export is judged against the reference's own {dtype} logits; none given")
    expected = expected.astype(np.float64)
    max_logit = float(np.abs(expected).max())
    scale = max(1.0, max_logit)
    if actual.shape != expected.shape or (half and baseline.shape != expected.shape):
        shapes = f"{list(actual.shape)} vs {list(expected.shape)}"
        raise GdnExportError(f"logits of different shapes cannot be compared: {shapes}")
    log_p = log_softmax(expected)
    errors, kl, top1 = _against(actual.astype(np.float64), expected, log_p)
    top2 = np.sort(expected, axis=-1)[..., -2:]
    gap = (top2[..., 1] - top2[..., 0]).ravel()
    same = (actual.argmax(-1) == expected.argmax(-1)).ravel()
    common = dict(max_abs_error=float(errors.max()), max_abs_logit=max_logit, dtype=dtype, positions=errors.size,
                  mean_kl=kl, top1_all=top1)
    if not half:
        decisive = gap > 2 * errors
        agreement = float(same[decisive].mean()) if decisive.any() else 1.0
        return LogitCheck(top1_agreement=agreement, tolerance=F32_TOLERANCE * scale, ambiguous=int((~decisive).sum()),
                          error=float(errors.max()), **common)
    own, own_kl, own_top1 = _against(baseline.astype(np.float64), expected, log_p)
    steps = expected.shape[1]
    split = prompt_len if prompt_len is not None and 0 < prompt_len < steps else steps
    phases = [slice(0, split)] + ([slice(split, steps)] if split < steps else [])
    # a non-finite logit anywhere is no rounding: it fails the check (the framework's own, the check's tolerance)
    per_phase = list(zip(_typical(errors.reshape(expected.shape[:2]), phases),
                         _typical(own.reshape(expected.shape[:2]), phases)))
    def share_of_allowance(pair: tuple[float, float]) -> float:
        error, own_error = pair
        return float("inf") if not np.isfinite(error + own_error) else error / (F16_MULTIPLE * own_error + allowance * scale)

    error, own_error = max(per_phase, key=share_of_allowance)
    # decisive: the reference's top-2 gap exceeds twice the larger f16 error at that position (the export's or
    # the framework's): no rounding of that size reorders the pair, in either model
    decisive = gap > 2 * np.maximum(errors, own)
    agreement = float(same[decisive].mean()) if decisive.any() else 1.0
    tolerance = F16_MULTIPLE * own_error + allowance * scale
    return LogitCheck(top1_agreement=agreement, tolerance=tolerance if np.isfinite(tolerance) else float("nan"),
                      need_top1=True, ambiguous=int((~decisive).sum()), error=error, baseline_error=own_error,
                      baseline_max_abs_error=float(own.max()), baseline_mean_kl=own_kl, baseline_top1_all=own_top1,
                      **common)


def _in_dtype(hf_model, dtype: torch.dtype):
    """``copy_in_dtype(hf_model, dtype)``; also for a module that torch-to-nnef has traced (an export of
    ``hf_model`` itself, e.g. a float32 one with ``core_dtype``): its tracing leaves the module's tensors wrapped in
    its own tensor subclass, which ``copy.deepcopy`` refuses, so those are copied as plain tensors first."""
    from gdn_export.hf.checkpoint import copy_in_dtype

    tensors = (*hf_model.parameters(), *hf_model.buffers())
    wrapped = [t for t in tensors if type(t) not in (torch.Tensor, torch.nn.Parameter)]
    if not wrapped:
        return copy_in_dtype(hf_model, dtype)

    def plain(tensor):
        data = tensor.as_subclass(torch.Tensor).detach().clone()
        return torch.nn.Parameter(data, tensor.requires_grad) if isinstance(tensor, torch.nn.Parameter) else data

    return copy_in_dtype(copy.deepcopy(hf_model, {id(t): plain(t) for t in wrapped}), dtype)


def validate_check(prompt_len: int, decode_steps: int, batch: int = 1) -> None:
    if prompt_len < 1 or decode_steps < 0 or batch < 1:
        raise GdnExportError(f"the check needs a prompt length >= 1, decode steps >= 0 and a batch >= 1, got "
                             f"{prompt_len}, {decode_steps} and {batch}")


def check_against_transformers(path, hf_model, prompt_len: int = 16, decode_steps: int = 8, batch: int = 1, *,
                               seed: int = 0, half_model=None) -> LogitCheck:
    """Prefill ``prompt_len`` tokens then ``decode_steps`` single-token steps of the archive at ``path`` (or an open
    ``Session``) in tract and in ``hf_model`` (transformers' eager model, or the family's eager reference), and
    compare the logits. For a reduced-precision archive (``session.metadata["dtype"]``, or a float32 one whose
    gated delta-rule core takes float16 operands, ``metadata["core_dtype"]``) the same tokens also run through the
    reference in that dtype (``half_model``, or ``copy_in_dtype(hf_model, dtype)``), and the float16 rule judges."""
    return check_archive(path, hf_model.config.vocab_size, prompt_len, decode_steps, batch, seed,
                         *transformers_references(hf_model, prompt_len, half_model))


def transformers_references(hf_model, prompt_len: int, half_model=None):
    """``(reference, half_reference)`` for ``check_archive``: ``hf_model`` prefilling ``prompt_len`` tokens then
    decoding with its cache, and the same in a reduced dtype (``half_model``, or a copy of ``hf_model``)."""

    def half_logits(dtype: torch.dtype, tokens: np.ndarray) -> np.ndarray:
        return transformers_logits(half_model if half_model is not None else _in_dtype(hf_model, dtype), tokens,
                                   prompt_len)

    return (lambda tokens: transformers_logits(hf_model, tokens, prompt_len)), half_logits


def check_archive(path, vocab_size: int, prompt_len: int, decode_steps: int, batch: int, seed: int,
                  reference, half_reference, quality_reference=None, rounding_baseline=None) -> LogitCheck:
    """The check of ``path`` (a .nnef.tgz, an .onnx, or an open ``Runner``) on random tokens against ``reference(tokens)`` (float32
    logits [B, S, vocab]) and, for a reduced-precision archive, ``half_reference(dtype, tokens)`` (the reference
    framework's own model in that dtype). ``quality_reference(tokens)``: another float32 model (a quantized export's
    unquantized one), compared with the same tract logits into the result's ``quality``, reported, not judged.
    ``rounding_baseline(tokens)``: for an int8 archive (whose graph rounds activations), the reference with its
    rounding inputs perturbed by a few float32 roundings (``gdn_export.weights.int8``); the archive is then judged
    by the float16 rule against it, with the float32 rule's allowance in place of one float16 rounding."""
    from gdn_export.run.runner import Runner, open_runner
    from gdn_export.run.runtime import alongside

    validate_check(prompt_len, decode_steps, batch)

    tokens = sample_tokens(vocab_size, batch, prompt_len + decode_steps, seed)
    # an open runner (a Session, an OnnxSession), or a file opened by its suffix (.onnx: onnxruntime); a file is
    # opened while the reference computes (tract and torch release the GIL: a large model's load and its reference
    # overlap instead of adding up; the memory both take is what ``reference_fits`` budgets)
    if isinstance(path, Runner):
        session, computed = path, reference(tokens)
    else:
        (session, _), computed = alongside(lambda: open_runner(path), lambda: reference(tokens))
    # the precision judged: the archive's dtype, or a float32 archive's reduced core (--core-dtype float16)
    dtype = session.metadata["dtype"]
    if dtype == "float32" and session.metadata.get("core_dtype") in HALF_DTYPES:
        dtype = session.metadata["core_dtype"]
    if dtype != "float32" and dtype not in HALF_DTYPES:
        raise GdnExportError(f"{session.path} has dtype {dtype!r}; the check knows float32 and float16")
    # an archive of last-position logits gives the prefill's last and each decode step's: compared at those
    first = prompt_len - 1 if session.metadata.get("logits") == "last" else 0
    judged_prefill = prompt_len - first
    expected = computed[:, first:]
    actual = session_logits(session, tokens, prompt_len)
    baseline = None
    if dtype != "float32":
        try:
            baseline = half_reference(HALF_DTYPES[dtype], tokens)[:, first:]
        except Exception as err:  # e.g. an op without a CPU float16 kernel in this torch
            raise GdnExportError(f"the reference's own {dtype} model could not run, so a {dtype} export cannot be "
                                 f"judged: {type(err).__name__}: {err}") from err
    if rounding_baseline is not None and dtype == "float32":
        result = compare_logits(actual, expected, "float32 (int8 rounding)", rounding_baseline(tokens)[:, first:],
                                judged_prefill, allowance=F32_TOLERANCE)
    else:
        result = compare_logits(actual, expected, dtype, baseline, judged_prefill)
    if quality_reference is not None:
        result.quality = compare_logits(actual, quality_reference(tokens)[:, first:], "float32")
    return result
