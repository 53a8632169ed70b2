"""Checking an exported model against transformers' eager model: a prefill, then token-by-token decode."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from gdn_export.errors import GdnExportError

F32_TOLERANCE = 1e-4
F16_TOLERANCE = 5e-2


@dataclass
class LogitCheck:
    max_abs_error: float
    max_abs_logit: float
    top1_agreement: float  # over decisive positions: tract and transformers pick the same token
    tolerance: float  # allowed max_abs_error: tol * max(1, max |logit|)
    need_top1: bool
    ambiguous: int = 0  # positions whose reference top-2 gap is within 2x the error (top-1 not compared)

    @property
    def ok(self) -> bool:
        return self.max_abs_error <= self.tolerance and (not self.need_top1 or self.top1_agreement == 1.0)

    def __str__(self) -> str:
        ambiguous = f" ({self.ambiguous} near-tied positions not compared)" if self.ambiguous else ""
        return (f"max |logit error| {self.max_abs_error:.2e} (allowed {self.tolerance:.2e}, max |logit| "
                f"{self.max_abs_logit:.2f}), top-1 agreement {100 * self.top1_agreement:.1f}%{ambiguous}")


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


def compare_logits(actual: np.ndarray, expected: np.ndarray, dtype: str) -> LogitCheck:
    """Max abs error against ``tol * max(1, max |logit|)``; for float16 also top-1 agreement.

    Top-1 is compared where the reference's top-2 gap exceeds twice the measured max error: a pair of
    logits closer than that can swap under an error this check accepts (transformers' own float16 model
    flips such near-ties too); any other swap is a real disagreement.
    """
    half = dtype == "float16"
    max_logit = float(np.abs(expected).max())
    tolerance = (F16_TOLERANCE if half else F32_TOLERANCE) * max(1.0, max_logit)
    if actual.shape != expected.shape:
        return LogitCheck(np.inf, max_logit, 0.0, tolerance, need_top1=half)
    error = float(np.abs(actual.astype(np.float64) - expected).max())
    top2 = np.sort(expected, axis=-1)[..., -2:]
    decisive = (top2[..., 1] - top2[..., 0]) > 2 * error
    same = actual.argmax(-1) == expected.argmax(-1)
    agreement = float(same[decisive].mean()) if decisive.any() else 1.0
    return LogitCheck(error, max_logit, agreement, tolerance, need_top1=half, ambiguous=int((~decisive).sum()))


def check_against_transformers(path, hf_model, prompt_len: int = 16, decode_steps: int = 8,
                               batch: int = 1) -> LogitCheck:
    """Prefill ``prompt_len`` tokens then ``decode_steps`` single-token steps of the archive at ``path`` in tract and
    in ``hf_model`` (transformers' eager model, or the family's eager reference); compare the logits."""
    from gdn_export.session import Session

    session = Session(path)
    if prompt_len < 1 or decode_steps < 0:
        raise GdnExportError(f"prompt length must be >= 1 and decode steps >= 0, got {prompt_len} and {decode_steps}")
    tokens = sample_tokens(hf_model.config.vocab_size, batch, prompt_len + decode_steps)
    expected = transformers_logits(hf_model, tokens, prompt_len)
    actual = session_logits(session, tokens, prompt_len)
    return compare_logits(actual, expected, session.metadata["dtype"])
