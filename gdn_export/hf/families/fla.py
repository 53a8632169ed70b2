"""flash-linear-attention checkpoints (model_type ``gated_deltanet``, ``gated_deltaproduct``, ``kda``, ``delta_net``).

transformers has no classes for these: the model is built from config.json with ``gdn_export.layers`` (FLA's
parameter names, plain torch) and the safetensors are loaded into it strictly. Missing config fields take the
defaults of FLA's ``fla/models/<type>/configuration_<type>.py`` (which differ from the layers' own defaults:
``norm_eps`` 1e-6 for the block norms *and* the layers' output norms, GatedDeltaProduct ``num_householder`` 1,
``use_forget_gate`` and ``allow_neg_eigval`` False). Hybrid models name softmax-attention layers in ``attn``.

Graph states per delta-rule layer i: ``conv_q_<i>``, ``conv_k_<i>``, ``conv_v_<i>`` (FLA's three short-conv
caches ``[B, C, W]``, omitted without short convs) and ``state_<i>`` ``[B, Hv, K, V]`` f32; per attention layer
``key_<i>``, ``value_<i>`` ``[B, Hkv, P, head_dim]``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from gdn_export.hf.checkpoint import CheckpointError
from gdn_export.hf.families.base import ExportableLM, Family
from gdn_export.layers import Attention, DeltaNet, FlaForCausalLM, GatedDeltaNet, GatedDeltaProduct, KimiDeltaAttention
from gdn_export.layers.lm import LMConfig

# configuration_*.py defaults shared by the four model types
COMMON_DEFAULTS = dict(vocab_size=32000, hidden_size=2048, hidden_ratio=4, intermediate_size=None, hidden_act="swish",
                       norm_eps=1e-6, attn=None, tie_word_embeddings=False, max_position_embeddings=2048,
                       attnres_block_size=None)

# model_type: (layer class, the config fields its Block passes to the layer with their config defaults)
MODELS = {
    "gated_deltanet": (GatedDeltaNet, 21, dict(
        expand_v=2.0, use_gate=True, use_short_conv=True, allow_neg_eigval=False, conv_size=4, head_dim=256,
        num_heads=6, num_v_heads=None)),
    # the model never passes num_v_heads to this layer: no GVA
    "gated_deltaproduct": (GatedDeltaProduct, 21, dict(
        expand_v=2.0, head_dim=256, num_heads=6, use_output_gate=True, use_forget_gate=False, use_short_conv=True,
        conv_size=4, allow_neg_eigval=False, num_householder=1)),
    "kda": (KimiDeltaAttention, 24, dict(
        expand_v=1.0, head_dim=128, num_heads=16, num_v_heads=None, use_short_conv=True, allow_neg_eigval=False,
        safe_gate=False, lower_bound=None, conv_size=4)),
    # use_output_norm is in DeltaNet's config but its layer ignores it (the output norm always runs)
    "delta_net": (DeltaNet, 24, dict(
        expand_k=1.0, expand_v=1.0, num_heads=16, use_gate=False, use_beta=True, use_short_conv=True,
        allow_neg_eigval=False, conv_size=4, qk_norm="l2", qk_activation="silu")),
}

POSITIVE_INT = ("vocab_size", "hidden_size", "num_hidden_layers", "head_dim", "num_heads", "num_kv_heads", "conv_size",
                "num_householder", "max_position_embeddings")
OPTIONAL_POSITIVE_INT = ("num_v_heads", "intermediate_size", "hidden_ratio")
POSITIVE_NUMBER = ("expand_v", "expand_k", "norm_eps")
BOOLEAN = ("use_gate", "use_short_conv", "allow_neg_eigval", "use_output_gate", "use_forget_gate", "safe_gate",
           "use_beta", "tie_word_embeddings")


def _check_field(name: str, value, where: str = "config.json") -> None:
    def bad(expected: str):
        return CheckpointError(f"{where} field {name!r} must be {expected}, got {value!r}")

    is_int = isinstance(value, int) and not isinstance(value, bool)
    if name in POSITIVE_INT and not (is_int and value > 0):
        raise bad("a positive integer")
    if name in OPTIONAL_POSITIVE_INT and value is not None and not (is_int and value > 0):
        raise bad("a positive integer or null")
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if name in POSITIVE_NUMBER and not (is_number and math.isfinite(value) and value > 0):
        raise bad("a positive number")
    if name == "lower_bound" and value is not None and not (is_number and math.isfinite(value) and value < 0):
        raise bad("a negative number or null")
    if name in BOOLEAN and not isinstance(value, bool):
        raise bad("true or false")


def _attention_specs(attn, num_layers: int) -> dict[int, dict]:
    """FLA's ``attn`` field (None, one spec or a list of specs) as {layer index: normalized spec}."""
    if attn is None:
        return {}
    if not isinstance(attn, (dict, list)):
        raise CheckpointError(f"config.json field 'attn' must be null, an object or a list of objects, got {attn!r}")
    by_layer: dict[int, dict] = {}
    for spec in [attn] if isinstance(attn, dict) else attn:
        if not isinstance(spec, dict) or "layers" not in spec or "num_heads" not in spec:
            raise CheckpointError(f"config.json 'attn' entry {spec!r} needs 'layers' and 'num_heads'")
        layers = spec["layers"]
        if not isinstance(layers, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in layers):
            raise CheckpointError(f"config.json 'attn' layers must be a list of layer indices, got {layers!r}")
        normalized = dict(num_heads=spec["num_heads"], num_kv_heads=spec.get("num_kv_heads") or spec["num_heads"],
                          qkv_bias=spec.get("qkv_bias", False), window_size=spec.get("window_size"),
                          rope_theta=spec.get("rope_theta", 10000.0))
        for field in ("num_heads", "num_kv_heads"):
            _check_field(field, normalized[field], "config.json 'attn'")
        if not isinstance(normalized["qkv_bias"], bool):
            raise CheckpointError(f"config.json 'attn' qkv_bias must be true or false, got {normalized['qkv_bias']!r}")
        window, theta = normalized["window_size"], normalized["rope_theta"]
        if window is not None and not (isinstance(window, int) and not isinstance(window, bool) and window > 0):
            raise CheckpointError(f"config.json 'attn' window_size must be a positive integer or null, got {window!r}")
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not math.isfinite(theta) or theta <= 0:
            raise CheckpointError(f"config.json 'attn' rope_theta must be a positive number, got {theta!r}")
        for index in layers:
            if not 0 <= index < num_layers or index in by_layer:
                raise CheckpointError(f"config.json 'attn' layer {index} is out of range [0, {num_layers}) or "
                                      "listed twice")
            by_layer[index] = normalized
    return by_layer


def build_model(config: dict) -> FlaForCausalLM:
    """The plain-torch FLA model a config.json describes, with freshly initialized weights."""
    model_type = config.get("model_type")
    if model_type not in MODELS:
        raise CheckpointError(f"model_type {model_type!r} is not an FLA model type ({', '.join(MODELS)})")
    layer_class, default_layers, layer_defaults = MODELS[model_type]
    fields = {**COMMON_DEFAULTS, "num_hidden_layers": default_layers, **layer_defaults}
    fields.update({k: v for k, v in config.items() if k in fields})
    for name, value in fields.items():
        _check_field(name, value)
    if fields["attnres_block_size"] is not None:
        raise CheckpointError("attention residuals (attnres_block_size) are not supported")
    if fields["hidden_act"] != "swish":
        raise CheckpointError(f"hidden_act {fields['hidden_act']!r} is not supported (only FLA's 'swish' GatedMLP)")
    num_layers, hidden = fields["num_hidden_layers"], fields["hidden_size"]
    attention = _attention_specs(fields["attn"], num_layers)
    mixers: list[nn.Module] = []
    try:
        for i in range(num_layers):
            if i in attention:
                mixers.append(Attention(hidden, layer_idx=i, max_position_embeddings=fields["max_position_embeddings"],
                                        **attention[i]))
            else:
                kwargs = {k: fields[k] for k in layer_defaults}
                mixers.append(layer_class(hidden_size=hidden, norm_eps=fields["norm_eps"], layer_idx=i, **kwargs))
    except (ValueError, NotImplementedError) as err:
        raise CheckpointError(f"config.json describes an unsupported {model_type} layer: {err}") from None
    lm_config = LMConfig(model_type=model_type, vocab_size=fields["vocab_size"], hidden_size=hidden,
                         norm_eps=fields["norm_eps"], hidden_ratio=fields["hidden_ratio"],
                         intermediate_size=fields["intermediate_size"], hidden_act=fields["hidden_act"],
                         tie_word_embeddings=fields["tie_word_embeddings"],
                         layer_types=["full_attention" if i in attention else "linear_attention"
                                      for i in range(num_layers)])
    return FlaForCausalLM(lm_config, mixers)


def _forwarded(name: str, doc: str) -> property:
    """A property read from and written to the wrapped model's attribute ``name``."""
    return property(lambda self: getattr(self.hf, name), lambda self, value: setattr(self.hf, name, value), doc=doc)


class FlaLM(ExportableLM):
    """The graph: ``FlaForCausalLM.step`` over explicit states (see the module docstring for their names)."""

    def __init__(self, model: FlaForCausalLM, dtype: torch.dtype) -> None:
        super().__init__(model)
        self.states = model.state_specs(dtype)

    def forward(self, input_ids: torch.Tensor, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        past_len, seq_len, states = self.hf.split_inputs(inputs, self.states)
        out, new_states = self.hf.step(input_ids, states, past_len, seq_len)
        if self.hf.emits_hidden:  # the last output: the state after the final norm, which the MTP head reads
            logits, hidden = out
            return (logits, *new_states, hidden)
        return (out, *new_states)

    # The decoder's switches, set on the wrapper by the pipeline and read by the FLA model (it runs the decoder loop
    # itself): emits_hidden (an archive carrying an MTP head, pipeline/mtp.py), serving and last_logits_only.
    emits_hidden = _forwarded("emits_hidden", "``FlaForCausalLM.emits_hidden``: the state after the final norm is "
                              "the last output")
    serving = _forwarded("serving", "``Decoder.serving``, as ``last_logits_only``")
    last_logits_only = _forwarded("last_logits_only", "``Decoder.last_logits_only``")

    @property
    def serving_refusal(self) -> str | None:
        return self.hf.serving_refusal


class FlaFamily(Family):
    def classes(self):
        raise CheckpointError("FLA checkpoints have no transformers classes; FlaFamily.load builds them")

    def build(self, config: dict) -> FlaForCausalLM:
        return build_model(config)

    def ignored_on_load(self) -> tuple[str, ...]:
        return ()


FAMILY = FlaFamily(name="FLA", model_types=tuple(MODELS), lm_class=FlaLM,
                   reference="gdn_export's eager FLA model (matched against FLA's own classes in tests)")
