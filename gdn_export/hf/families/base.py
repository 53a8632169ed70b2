"""What every Hugging Face family provides: its transformers classes and an exportable decoder over them.

A new family is one module defining ``FAMILY`` (listed in ``FAMILY_MODULES``): a ``Family`` naming its
transformers classes, and a ``TransformersLM`` subclass that writes its mixers (``delta_mixer`` returning
``(out, conv, state)``, ``attention`` returning ``(out, key, value)``), its states where they differ from the
defaults (``delta_states``, ``attention_states``), and any other hook of ``gdn_export.models.decoder`` that
differs (norm placement, residual, rotary tables, feed-forward, head).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch
from torch import nn

from gdn_export.hf.blocks import ExpertStacks, rope_tables, stacks_by_layer
from gdn_export.hf.checkpoint import CheckpointError
from gdn_export.models.decoder import Decoder, vocab_projection
from gdn_export.models.state import StateSpec, attention_states, delta_states

if TYPE_CHECKING:
    from transformers import PreTrainedConfig


class ExportableLM(nn.Module):
    """``forward(input_ids [B, S], *states) -> (logits [B, S, vocab], *new_states)`` over a transformers model.

    Subclasses implement ``forward`` (``TransformersLM``: the shared decoder loop); ``states`` lists the StateSpecs
    in graph order.
    """

    states: Sequence[StateSpec]

    def __init__(self, hf_model: nn.Module) -> None:
        super().__init__()
        self.hf = hf_model

    def initial_states(self, batch: int) -> list[torch.Tensor]:
        return [spec.zeros(batch) for spec in self.states]


class TransformersLM(Decoder, ExportableLM):
    """The decoder loop (``gdn_export.models.decoder``) over a transformers ``*ForCausalLM``.

    Defaults follow the submodule names transformers' hybrids share: ``model.embed_tokens``, ``model.layers``
    with ``input_layernorm`` before the mixer and ``post_attention_layernorm`` before ``mlp`` (pre-norm),
    ``model.norm`` then ``lm_head``; ``config.layer_types`` says which layers are linear attention. A family
    supplies its mixers (``delta_mixer``, ``attention``) and the states they carry (``delta_states``,
    ``attention_states``), and overrides any other hook that differs.
    """

    def __init__(self, hf_model: nn.Module, dtype: torch.dtype) -> None:
        super().__init__(hf_model)
        self.config = hf_model.config
        self.layer_types = self.config.layer_types
        # tie_word_embeddings: lm_head's weight is the embedding table itself (see lm_head)
        self.tied_head = self.hf.lm_head.weight is self.hf.model.embed_tokens.weight
        # each routed MoE's expert stacks as moe_ffn takes them (derived from the checkpoint's, hf.blocks)
        self.expert_stacks = stacks_by_layer(self.decoder_layers(), self.moe_gate)
        self.states = []
        for i, layer in enumerate(self.decoder_layers()):
            if self.layer_types[i] == "linear_attention":
                self.states += self.delta_states(i, layer, dtype)
            else:
                self.states += self.attention_states(i, layer, dtype)

    def delta_states(self, index: int, layer: nn.Module, dtype: torch.dtype) -> list[StateSpec]:
        """A GDN layer's ``conv_<i>`` over ``[q|k|v]`` and ``state_<i>``, sized by the config's ``linear_*`` fields."""
        config = self.config
        key_dim = config.linear_num_key_heads * config.linear_key_head_dim
        channels = 2 * key_dim + config.linear_num_value_heads * config.linear_value_head_dim
        return delta_states(index, channels, config.linear_conv_kernel_dim, config.linear_num_value_heads,
                            config.linear_key_head_dim, config.linear_value_head_dim, dtype)

    def attention_states(self, index: int, layer: nn.Module, dtype: torch.dtype) -> list[StateSpec]:
        """``key_<i>``, ``value_<i>`` with the attention module's key/value heads and head width."""
        # the config may carry no head_dim: the attention module derives it
        return attention_states(index, self.config.num_key_value_heads, layer.self_attn.head_dim, dtype)

    # True (an archive that carries the checkpoint's MTP head, pipeline/mtp.py): the graph's last output is
    # ``hidden`` ``[B, S, H]``, every new position's state after the final norm, which the MTP head reads
    emits_hidden: bool = False

    def forward(self, input_ids: torch.Tensor, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        past_len, seq_len, states = self.split_inputs(inputs, self.states)
        out, new_states = self.decode(input_ids, states, self.states, past_len, seq_len)
        if self.emits_hidden:
            logits, hidden = out
            return (logits, *new_states, hidden)
        return (out, *new_states)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.hf.model.embed_tokens(input_ids)

    def decoder_layers(self) -> Sequence[nn.Module]:
        return self.hf.model.layers

    def rotary_tables(self, x: torch.Tensor, positions: torch.Tensor):
        """cos/sin of ``model.rotary_emb`` in the model dtype, for every attention layer."""
        return rope_tables(self.hf.model.rotary_emb, positions, x.dtype)

    def feed_forward(self, index: int, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return layer.mlp(x)

    def moe_gate(self, index: int, layer: nn.Module) -> str | None:
        """The ``moe_ffn`` gate (``gdn_export/ops/moe_ffn/op.py``) of layer ``index``'s routed experts; None where its
        feed-forward is no routed MoE (the default)."""
        return None

    def stacks(self, index: int) -> ExpertStacks | None:
        """Layer ``index``'s ``ExpertStacks`` (None: no routed MoE, or experts ``moe_ffn`` does not compute)."""
        return self.expert_stacks[str(index)] if str(index) in self.expert_stacks else None

    def norms(self, index: int, layer: nn.Module, part: str):
        return (layer.input_layernorm if part == "mixer" else layer.post_attention_layernorm), None

    def head(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits; with ``emits_hidden``, (logits, the normed state they were computed from)."""
        normed = self.hf.model.norm(x)
        return (self.lm_head(normed), normed) if self.emits_hidden else self.lm_head(normed)

    def lm_head(self, x: torch.Tensor) -> torch.Tensor:
        """``hf.lm_head(x)``, through ``vocab_projection``: a head tied to ``model.embed_tokens`` reads the table
        as two slices, so that tract packs it once."""
        return vocab_projection(x, self.hf.lm_head, self.tied_head)


def require_silu_conv(config: PreTrainedConfig) -> None:
    """transformers runs the GDN short conv with ``hidden_act``; the exported conv op always applies SiLU."""
    if config.hidden_act != "silu":
        raise CheckpointError(f"hidden_act {config.hidden_act!r}: the gated delta net conv is exported with SiLU only")


@dataclass(frozen=True)
class Family:
    """A family of checkpoints: the model_types it accepts and how to export them.

    ``config_class``/``model_class`` name transformers classes, resolved lazily (transformers is imported
    only when a checkpoint is loaded); ``lm_class`` builds the exportable decoder over the loaded model.
    """

    name: str
    model_types: tuple[str, ...]
    lm_class: type[ExportableLM]
    config_class: str = ""
    model_class: str = ""
    reference: str = "transformers"  # what the conversion check compares with

    def classes(self):
        try:
            import transformers
        except ImportError:
            raise CheckpointError(f"converting {self.name} checkpoints needs transformers 5.24: "
                                  "pip install 'gdn_export[convert]'") from None

        return getattr(transformers, self.config_class), getattr(transformers, self.model_class)

    def build(self, config: dict) -> nn.Module:
        """The model config.json's fields describe, freshly initialized (built under ``parameters_on_meta``)."""
        config_class, model_class = self.classes()
        fields = {k: v for k, v in config.items() if k not in ("auto_map",)}
        try:
            return model_class(config_class(**fields))
        except (TypeError, ValueError) as err:
            raise CheckpointError(f"config.json does not describe a {self.name} model: {err}") from None

    def ignored_on_load(self) -> tuple[str, ...]:
        """Regexes of checkpoint tensors transformers ignores when it loads this model (e.g. ``^mtp.*``)."""
        return tuple(getattr(self.classes()[1], "_keys_to_ignore_on_load_unexpected", None) or ())

    def exportable(self, hf_model: nn.Module, state_dtype: torch.dtype) -> ExportableLM:
        return self.lm_class(hf_model, state_dtype)
