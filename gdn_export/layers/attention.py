"""FLA's softmax ``Attention`` layer (``fla/layers/attn.py``) of hybrid models, with an explicit KV cache."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from gdn_export.layers.common import RMSNorm, split_heads
from gdn_export.models import blocks
from gdn_export.models.blocks import rotate_half  # noqa: F401  (the layers' name for it)
from gdn_export.models.state import StateSpec, attention_states

if TYPE_CHECKING:
    from gdn_export.models.decoder import Context


class Attention(nn.Module):
    """Causal GQA softmax attention with NeoX-style rotary (FLA's ``RotaryEmbedding``, not interleaved).

    ``head_dim = hidden_size // num_heads``; q/k/v projections take ``qkv_bias``, ``o_proj`` has none;
    optional ``window_size`` (a query sees the last ``window_size`` keys, itself included). The cache is
    ``[B, Hkv, P, D]`` per key and value and keeps every past token; out-of-window keys are masked, which
    gives the same softmax as FLA's cache that drops them.
    """

    def __init__(self, hidden_size: int = 2048, num_heads: int = 32, num_kv_heads: int | None = None,
                 qkv_bias: bool = False, qk_norm: bool = False, window_size: int | None = None,
                 rope_theta: float | None = 10000.0, max_position_embeddings: int | None = None,
                 layer_idx: int | None = None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads or num_heads
        if num_heads % self.num_kv_heads or hidden_size % num_heads:
            raise ValueError(f"num_heads={num_heads} must divide hidden_size={hidden_size} and be a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")
        self.head_dim = hidden_size // num_heads
        self.window_size, self.rope_theta, self.qk_norm, self.layer_idx = window_size, rope_theta, qk_norm, layer_idx
        kv_dim = self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(hidden_size, hidden_size, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden_size, kv_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden_size, kv_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        if qk_norm:
            self.q_norm, self.k_norm = RMSNorm(self.head_dim), RMSNorm(self.head_dim)

    def inv_freq(self) -> torch.Tensor:
        # computed, not a buffer: a float16 copy of the model must not round the frequencies
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim
        return 1.0 / (float(self.rope_theta) ** exponents)

    def heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v ``[B, S, heads, d]`` before rotary (q and k normalized when ``qk_norm``)."""
        q = split_heads(self.q_proj(x), self.head_dim)
        k = split_heads(self.k_proj(x), self.head_dim)
        v = split_heads(self.v_proj(x), self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def forward(self, x: torch.Tensor, past_key: torch.Tensor, past_value: torch.Tensor,
                context: Context) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x ``[B, S, D]``, caches ``[B, Hkv, P, d]``, the decoder's ``context`` (positions ``[1, S]``, or ``[B, S]`` in
        a serving graph, and the mask) -> (out, key cache, value cache)."""
        q, k, v = self.heads(x)
        cos, sin = blocks.rope_cos_sin(self.inv_freq(), context.positions, 1.0, x.dtype)
        cos, sin = cos[:, :, None], sin[:, :, None]  # [1 or B, S, 1, d] against [B, S, H, d]
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        out, key, value = blocks.cached_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                  past_key, past_value, context.mask, self.head_dim ** -0.5,
                                                  self.window_size)
        return self.o_proj(out), key, value

    def state_specs(self, layer: int, dtype: torch.dtype) -> list[StateSpec]:
        return attention_states(layer, self.num_kv_heads, self.head_dim, dtype)

    def forward_states(self, x: torch.Tensor, states: list[torch.Tensor],
                       context: Context | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        out, key, value = self(x, states[0], states[1], context)
        return out, [key, value]
