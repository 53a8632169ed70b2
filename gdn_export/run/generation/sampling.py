"""Choosing the next token from a row of logits: greedy, temperature, top-k, top-p, seeded; and logprobs.

The rules are transformers' and vLLM's:

- ``temperature == 0`` is greedy (argmax; the lowest index among exact ties, as ``numpy.argmax`` and torch pick);
- otherwise the logits are divided by the temperature, then ``top_k`` keeps the k largest (every logit equal to the
  k-th is kept, as transformers' ``TopKLogitsWarper`` keeps it), then ``top_p`` keeps the smallest set of tokens,
  most probable first, whose probability (renormalized after top-k) reaches ``p`` (at least one token), and the
  token is drawn from what is left, renormalized, with the request's ``numpy.random.Generator``
  (``seed``: the same seed and logits give the same tokens; None: fresh entropy);
- logprobs are of the model's distribution, the log-softmax of the raw logits (before temperature, top-k and
  top-p), as vLLM returns them by default: the chosen token's and the ``logprobs`` most probable alternatives'.
"""

from __future__ import annotations

import math

from dataclasses import dataclass

import numpy as np

MAX_LOGPROBS = 20  # vLLM's default --max-logprobs


class SamplingError(ValueError):
    """A sampling parameter out of its range (the message names it)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens. ``top_k`` 0 or None and ``top_p`` 1.0 or None disable those filters;
    ``logprobs`` None returns no logprobs, N >= 0 the chosen token's and the N most probable alternatives'."""

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    logprobs: int | None = None

    def __post_init__(self) -> None:
        def number(name, value, integer=False):
            if isinstance(value, bool) or not isinstance(value, (int, float) if not integer else int):
                raise SamplingError(f"{name} must be {'an integer' if integer else 'a number'}, got {value!r}", name)
            if not integer:  # a JSON integer may be of any size: float() of 10**400 overflows, numpy refuses 10**308
                try:
                    finite = math.isfinite(float(value))
                except OverflowError:
                    finite = False
                if not finite:
                    raise SamplingError(f"{name} must be a finite number, got {str(value)[:40]}", name)

        number("temperature", self.temperature)
        if self.temperature < 0:
            raise SamplingError(f"temperature must be >= 0, got {self.temperature}", "temperature")
        if self.top_k is not None:
            number("top_k", self.top_k, integer=True)
            if self.top_k < -1:  # -1 is vLLM's "no top-k"
                raise SamplingError(f"top_k must be >= 0 (0 or -1: no top-k), got {self.top_k}", "top_k")
        if self.top_p is not None:
            number("top_p", self.top_p)
            if not 0 < self.top_p <= 1:
                raise SamplingError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if self.seed is not None:
            number("seed", self.seed, integer=True)
            if self.seed < 0:
                raise SamplingError(f"seed must be >= 0, got {self.seed}", "seed")
        if self.logprobs is not None:
            number("logprobs", self.logprobs, integer=True)
            if not 0 <= self.logprobs <= MAX_LOGPROBS:
                raise SamplingError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}", "logprobs")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class Choice:
    """One picked token: its id, and where asked its logprob and the top alternatives ``[(id, logprob), ...]``."""

    token_id: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] | None = None


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = np.asarray(logits, dtype=np.float64)
    shifted = x - x.max()
    return shifted - np.log(np.exp(shifted).sum())


def filtered_probabilities(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The distribution a sampled token is drawn from (float64, sums to 1): temperature, then top-k, then top-p."""
    x = np.asarray(logits, dtype=np.float64) / params.temperature
    keep = np.ones(x.shape, dtype=bool)
    if params.top_k and 0 < params.top_k < x.size:
        kth = np.partition(x, x.size - params.top_k)[x.size - params.top_k]
        keep &= x >= kth
    probs = np.where(keep, np.exp(x - x[keep].max()), 0.0)
    probs /= probs.sum()
    if params.top_p is not None and params.top_p < 1:
        order = np.argsort(-probs, kind="stable")
        before = np.cumsum(probs[order]) - probs[order]  # the mass of the more probable tokens
        dropped = order[before >= params.top_p]  # the smallest set reaching p is what comes before the first of these
        probs[dropped] = 0.0
        probs /= probs.sum()
    return probs


class Sampler:
    """Picks tokens for one request, from its own random generator (never shared between requests)."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.rng = np.random.default_rng(params.seed)

    def __call__(self, logits: np.ndarray) -> Choice:
        row = np.asarray(logits).reshape(-1)
        if self.params.greedy or self.params.top_k == 1:
            token = int(np.argmax(row))
        else:
            token = self._draw(filtered_probabilities(row, self.params))
        return self._choice(row, token)

    def verify(self, logits: np.ndarray, draft: int, draft_probabilities: np.ndarray | None = None) -> Choice:
        """The token at a drafted position, from that position's logits: ``draft`` itself when accepted, another
        token otherwise, distributed exactly as ``self(logits)`` would draw it (speculative sampling, Leviathan et
        al. 2023 and Chen et al. 2023). Greedy: the argmax (the draft is accepted when it is the argmax). Sampled, p
        the filtered distribution: a draft proposed with certainty (prompt lookup; ``draft_probabilities`` None) is
        accepted with probability p(draft), else a token is drawn from p without the draft, renormalized; a draft
        drawn from a distribution q (a draft model) is accepted with probability min(1, p(draft) / q(draft)), else
        drawn from max(0, p - q), renormalized."""
        row = np.asarray(logits).reshape(-1)
        if self.params.greedy or self.params.top_k == 1:
            return self._choice(row, int(np.argmax(row)))
        probs = filtered_probabilities(row, self.params)
        if draft_probabilities is None:
            q = np.zeros_like(probs)
            q[draft] = 1.0
        else:
            q = np.asarray(draft_probabilities, np.float64)
        if self.rng.random() * q[draft] < probs[draft]:  # u < p / q, without dividing by a q of 0
            return self._choice(row, draft)
        residual = np.maximum(probs - q, 0.0)
        if residual.sum() <= 0:  # p <= q everywhere means p == q: the draft was accepted with probability 1
            return self._choice(row, draft)
        return self._choice(row, self._draw(residual))

    def _draw(self, probs: np.ndarray) -> int:
        cumulative = np.cumsum(probs)
        # token i owns [cumulative[i-1], cumulative[i]): a removed token's slot is empty, never drawn
        return int(np.searchsorted(cumulative, self.rng.random() * cumulative[-1], side="right"))

    def _choice(self, row: np.ndarray, token: int) -> Choice:
        if self.params.logprobs is None:
            return Choice(token)
        logp = log_softmax(row)
        top = ()
        if self.params.logprobs:
            best = np.argsort(-logp, kind="stable")[:self.params.logprobs]
            top = tuple((int(i), float(logp[i])) for i in best)
        return Choice(token, float(logp[token]), top)
