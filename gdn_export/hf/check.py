"""Checking an exported model against transformers' eager model: a prefill, then token-by-token decode."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

F32_TOLERANCE = 1e-4
F16_TOLERANCE = 5e-2


@dataclass
class LogitCheck:
    max_abs_error: float
    max_abs_logit: float
    top1_agreement: float  # fraction of positions where tract and transformers pick the same token
    tolerance: float  # allowed max_abs_error: tol * max(1, max |logit|)
    need_top1: bool

    @property
    def ok(self) -> bool:
        return self.max_abs_error <= self.tolerance and (not self.need_top1 or self.top1_agreement == 1.0)

    def __str__(self) -> str:
        return (f"max |logit error| {self.max_abs_error:.2e} (allowed {self.tolerance:.2e}, max |logit| "
                f"{self.max_abs_logit:.2f}), top-1 agreement {100 * self.top1_agreement:.1f}%")


def sample_tokens(vocab_size: int, batch: int, length: int, seed: int = 0) -> np.ndarray:
    return torch.randint(0, vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed)).numpy()


def transformers_logits(hf_model, tokens: np.ndarray, prompt_len: int) -> np.ndarray:
    """transformers' eager model on a prefill of prompt_len tokens, then one token at a time with its own cache."""
    ids = torch.from_numpy(tokens)
    with torch.no_grad():
        out = hf_model(input_ids=ids[:, :prompt_len], use_cache=True)
        cache = getattr(out, "cache", None) or out.past_key_values
        logits = [out.logits]
        for t in range(prompt_len, ids.shape[1]):
            out = hf_model(input_ids=ids[:, t : t + 1], cache=cache, use_cache=True)
            cache = getattr(out, "cache", None) or out.past_key_values
            logits.append(out.logits)
    return torch.cat(logits, dim=1).float().numpy()


def session_logits(session, tokens: np.ndarray, prompt_len: int) -> np.ndarray:
    session.reset()
    logits = [session.prefill(tokens[:, :prompt_len])]
    for t in range(prompt_len, tokens.shape[1]):
        logits.append(session.decode(tokens[:, t : t + 1]))
    return np.concatenate(logits, axis=1).astype(np.float32)


def compare_logits(actual: np.ndarray, expected: np.ndarray, dtype: str) -> LogitCheck:
    half = dtype == "float16"
    max_logit = float(np.abs(expected).max())
    tolerance = (F16_TOLERANCE if half else F32_TOLERANCE) * max(1.0, max_logit)
    error = float(np.abs(actual.astype(np.float64) - expected).max()) if actual.shape == expected.shape else np.inf
    agreement = float((actual.argmax(-1) == expected.argmax(-1)).mean()) if actual.shape == expected.shape else 0.0
    return LogitCheck(error, max_logit, agreement, tolerance, need_top1=half)
