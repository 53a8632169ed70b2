"""What every FLA delta-rule layer shares: q/k/v projections with three short convs, output norm and projection.

A layer's ``forward(x, conv_states, recurrent_state)`` serves prefill (any S) and decode (S = 1) alike:
``conv_states`` is the tuple ``(q, k, v)`` of ``[B, C, W]`` conv caches (``()`` without short convs, FLA's
``conv_state`` tuple), ``recurrent_state`` is ``[B, Hv, K, V]`` float32. FLA's own GatedDeltaNet and KDA
layers keep the state as ``[B, Hv, V, K]`` (``state_v_first``); transpose the last two axes to move one over.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from gdn_export.layers.common import FusedRMSNormGated, RMSNorm, ShortConvolution, split_heads
from gdn_export.models.row_lengths import RowLengths
from gdn_export.models.state import StateSpec, conv_state, recurrent_state

ConvStates = tuple[torch.Tensor, ...]
# (out [B, S, D], new conv states, new recurrent state [B, Hv, K, V] f32): every delta layer's forward
LayerOutput = tuple[torch.Tensor, ConvStates, torch.Tensor]


def check_head_sizes(head_dim: int, expand_v: float, num_heads: int, num_v_heads: int) -> int:
    """FLA's constructor checks, as ValueError; returns the value head width ``int(head_dim · expand_v)``."""
    head_v_dim = int(head_dim * expand_v)
    if not math.isclose(head_dim * expand_v, head_v_dim, rel_tol=1e-5):
        raise ValueError(f"expand_v={expand_v} does not produce an integer value when multiplied by "
                         f"head_dim={head_dim}")
    if num_v_heads < num_heads or num_v_heads % num_heads != 0:
        raise ValueError(f"num_v_heads={num_v_heads} must be a multiple of num_heads={num_heads}")
    return head_v_dim


class DeltaLayer(nn.Module):
    """Base of the FLA delta-rule layers; subclasses call ``_init_io`` and implement ``forward``."""

    use_short_conv: bool
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int

    def _init_heads(self, num_heads: int, num_v_heads: int | None, head_dim: int, expand_v: float,
                    allow_neg_eigval: bool, layer_idx: int | None) -> tuple[int, int]:
        """Head counts and widths as FLA's layers set them; returns (key_dim, value_dim) across heads."""
        self.num_heads, self.num_v_heads = num_heads, num_v_heads or num_heads
        self.head_k_dim, self.allow_neg_eigval, self.layer_idx = head_dim, allow_neg_eigval, layer_idx
        self.head_v_dim = check_head_sizes(head_dim, expand_v, num_heads, self.num_v_heads)
        return num_heads * head_dim, self.num_v_heads * self.head_v_dim

    def _init_io(self, hidden_size: int, q_dim: int, k_dim: int, v_dim: int, *, use_short_conv: bool, conv_size: int,
                 conv_bias: bool, output_gate: str | None, norm_eps: float, value_dim: int) -> None:
        """Projections, short convs (``q_conv1d`` ...), and ``o_norm`` / ``g_proj`` / ``o_proj``.

        output_gate: None (plain f32 RMSNorm), "linear" (``g_proj`` one Linear, swish gate) or "lowrank"
        (``g_proj`` = Linear(D, V_head) then Linear(V_head, Hv·V, bias=True), sigmoid gate: KDA, GDN-2).
        """
        self.hidden_size, self.use_short_conv, self.conv_size = hidden_size, use_short_conv, conv_size
        self.q_proj = nn.Linear(hidden_size, q_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, k_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, v_dim, bias=False)
        if use_short_conv:
            self.q_conv1d = ShortConvolution(q_dim, conv_size, bias=conv_bias)
            self.k_conv1d = ShortConvolution(k_dim, conv_size, bias=conv_bias)
            self.v_conv1d = ShortConvolution(v_dim, conv_size, bias=conv_bias)
        self.output_gate = output_gate
        if output_gate == "linear":
            self.g_proj = nn.Linear(hidden_size, value_dim, bias=False)
            self.o_norm = FusedRMSNormGated(self.head_v_dim, eps=norm_eps)
        elif output_gate == "lowrank":
            self.g_proj = nn.Sequential(nn.Linear(hidden_size, self.head_v_dim, bias=False),
                                        nn.Linear(self.head_v_dim, value_dim, bias=True))
            self.o_norm = FusedRMSNormGated(self.head_v_dim, activation="sigmoid", eps=norm_eps)
        else:
            self.o_norm = RMSNorm(self.head_v_dim, eps=norm_eps)
        self.o_proj = nn.Linear(value_dim, hidden_size, bias=False)

    def project_qkv(self, x: torch.Tensor, conv_states: ConvStates,
                    rows: RowLengths | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, ConvStates]:
        """(q, k, v) after the short convs + SiLU (or SiLU alone without convs), and the new conv states (with
        ``rows``, a serving graph's, each row's taken at its own last real token)."""
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if not self.use_short_conv:
            return F.silu(q), F.silu(k), F.silu(v), ()
        if len(conv_states) != 3:
            raise ValueError(f"expected 3 conv states (q, k, v), got {len(conv_states)}")
        q, conv_q = self.q_conv1d(q, conv_states[0], rows)
        k, conv_k = self.k_conv1d(k, conv_states[1], rows)
        v, conv_v = self.v_conv1d(v, conv_states[2], rows)
        return q, k, v, (conv_q, conv_k, conv_v)

    def project_out(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """o ``[B, S, Hv, V]`` through the (gated) RMSNorm and ``o_proj``."""
        if self.output_gate is None:
            o = self.o_norm(o)
        else:
            o = self.o_norm(o, split_heads(self.g_proj(x), self.head_v_dim))
        return self.o_proj(o.flatten(-2))

    # --- states -----------------------------------------------------------------------------------------------

    def conv_channels(self) -> tuple[int, ...]:
        """Channels of the (q, k, v) conv caches; () without short convs."""
        if not self.use_short_conv:
            return ()
        return tuple(conv.hidden_size for conv in (self.q_conv1d, self.k_conv1d, self.v_conv1d))

    def state_specs(self, layer: int, dtype: torch.dtype) -> list[StateSpec]:
        """``conv_q_<i>``, ``conv_k_<i>``, ``conv_v_<i>`` (model dtype) then ``state_<i>`` (f32), graph order."""
        specs = [conv_state(f"conv_{part}_{layer}", layer, channels, self.conv_size, dtype)
                 for part, channels in zip("qkv", self.conv_channels())]
        return [*specs, recurrent_state(layer, self.num_v_heads, self.head_k_dim, self.head_v_dim)]

    def initial_states(self, batch: int, dtype: torch.dtype = torch.float32) -> tuple[ConvStates, torch.Tensor]:
        """Zero ``(conv_states, recurrent_state)`` for a fresh sequence."""
        *conv, state = [spec.zeros(batch) for spec in self.state_specs(0, dtype)]
        return tuple(conv), state

    def forward_states(self, x: torch.Tensor, states: list[torch.Tensor],
                       context=None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The block-level call: states flat in ``state_specs`` order; returns (out, new states). ``context`` (the
        decoder's ``Context``: positions, masks) gives a delta-rule layer a serving graph's ``rows``."""
        out, conv, state = self(x, tuple(states[:-1]), states[-1], None if context is None else context.rows)
        return out, [*conv, state]

