"""The states an exported graph carries between calls: graph input ``in_<name>``, output ``out_<name>``."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StateSpec:
    """One state tensor carried between calls: graph input ``in_<name>``, output ``out_<name>``.

    shape entries are ints or the symbols "B" (batch) and "P" (past length, attention caches only); the
    output of a cache has P+S along that axis.
    """

    name: str
    shape: tuple
    dtype: torch.dtype
    layer: int
    kind: str  # "conv", "recurrent", "key", "value", "indexer_key"

    def zeros(self, batch: int, dtype_override: torch.dtype | None = None) -> torch.Tensor:
        shape = [batch if d == "B" else 0 if d == "P" else d for d in self.shape]
        return torch.zeros(shape, dtype=dtype_override or self.dtype)

    @property
    def dynamic_axes(self) -> dict[int, str]:
        return {i: d for i, d in enumerate(self.shape) if isinstance(d, str)}


def conv_state(name: str, layer: int, channels: int, width: int, dtype: torch.dtype) -> StateSpec:
    """A short conv's cache ``[B, C, W]`` (the last W inputs, oldest first), in the model dtype."""
    return StateSpec(name, ("B", channels, width), dtype, layer, "conv")


def recurrent_state(layer: int, heads: int, width_k: int, width_v: int) -> StateSpec:
    """``state_<layer>``: a delta-rule layer's ``[B, H, K, V]`` state, float32 whatever the model dtype."""
    return StateSpec(f"state_{layer}", ("B", heads, width_k, width_v), torch.float32, layer, "recurrent")


def delta_states(layer: int, conv_channels: int, conv_width: int, heads: int, width_k: int, width_v: int,
                 dtype: torch.dtype) -> list[StateSpec]:
    """``conv_<layer>`` (one conv over ``[q|k|v]``) then ``state_<layer>``: a Hugging Face delta-rule layer."""
    return [conv_state(f"conv_{layer}", layer, conv_channels, conv_width, dtype),
            recurrent_state(layer, heads, width_k, width_v)]


def attention_states(layer: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                     value_dim: int | None = None) -> list[StateSpec]:
    """``key_<layer>``, ``value_<layer>``: an attention layer's caches ``[B, Hkv, P, D]``."""
    return [
        StateSpec(f"key_{layer}", ("B", kv_heads, "P", head_dim), dtype, layer, "key"),
        StateSpec(f"value_{layer}", ("B", kv_heads, "P", value_dim or head_dim), dtype, layer, "value"),
    ]
