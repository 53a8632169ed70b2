"""FLA's causal LM stack (``fla/models/*/modeling_*.py``) over the plain-torch layers, states passed explicitly.

``model.embeddings`` → blocks (pre-norm: ``attn_norm`` → mixer → residual, ``mlp_norm`` → GatedMLP → residual)
→ ``model.norm`` → ``lm_head`` (tied to the embeddings with ``tie_word_embeddings``). Every FLA model type of
this family (gated_deltanet, gated_deltaproduct, kda, delta_net) has this block; only the mixer differs. The loop
is ``gdn_export.models.decoder``'s, which every Hugging Face family runs too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from gdn_export.layers.common import GatedMLP, RMSNorm
from gdn_export.models.decoder import Decoder, vocab_projection
from gdn_export.models.state import StateSpec


@dataclass
class LMConfig:
    """What the stack needs besides its mixers; ``layer_types`` and ``vocab_size`` are read by the converter."""

    model_type: str
    vocab_size: int
    hidden_size: int
    norm_eps: float
    layer_types: list[str]  # "linear_attention" (a delta-rule mixer) or "full_attention"
    hidden_ratio: int | None = 4
    intermediate_size: int | None = None
    hidden_act: str = "swish"
    tie_word_embeddings: bool = False


class Block(nn.Module):
    """One layer's modules (FLA's names); ``FlaForCausalLM``'s decoder loop runs them."""

    def __init__(self, config: LMConfig, mixer: nn.Module) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.attn = mixer
        self.mlp_norm = RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.hidden_ratio, config.intermediate_size, config.hidden_act)

    def forward(self, step, *args):
        """``step(*args)``: the decoder loop's layer step, run inside this module's call so that the trace names
        the layer's nodes by its index (``_0__attn__...``)."""
        return step(*args)


class Backbone(nn.Module):
    def __init__(self, config: LMConfig, mixers: list[nn.Module]) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config, mixer) for mixer in mixers)
        self.norm = RMSNorm(config.hidden_size, eps=config.norm_eps)


@dataclass
class LMOutput:
    logits: torch.Tensor
    past_key_values: "StateCache"


@dataclass
class StateCache:
    """Every layer's states, flat in ``state_specs`` order (the eager counterpart of FLA's ``Cache``)."""

    states: list[torch.Tensor]


class FlaForCausalLM(Decoder, nn.Module):
    """``model.*`` + ``lm_head`` with FLA's parameter names, run by the decoder loop of ``gdn_export.models``.

    ``step(input_ids, states)`` is the export-friendly call (explicit states, one S-generic graph);
    ``forward(input_ids, past_key_values=None)`` is the eager one with a cache object, as transformers'
    models are called by ``gdn_export.hf.check``.
    """

    def __init__(self, config: LMConfig, mixers: list[nn.Module]) -> None:
        super().__init__()
        if len(mixers) != len(config.layer_types):
            raise ValueError(f"{len(mixers)} mixers for {len(config.layer_types)} layer types")
        self.config = config
        self.model = Backbone(config, mixers)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embeddings.weight

    def state_specs(self, dtype: torch.dtype) -> list[StateSpec]:
        return [spec for i, layer in enumerate(self.model.layers) for spec in layer.attn.state_specs(i, dtype)]

    def initial_states(self, batch: int) -> list[torch.Tensor]:
        return [spec.zeros(batch) for spec in self.state_specs(self.lm_head.weight.dtype)]

    def step(self, input_ids: torch.Tensor, states: list[torch.Tensor],
             past_len: torch.Tensor | None = None,
             seq_len: torch.Tensor | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """input_ids ``[B, S]`` and the flat states -> (logits ``[B, S, vocab]``, new flat states); ``past_len`` and
        ``seq_len`` ``[B]`` in a serving graph (``Decoder.decode``)."""
        return self.decode(input_ids, states, self.state_specs(self.lm_head.weight.dtype), past_len, seq_len)

    # --- the decoder's hooks ----------------------------------------------------------------------------------

    @property
    def layer_types(self) -> list[str]:
        return self.config.layer_types

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embeddings(input_ids)

    def decoder_layers(self) -> nn.ModuleList:
        return self.model.layers

    def run_layer(self, layer, step, *args):
        return layer(step, *args)

    def mixer(self, index, layer, x, states, context):
        # delta-rule and attention layers alike take (x, their states, the call's context)
        out, states = layer.attn.forward_states(x, states, context)
        return (out, *states)

    def feed_forward(self, index, layer, x):
        return layer.mlp(x)

    def norms(self, index, layer, part):
        return (layer.attn_norm if part == "mixer" else layer.mlp_norm), None

    # True (an archive that carries the checkpoint's MTP head, pipeline/mtp.py): ``head`` also returns the normed
    # state the logits come from, the main graph's last output ``hidden``, which the MTP head reads
    emits_hidden: bool = False

    def head(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        # tied: two slices of the embedding table, so that tract packs the head once (see vocab_projection); a
        # quantized export may have given the head a weight of its own (hf/weight_writers.py separate_tied_head)
        tied = self.lm_head.weight is self.model.embeddings.weight
        normed = self.model.norm(x)
        logits = vocab_projection(normed, self.lm_head, tied)
        return (logits, normed) if self.emits_hidden else logits

    def forward(self, input_ids: torch.Tensor, past_key_values: StateCache | None = None,
                cache: StateCache | None = None, use_cache: bool = True, **unused) -> LMOutput:
        past = cache if cache is not None else past_key_values
        states = past.states if past is not None else self.initial_states(input_ids.shape[0])
        logits, states = self.step(input_ids, states)
        return LMOutput(logits[0] if self.emits_hidden else logits, StateCache(states))
