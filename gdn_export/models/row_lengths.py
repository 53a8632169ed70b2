"""Per-row new-token counts in a serving graph: ``seq_len [B]``, row b's first ``seq_len[b]`` of the call's S tokens
are real, the rest padding (docs/SERVING.md).

A padding token must leave every state as the row's last real token left it, exactly:

- in a delta-rule layer it is an *identity step* of the recurrence (docs/MATH.md): decay ``g = 0`` and both gates
  ``beta`` (or ``erase`` and ``write``) ``= 0``, so ``S <- Diag(exp 0) S + k (0 - S^T 0)^T = S`` in every lowering
  (the chunked form's WY rows of such a step are zero, its cumulative decay stops moving);
- the short conv's new state is the last L inputs up to the row's own last real token, gathered out of
  ``state ++ x`` (copies: exact);
- a cache keeps only the first ``seq_len[b]`` new positions (the host writes those; later queries never see the
  rest), and the last-position logits are those of position ``seq_len[b] - 1``, gathered the same way.

Real positions before a padding one never see it (every layer is causal), so their outputs are those of the row
run alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gdn_export.models.blocks import indices_along


@dataclass
class RowLengths:
    """A serving call's ``seq_len [B]`` (int64, each in 1..S) and ``real [B, S]``: position i of row b is real."""

    seq_len: torch.Tensor
    real: torch.Tensor

    @classmethod
    def of(cls, seq_len: torch.Tensor, input_ids: torch.Tensor) -> RowLengths:
        return cls(seq_len, indices_along(input_ids[0])[None] < seq_len[:, None])

    def identity_steps(self, *gates: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        """Each gate ``[B, S, ...]`` (a decay or a delta gate; None passes) with its padding positions set to 0: there
        the recurrence's step is the identity."""
        return tuple(None if gate is None else
                     torch.where(self.real[(...,) + (None,) * (gate.dim() - 2)], gate, torch.zeros((), dtype=gate.dtype))
                     for gate in gates)

    def conv_state(self, state: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The short conv's new state ``[B, C, L]``: the L inputs of ``state ++ x`` (``x`` ``[B, C, S]``, the conv's
        own input) that end at each row's last real token."""
        window = torch.cat([state, x.to(state.dtype)], dim=2)  # [B, C, L+S]
        width = state.shape[2]
        start = self.seq_len[:, None, None] + torch.arange(width)  # [B, 1, L]: row b's window starts at seq_len[b]
        return window.gather(2, start + torch.zeros_like(state, dtype=torch.int64))  # indices [B, C, L]

    def last(self, x: torch.Tensor) -> torch.Tensor:
        """``x [B, S, D]`` at each row's last real position: ``[B, 1, D]``."""
        index = (self.seq_len - 1)[:, None, None] + torch.zeros_like(x[:, :1], dtype=torch.int64)  # [B, 1, D]
        return x.gather(1, index)
