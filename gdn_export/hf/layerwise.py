"""The check's reference for a model that does not fit in memory: transformers' model, one layer in memory at a time.

The model is built with its parameters on meta (``checkpoint.empty_model``); the embedding, final norm and head
are read once, and each decoder layer's weights are read just before transformers runs it and released right
after (forward hooks on the layers of ``model.layers``). transformers' own ``forward`` runs unmodified, on the
whole token sequence at once (no cache: prefill and decode positions in one causal pass), so this is the same
reference as the in-memory check's, computed in bounded memory: the largest layer plus the embedding and head.
"""

from __future__ import annotations

from typing import Callable, TypeVar

import numpy as np
import torch
from torch import nn

from gdn_export.hf.checkpoint import CheckpointWeights, cast_buffers, materialize, release
from gdn_export.hf.tensors import CheckpointError

T = TypeVar("T")


def decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """``(name, layers)`` of the model's decoder layer list (``model.layers`` in transformers' decoders)."""
    for name, module in model.named_modules():
        if name.endswith("model.layers") and isinstance(module, nn.ModuleList):
            return name, module
    raise CheckpointError("no model.layers in this model: the layer-by-layer check cannot run on it")


def layerwise_logits(model: nn.Module, weights: CheckpointWeights, tokens: np.ndarray,
                     dtype: torch.dtype = torch.float32) -> np.ndarray:
    """transformers' logits [B, S, vocab] for ``tokens`` with ``model`` (parameters on meta, as ``empty_model``
    builds it) in ``dtype``, every weight read from ``weights`` when its layer runs."""
    ids = torch.from_numpy(tokens)
    return layerwise_call(model, weights, lambda m: m(input_ids=ids, use_cache=False).logits, dtype).float().numpy()


def layerwise_call(model: nn.Module, weights: CheckpointWeights, call: Callable[[nn.Module], T],
                   dtype: torch.dtype = torch.float32) -> T:
    """``call(model)`` (under no_grad) with ``model``'s parameters (on meta, as ``empty_model`` builds them) in
    ``dtype``: those outside ``model.layers`` resident, each decoder layer's read from ``weights`` just before it
    runs and released right after."""
    name, layers = decoder_layers(model)
    prefix = f"{name}."
    materialize(model, weights, dtype, exclude=prefix)  # the embedding, final norm and head: resident
    cast_buffers(model, dtype)
    hooks = []
    for index, layer in enumerate(layers):
        layer_prefix = f"{prefix}{index}."
        hooks.append(layer.register_forward_pre_hook(
            lambda module, args, p=layer_prefix: materialize(model, weights, dtype, prefix=p) and None))
        hooks.append(layer.register_forward_hook(lambda module, args, out, p=layer_prefix: release(model, p)))
    try:
        with torch.no_grad():
            return call(model)
    finally:
        for hook in hooks:
            hook.remove()
        release(model, "")
