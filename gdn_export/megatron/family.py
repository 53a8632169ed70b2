"""A Megatron-core hybrid checkpoint as a family: its arguments, its model, and every parameter's source tensor."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

from torch import nn

from gdn_export.hf.checkpoint import CheckpointWeights
from gdn_export.hf.families.base import Family
from gdn_export.hf.families.fla import FlaLM
from gdn_export.hf.layout import Layout
from gdn_export.megatron.checkpoint import MegatronCheckpoint, MegatronCheckpointError, MegatronSource
from gdn_export.layers.common import RMSNorm
from gdn_export.megatron.mtp import mtp_sources
from gdn_export.models.mtp import SKIPPED as MTP_TENSORS
from gdn_export.megatron.model import (MIXER_NAMES, GatedDeltaNet2Mixer, GatedDeltaNetMixer, GatedDeltaProductMixer,
                                       MegatronConfig, MegatronHybridLM, MegatronMoE)

MODEL_TYPE = "megatron_hybrid"
SUPPORTED_SYMBOLS = {"G": "GatedDeltaNet / GatedDeltaNet2", "M": "GatedDeltaProductMixer", "*": "SelfAttention",
                     "-": "MLP", "E": "MoE"}


# bounds on what the args ask to build, before anything is built (the largest published models have ~100 layers and
# 512 experts): a checkpoint's args are untrusted
MAX_LAYERS = 4096
MAX_EXPERTS = 4096


def _arg(args: dict, *names, default=None):
    for name in names:
        if args.get(name) is not None:
            return args[name]
    return default


def _per_layer(args: dict, name: str, layers: int, every) -> list[int]:
    """A GPTModel's per-layer flags: ``args[name]`` as a list, or an int N expanded as Megatron does (``every``)."""
    value = _arg(args, name)
    if isinstance(value, int) and value > 0:
        return [int(every(i, value)) for i in range(layers)]
    if isinstance(value, (list, tuple)) and len(value) == layers and all(v in (0, 1) for v in value):
        return [int(v) for v in value]
    raise MegatronCheckpointError(f"{name} {value!r} is neither a positive int nor a list of {layers} 0/1 flags")


def _layers(args: dict) -> list[tuple[str, int]]:
    """``(symbol, Megatron layer index)`` of every layer in order. A hybrid model's pattern gives one symbol per
    layer (``|`` pipeline marks dropped, the MTP part after ``/`` left out). A ``GPTModel`` built with
    ``experimental_attention_variant`` ``gated_delta_net`` / ``gdn`` (how Megatron-Bridge builds Qwen3-Next) has
    no pattern: each of its ``TransformerLayer``s holds a mixer (``linear_attention_freq``: 1 = GDN ``G``, 0 =
    ``SelfAttention`` ``*``) and an MLP (``moe_layer_freq``: 1 = MoE ``E``, 0 = dense ``-``) under one index, as
    Megatron's ``get_transformer_layer_with_experimental_attention_variant_spec`` builds them."""
    pattern = _arg(args, "hybrid_layer_pattern", "hybrid_override_pattern")
    if isinstance(pattern, str) and pattern:
        if len(pattern) > 4 * MAX_LAYERS:
            raise MegatronCheckpointError(f"the layer pattern has {len(pattern)} characters: at most {MAX_LAYERS} "
                                          "layers are read")
        return [(symbol, i) for i, symbol in enumerate(pattern.split("/")[0].replace("|", ""))]
    variant = _arg(args, "experimental_attention_variant")
    if variant not in ("gated_delta_net", "gdn", "gdn2"):
        raise MegatronCheckpointError("the checkpoint's args have no hybrid_layer_pattern and no gated delta-net "
                                      "experimental_attention_variant: only Megatron hybrid models (HybridModel / "
                                      "MambaModel with a layer pattern) and GPTModels with GDN layers are supported")
    layers = int(_arg(args, "num_layers", default=0))
    if not 0 < layers <= MAX_LAYERS:
        raise MegatronCheckpointError(f"num_layers {layers} in the args: 1 to {MAX_LAYERS} layers are read")
    linear = _per_layer(args, "linear_attention_freq", layers, lambda i, n: (i + 1) % n != 0)
    moe = _per_layer(args, "moe_layer_freq", layers, lambda i, n: i % n == 0) if _arg(args, "num_experts") \
        else [0] * layers
    return [(symbol, i) for i in range(layers) for symbol in ("G*"[1 - linear[i]], "-E"[moe[i]])]


def read_config(checkpoint: MegatronCheckpoint) -> MegatronConfig:
    """The model's arguments from ``args``, checked against what gdn_export computes exactly."""
    args = checkpoint.args
    layers = _layers(args)
    pattern = "".join(symbol for symbol, _ in layers)
    unknown = sorted({s for s in pattern if s not in SUPPORTED_SYMBOLS})
    if unknown:
        raise MegatronCheckpointError(
            f"layer pattern {pattern!r} has layer symbol(s) {' '.join(repr(s) for s in unknown)}: supported are "
            + ", ".join(f"{s!r} ({name})" for s, name in SUPPORTED_SYMBOLS.items()))

    def refuse_if(condition: bool, what: str) -> None:
        if condition:
            raise MegatronCheckpointError(f"{what} is not supported")

    refuse_if(_arg(args, "normalization", default="LayerNorm") != "RMSNorm",
              f"normalization {_arg(args, 'normalization', default='LayerNorm')!r} (only RMSNorm)")
    refuse_if(bool(_arg(args, "add_bias_linear", default=False)), "add_bias_linear (linear layers with biases)")
    interleaved = bool(_arg(args, "rotary_interleaved", default=False))
    # HybridModel builds its RotaryEmbedding without rotary_interleaved (its table in halves: cos(f[j mod r/2]))
    # while its attention rotates adjacent pairs: the two channels of a pair turn by different angles, which is not
    # a rotation (Megatron-LM main, megatron-core 0.19); a GPTModel builds the table to match
    refuse_if(interleaved and "*" in str(_arg(args, "hybrid_layer_pattern", "hybrid_override_pattern", default="")),
              "rotary_interleaved in a HybridModel (its rotary table is built in halves while pairs of adjacent "
              "channels are rotated: not a rotation; GPTModels with rotary_interleaved are read)")
    if "*" in pattern:
        refuse_if(_arg(args, "position_embedding_type", default="rope") != "rope",
                  f"position_embedding_type {_arg(args, 'position_embedding_type')!r} (only rope)")
    swiglu, squared = bool(_arg(args, "swiglu", default=False)), bool(_arg(args, "squared_relu", default=False))
    if "-" in pattern and not (swiglu or squared):
        raise MegatronCheckpointError("the MLP activation is neither swiglu nor squared_relu (only those are supported)")
    variant = _arg(args, "experimental_attention_variant", default="gdn")
    refuse_if("G" in pattern and variant not in ("gdn", "gdn2", "gated_delta_net"),
              f"experimental_attention_variant {variant!r} for 'G' layers (gdn or gdn2)")
    hidden = int(_arg(args, "hidden_size"))
    heads = int(_arg(args, "num_attention_heads", default=1))
    groups = int(_arg(args, "num_query_groups", default=heads) if _arg(args, "group_query_attention", default=True)
                 else heads)
    kv_channels = int(_arg(args, "kv_channels", default=hidden // heads))
    rotary_dim = int(kv_channels * float(_arg(args, "rotary_percent", default=1.0) or 1.0))
    if "*" in pattern:  # what the attention computes otherwise than scaled dot products on plain rotary: refused
        scale = _arg(args, "softmax_scale")
        refuse_if(scale is not None and abs(float(scale) - kv_channels ** -0.5) > 1e-9 * kv_channels ** -0.5,
                  f"softmax_scale {scale} (attention scales by kv_channels ** -0.5 = {kv_channels ** -0.5:.6g})")
        refuse_if(bool(_arg(args, "use_rope_scaling", "rope_scaling", default=False)),
                  "rope scaling (use_rope_scaling / rope_scaling: plain rotary only)")
        factor = _arg(args, "rotary_seq_len_interpolation_factor", "seq_len_interpolation_factor")
        refuse_if(factor not in (None, 1, 1.0), f"rotary_seq_len_interpolation_factor {factor} (plain rotary only)")
        refuse_if(_arg(args, "mrope_section") is not None,
                  f"mrope_section {_arg(args, 'mrope_section')} (multimodal rotary; plain rotary only)")
    if "E" in pattern:  # the experts are SwiGLU (MegatronMoE)
        refuse_if(not swiglu, "MoE experts without swiglu (only SwiGLU experts)")
    if "*" in pattern:
        refuse_if(rotary_dim % 2 or not 0 < rotary_dim <= kv_channels,
                  f"rotary_percent {_arg(args, 'rotary_percent')} ({rotary_dim} of {kv_channels} channels; an even "
                  "number of at least 2)")
    embedding = checkpoint.info("embedding.word_embeddings.weight") if checkpoint.has(
        "embedding.word_embeddings.weight") else None
    if embedding is None:
        raise MegatronCheckpointError("the checkpoint has no embedding.word_embeddings.weight")
    tied = not bool(_arg(args, "untie_embeddings_and_output_weights", default=False))
    kinds = {"G": "gdn2" if variant == "gdn2" else "gdn", "M": "gdp", "*": "attention"}
    blocks = []
    for symbol, index in layers:
        if symbol in "-E":
            if not blocks:
                raise MegatronCheckpointError(f"layer pattern {pattern!r} starts with an MLP or MoE layer: a mixer "
                                              "must come first")
            blocks[-1][2].append(index)
        else:
            if symbol == "M" and checkpoint.has(f"decoder.layers.{index}.mixer.D"):
                raise MegatronCheckpointError(f"layer {index} ('M') is a Mamba2 mixer (it has D): only "
                                              "GatedDeltaProductMixer 'M' layers are supported")
            blocks.append((kinds[symbol], index, []))
    conv = int(_arg(args, "linear_conv_kernel_dim", default=4))
    gdp_conv = 4
    for kind, index, _ in blocks:
        if kind == "gdp":
            gdp_conv = int(checkpoint.info(_first(checkpoint, f"decoder.layers.{index}.mixer.conv1d.weight")).shape[-1])
            break
    return MegatronConfig(
        model_type=MODEL_TYPE, vocab_size=embedding.shape[0], hidden_size=hidden,
        norm_eps=float(_arg(args, "layernorm_epsilon", "norm_epsilon", default=1e-5)),
        layer_types=["linear_attention" if kind != "attention" else "full_attention" for kind, _, _ in blocks],
        tie_word_embeddings=tied, pattern=pattern, blocks=blocks, num_attention_heads=heads, num_query_groups=groups,
        kv_channels=kv_channels, qk_layernorm=bool(_arg(args, "qk_layernorm", default=False)),
        add_qkv_bias=bool(_arg(args, "add_qkv_bias", default=False)),
        rotary_base=float(_arg(args, "rotary_base", default=10000)),
        ffn_hidden_size=int(_arg(args, "ffn_hidden_size", default=4 * hidden)),
        mlp_activation="swiglu" if swiglu else "squared_relu", linear_conv_kernel_dim=conv,
        linear_key_head_dim=int(_arg(args, "linear_key_head_dim", default=128)),
        linear_value_head_dim=int(_arg(args, "linear_value_head_dim", default=128)),
        linear_num_key_heads=int(_arg(args, "linear_num_key_heads", default=16)),
        linear_num_value_heads=int(_arg(args, "linear_num_value_heads", default=32)),
        mamba_state_dim=int(_arg(args, "mamba_state_dim", default=128)),
        mamba_head_dim=int(_arg(args, "mamba_head_dim", default=64)),
        mamba_num_groups=int(_arg(args, "mamba_num_groups", default=8)),
        mamba_num_heads=int(_arg(args, "mamba_num_heads", default=0) or 0),
        gdp_num_householder=int(_arg(args, "gdp_num_householder", default=3)), gdp_conv_kernel_dim=gdp_conv,
        attention_output_gate=bool(_arg(args, "attention_output_gate", default=False)),
        rotary_dim=rotary_dim if rotary_dim != kv_channels else 0, rotary_interleaved=interleaved,
        **(_moe_config(args, hidden) if "E" in pattern else {}),
        moe_layers=[i for s, i in layers if s == "E"])


def _moe_config(args: dict, hidden: int) -> dict:
    """The ``E`` layers' arguments, checked against the routings gdn_export computes: Megatron's ``TopKRouter`` with
    softmax scores (without scaling, expert bias or groups), or with sigmoid scores (DeepSeek-V3's routing: expert
    bias, scaling, groups scored by their top-2 sum)."""
    def refuse_if(condition: bool, what: str) -> None:
        if condition:
            raise MegatronCheckpointError(f"MoE layers with {what} are not supported (softmax, sigmoid or sqrtsoftplus "
                                          "top-k routing with a positive scaling, groups scored by their top-2 sum; "
                                          "expert bias with sigmoid or sqrtsoftplus scores)")

    score = _arg(args, "moe_router_score_function", default="softmax")
    scaling = float(_arg(args, "moe_router_topk_scaling_factor", default=None) or 1.0)
    bias = bool(_arg(args, "moe_router_enable_expert_bias", default=False))
    groups = int(_arg(args, "moe_router_num_groups", default=None) or 1)
    group_topk = int(_arg(args, "moe_router_group_topk", default=None) or 1)
    top_k = int(_arg(args, "moe_router_topk", default=2))
    refuse_if(score not in ("softmax", "sigmoid", "sqrtsoftplus"), f"moe_router_score_function {score!r}")
    if score == "softmax":
        # Megatron's TransformerConfig itself refuses an expert bias with softmax scores (aux-loss-free routing
        # is for sigmoid and sqrtsoftplus); no Megatron release routes with it
        refuse_if(bias, "moe_router_enable_expert_bias and softmax scores (Megatron refuses that pair too)")
        refuse_if(scaling <= 0, f"moe_router_topk_scaling_factor {scaling} (softmax weights times a non-positive "
                                "factor: the top k of the weights would not be the chosen experts)")
    refuse_if(groups > 1 and (top_k // group_topk != 2 or int(_arg(args, "num_experts", default=0) or 0) % groups),
              f"moe_router_num_groups {groups}, moe_router_group_topk {group_topk} and moe_router_topk {top_k} "
              f"(a group scored by its top-{top_k // group_topk} sum)")
    experts = _arg(args, "num_experts", default=None)
    if not experts:
        raise MegatronCheckpointError("the layer pattern has MoE ('E') layers but the args give no num_experts")
    if not 0 < int(experts) <= MAX_EXPERTS:
        raise MegatronCheckpointError(f"num_experts {experts} in the args: 1 to {MAX_EXPERTS} experts are read")
    shared = int(_arg(args, "moe_shared_expert_intermediate_size", default=0) or 0)
    return dict(num_experts=int(experts), moe_router_topk=top_k,
                moe_ffn_hidden_size=int(_arg(args, "moe_ffn_hidden_size", "ffn_hidden_size", default=4 * hidden)),
                moe_router_pre_softmax=bool(_arg(args, "moe_router_pre_softmax", default=False)),
                moe_router_score_function=score, moe_router_expert_bias=bias, moe_router_scaling=scaling,
                moe_router_num_groups=groups, moe_router_group_topk=group_topk if groups > 1 else 1,
                moe_shared_expert_size=shared,
                moe_shared_expert_gate=bool(shared and _arg(args, "moe_shared_expert_gate", default=False)))


def zero_centred(args: dict) -> bool:
    """Megatron's norms compute with ``1 + w`` (Transformer Engine's ``zero_centered_gamma``)."""
    return bool(_arg(args, "apply_layernorm_1p", "layernorm_zero_centered_gamma", default=False))


def _first(checkpoint: MegatronCheckpoint, base: str) -> str:
    """``base`` or the first of its split parts (``base.<part>``) that the checkpoint holds."""
    if checkpoint.has(base):
        return base
    for name in checkpoint.names():
        if name.startswith(base + "."):
            return name
    raise MegatronCheckpointError(f"the checkpoint has no {base}")


def _sections_source(checkpoint, base: str, sections: list[tuple[str, int]], wanted: list[str], shape) -> MegatronSource:
    """The rows of parts ``wanted`` of a fused tensor: split keys ``base.<part>`` (torch_dist) or row ranges of
    ``base`` itself (legacy)."""
    if all(checkpoint.has(f"{base}.{part}") for part in wanted):
        return MegatronSource(checkpoint, [(f"{base}.{part}", None) for part in wanted], shape)
    if not checkpoint.has(base):
        missing = next(f"{base}.{part}" for part in wanted if not checkpoint.has(f"{base}.{part}"))
        raise MegatronCheckpointError(f"weights missing from the checkpoint: {missing}")
    offsets, start = {}, 0
    for name, size in sections:
        offsets[name] = (start, start + size)
        start += size
    total = checkpoint.info(base).shape[0]
    if total != start:
        raise MegatronCheckpointError(f"{base} has {total} rows; the model's arguments give {start}")
    return MegatronSource(checkpoint, [(base, slice(*offsets[part])) for part in wanted], shape)


def _whole(checkpoint, shape, *names) -> MegatronSource:
    for name in names:
        if checkpoint.has(name):
            return MegatronSource(checkpoint, [(name, None)], shape)
    raise MegatronCheckpointError(f"weights missing from the checkpoint: {names[0]}")


def parameter_sources(model: MegatronHybridLM, checkpoint: MegatronCheckpoint) -> tuple[dict, Counter]:
    """Every model parameter's ``MegatronSource``, and the checkpoint tensors left out (by reason); a checkpoint
    tensor that makes nothing is an error."""
    config: MegatronConfig = model.config
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    sources: dict[str, MegatronSource] = {}
    used: set[str] = set()

    def put(name: str, source: MegatronSource) -> None:
        sources[name] = source
        used.update(piece for piece, _ in source.pieces)

    put("model.embeddings.weight", _whole(checkpoint, shapes["model.embeddings.weight"], "embedding.word_embeddings.weight"))
    put("model.norm.weight", _whole(checkpoint, shapes["model.norm.weight"], "decoder.final_norm.weight",
                                    "decoder.final_layernorm.weight"))
    if not config.tie_word_embeddings:
        put("lm_head.weight", _whole(checkpoint, shapes["lm_head.weight"], "output_layer.weight"))
    for b, (kind, index, mlps) in enumerate(config.blocks):
        layer, prefix = f"decoder.layers.{index}.", f"model.layers.{b}."
        mixer = model.model.layers[b].attn
        if kind == "attention":
            put(prefix + "attn_norm.weight", _whole(checkpoint, (config.hidden_size,),
                                                    layer + "self_attention.linear_qkv.layer_norm_weight",
                                                    layer + "input_layernorm.weight"))
            _attention_sources(checkpoint, config, layer + "self_attention.", prefix + "attn.", shapes, put)
            continue
        where = layer + ("mixer." if kind == "gdp" else "self_attention.")
        put(prefix + "attn_norm.weight", _whole(checkpoint, (config.hidden_size,), where + "in_proj.layer_norm_weight",
                                                layer + ("norm.weight" if kind == "gdp" else "input_layernorm.weight")))
        sections = type(mixer).sections(config)
        for part, _ in sections:
            name = f"{prefix}attn.in_proj.{part}.weight"
            put(name, _sections_source(checkpoint, where + "in_proj.weight", sections, [part], shapes[name]))
        conv_parts = ([f"V{i}" for i in range(config.gdp_num_householder)]
                      + [f"K{i}" for i in range(config.gdp_num_householder)] + ["Q"]) if kind == "gdp" else \
            ["query", "key", "value"]
        conv_sections = [(p, s) for p, s in sections if p in conv_parts]
        put(prefix + "attn.conv.weight", _sections_source(checkpoint, where + "conv1d.weight", conv_sections,
                                                          conv_parts, shapes[prefix + "attn.conv.weight"]))
        for param in ("A_log", "dt_bias"):
            put(prefix + "attn." + param, _whole(checkpoint, shapes[prefix + "attn." + param], where + param))
        if kind == "gdp":
            put(prefix + "attn.norm", _whole(checkpoint, shapes[prefix + "attn.norm"], where + "norm.weight"))
        else:
            put(prefix + "attn.out_norm.weight", _whole(checkpoint, shapes[prefix + "attn.out_norm.weight"],
                                                        where + "out_norm.weight"))
        put(prefix + "attn.out_proj.weight", _whole(checkpoint, shapes[prefix + "attn.out_proj.weight"],
                                                    where + "out_proj.weight"))
        for bias in ("in_proj.bias", "out_proj.bias", "conv1d.bias"):
            if any(n == where + bias or n.startswith(where + bias + ".") for n in checkpoint.names()):
                raise MegatronCheckpointError(f"{where + bias}: biases in the delta-rule mixers are not supported")
    for b, (_, _, mlps) in enumerate(config.blocks):
        for j, index in enumerate(mlps):
            layer, prefix = f"decoder.layers.{index}.", f"model.layers.{b}.mlps.{j}."
            put(f"model.layers.{b}.mlp_norms.{j}.weight", _whole(
                checkpoint, (config.hidden_size,), layer + "mlp.linear_fc1.layer_norm_weight",
                layer + "pre_mlp_layernorm.weight"))
            if index in config.moe_layers:
                _moe_sources(checkpoint, config, layer + "mlp.", prefix, shapes, put)
                continue
            ffn = config.ffn_hidden_size
            if config.mlp_activation == "swiglu":
                put(prefix + "gate_proj.weight", MegatronSource(checkpoint, [(layer + "mlp.linear_fc1.weight",
                                                                              slice(0, ffn))], (ffn, config.hidden_size)))
                put(prefix + "up_proj.weight", MegatronSource(checkpoint, [(layer + "mlp.linear_fc1.weight",
                                                                            slice(ffn, 2 * ffn))], (ffn, config.hidden_size)))
                fc1 = checkpoint.info(layer + "mlp.linear_fc1.weight") if checkpoint.has(
                    layer + "mlp.linear_fc1.weight") else None
                if fc1 is None or fc1.shape != (2 * ffn, config.hidden_size):
                    raise MegatronCheckpointError(f"{layer}mlp.linear_fc1.weight should be [{2 * ffn}, "
                                                  f"{config.hidden_size}] (SwiGLU), got {fc1 and list(fc1.shape)}")
            else:
                put(prefix + "up_proj.weight", _whole(checkpoint, (ffn, config.hidden_size), layer + "mlp.linear_fc1.weight"))
            put(prefix + "down_proj.weight", _whole(checkpoint, shapes[prefix + "down_proj.weight"],
                                                    layer + "mlp.linear_fc2.weight"))
    if zero_centred(checkpoint.args):  # every RMSNorm Megatron builds from its config; not GDP's gated norm
        for name, module in model.named_modules():
            if isinstance(module, RMSNorm):
                sources[name + ".weight"].offset = 1.0
    missing = sorted(set(shapes) - set(sources))
    if missing:
        raise MegatronCheckpointError(f"no checkpoint tensor for {', '.join(missing[:5])}")
    for name, source in sources.items():
        for piece, rows in source.pieces:
            info = checkpoint.info(piece)
            if rows is None and len(source.pieces) == 1 and info.shape != shapes[name]:
                raise MegatronCheckpointError(f"{piece} is {list(info.shape)} in the checkpoint; the model's "
                                              f"arguments give {list(shapes[name])}")
    skipped: Counter = Counter()
    for name in checkpoint.names():
        if name in used:
            continue
        if name.startswith("mtp."):  # mapped onto the published mtp.* head by megatron.mtp (checked there)
            skipped[MTP_TENSORS] += 1
        elif name.endswith("rotary_pos_emb.inv_freq") or name.endswith("_extra_state"):
            skipped["buffers"] += 1
        elif name == "output_layer.weight" and config.tie_word_embeddings:
            skipped["tied to the embedding table"] += 1
        else:
            raise MegatronCheckpointError(f"the checkpoint has {name}, which the model's arguments do not describe")
    return sources, skipped


def _expert_pieces(checkpoint, where: str, linear: str, experts: int) -> list:
    """The routed experts' ``linear`` (``linear_fc1`` / ``linear_fc2``) in expert order: one stacked tensor
    ``experts.experts.<linear>.weight`` (torch_dist, with the expert axis first, for sequential and grouped-GEMM
    experts alike), or one tensor per expert in a legacy checkpoint (``SequentialMLP``:
    ``experts.local_experts.<e>.<linear>.weight``; ``TEGroupedMLP``: ``experts.<linear>.weight<e>``)."""
    stacked = f"{where}experts.experts.{linear}.weight"
    if checkpoint.has(stacked):
        return [(stacked, None)]
    for name_of in (lambda e: f"{where}experts.local_experts.{e}.{linear}.weight",
                    lambda e: f"{where}experts.{linear}.weight{e}"):
        names = [name_of(e) for e in range(experts)]
        if all(checkpoint.has(name) for name in names):
            return [(name, None) for name in names]
    if checkpoint.has(f"{where}experts.weight1"):
        raise MegatronCheckpointError(f"{where}experts.weight1: the legacy GroupedMLP layout (weight1 / weight2) is "
                                      "not supported (save torch_dist, or SequentialMLP / TEGroupedMLP experts)")
    raise MegatronCheckpointError(f"weights missing from the checkpoint: {stacked} (or the {experts} experts' "
                                  f"{where}experts.local_experts.<e>.{linear}.weight)")


def _moe_sources(checkpoint, config: MegatronConfig, where: str, prefix: str, shapes, put) -> None:
    """An ``E`` layer's ``MoELayer``: router, routed experts (``linear_fc1`` = ``[gate; up]`` per expert), shared
    expert and its gate."""
    put(prefix + "router.weight", _whole(checkpoint, shapes[prefix + "router.weight"], where + "router.weight"))
    if config.moe_router_expert_bias:
        put(prefix + "expert_bias", _whole(checkpoint, shapes[prefix + "expert_bias"], where + "router.expert_bias"))
    for param, linear in (("gate_up_proj", "linear_fc1"), ("down_proj", "linear_fc2")):
        name = f"{prefix}experts.{param}"
        put(name, MegatronSource(checkpoint, _expert_pieces(checkpoint, where, linear, config.num_experts),
                                 shapes[name]))
    if config.moe_shared_expert_size:
        size, fc1 = config.moe_shared_expert_size, where + "shared_experts.linear_fc1.weight"
        for part, rows in (("gate_proj", slice(0, size)), ("up_proj", slice(size, 2 * size))):
            name = f"{prefix}shared_expert.{part}.weight"
            if not checkpoint.has(fc1):
                raise MegatronCheckpointError(f"weights missing from the checkpoint: {fc1}")
            put(name, MegatronSource(checkpoint, [(fc1, rows)], shapes[name]))
        put(prefix + "shared_expert.down_proj.weight", _whole(
            checkpoint, shapes[prefix + "shared_expert.down_proj.weight"], where + "shared_experts.linear_fc2.weight"))
        if config.moe_shared_expert_gate:
            put(prefix + "shared_expert_gate.weight", _whole(
                checkpoint, shapes[prefix + "shared_expert_gate.weight"], where + "shared_experts.gate_weight"))


def qkv_rows(config: MegatronConfig) -> dict[str, list[int]]:
    """The rows of ``linear_qkv`` that make q, gate (with ``attention_output_gate``), k and v, each in head order:
    per query group ``[q (heads/groups · d) | gate (heads/groups · d) | k (d) | v (d)]``."""
    d, groups = config.kv_channels, config.num_query_groups
    per_group = config.num_attention_heads // groups
    sizes = [("q", per_group * d)] + ([("gate", per_group * d)] if config.attention_output_gate else []) + \
        [("k", d), ("v", d)]
    rows: dict[str, list[int]] = {part: [] for part, _ in sizes}
    base = 0
    for g in range(groups):
        for part, size in sizes:
            rows[part] += range(base, base + size)
            base += size
    order = head_channel_order(config)
    for part in ("q", "k"):  # interleaved rotary: each head's channels in the order NeoX halves rotate them
        rows[part] = [rows[part][head * d + c] for head in range(len(rows[part]) // d) for c in order]
    return rows


def head_channel_order(config: MegatronConfig) -> list[int]:
    """The order a q / k head's channels are read in: as stored, or with ``rotary_interleaved`` the rotated ones
    even first, then odd (``[0, 2, .., r-2, 1, 3, .., r-1]``, the rest after): Megatron turns the pair (2i, 2i+1)
    by frequency i, which is NeoX's turn of channels (i, i + r/2) after this reordering; q and k reordered alike
    keep every attention score."""
    d = config.kv_channels
    r = config.rotary_dim or d
    if not config.rotary_interleaved:
        return list(range(d))
    return list(range(0, r, 2)) + list(range(1, r, 2)) + list(range(r, d))


def head_norm_source(checkpoint, config: MegatronConfig, name: str) -> MegatronSource:
    """A q / k norm weight (one per head channel) in ``head_channel_order``."""
    if not checkpoint.has(name):
        raise MegatronCheckpointError(f"weights missing from the checkpoint: {name}")
    if tuple(checkpoint.info(name).shape) != (config.kv_channels,):
        raise MegatronCheckpointError(f"{name} is {list(checkpoint.info(name).shape)} in the checkpoint; the model's "
                                      f"arguments give [{config.kv_channels}]")
    return MegatronSource(checkpoint, [(name, head_channel_order(config))], (config.kv_channels,))


def _attention_sources(checkpoint, config: MegatronConfig, where: str, prefix: str, shapes, put) -> None:
    """``linear_qkv`` rows (``qkv_rows``) gathered into q, k, v and the output gate."""
    rows, d = qkv_rows(config), config.kv_channels
    if config.attention_output_gate:
        put(prefix + "gate_proj.weight", MegatronSource(checkpoint, [(where + "linear_qkv.weight", rows["gate"])],
                                                        shapes[prefix + "gate_proj.weight"]))
    for part in ("q", "k", "v"):
        put(f"{prefix}{part}_proj.weight", MegatronSource(checkpoint, [(where + "linear_qkv.weight", rows[part])],
                                                          shapes[f"{prefix}{part}_proj.weight"]))
        if config.add_qkv_bias:
            put(f"{prefix}{part}_proj.bias", MegatronSource(checkpoint, [(where + "linear_qkv.bias", rows[part])],
                                                            shapes[f"{prefix}{part}_proj.bias"]))
    put(prefix + "o_proj.weight", _whole(checkpoint, shapes[prefix + "o_proj.weight"], where + "linear_proj.weight"))
    if config.qk_layernorm:
        put(prefix + "q_norm.weight", head_norm_source(checkpoint, config, where + "q_layernorm.weight"))
        put(prefix + "k_norm.weight", head_norm_source(checkpoint, config, where + "k_layernorm.weight"))


def fused_blocks(config: MegatronConfig) -> dict[str, list[int]]:
    """The part sizes of every fused projection (packed ``in_proj``, its conv, SwiGLU ``linear_fc1``), by tensor:
    how a legacy tensor-parallel checkpoint's shards are merged (each rank holds its slice of every part)."""
    mixers = {"gdn": GatedDeltaNetMixer, "gdn2": GatedDeltaNet2Mixer, "gdp": GatedDeltaProductMixer}
    blocks: dict[str, list[int]] = {}
    for kind, index, mlps in config.blocks:
        if kind in mixers:
            where = f"decoder.layers.{index}." + ("mixer." if kind == "gdp" else "self_attention.")
            sections = mixers[kind].sections(config)
            conv = ("z", "beta", "alpha", "f", "b", "w", "a") + tuple(f"b{i}" for i in range(config.gdp_num_householder))
            blocks[where + "in_proj.weight"] = [size for _, size in sections]
            blocks[where + "conv1d.weight"] = [size for part, size in sections if part not in conv]
        for mlp in mlps:
            where = f"decoder.layers.{mlp}.mlp."
            if mlp in config.moe_layers:  # every SwiGLU expert, as SequentialMLP and TEGroupedMLP name them
                for e in range(config.num_experts):
                    for name in (f"experts.local_experts.{e}.linear_fc1.weight", f"experts.linear_fc1.weight{e}"):
                        blocks[where + name] = [config.moe_ffn_hidden_size] * 2
                if config.moe_shared_expert_size:
                    blocks[where + "shared_experts.linear_fc1.weight"] = [config.moe_shared_expert_size] * 2
            elif config.mlp_activation == "swiglu":
                blocks[where + "linear_fc1.weight"] = [config.ffn_hidden_size] * 2
    return blocks


def refuse_unverified(config: MegatronConfig, checkpoint: MegatronCheckpoint) -> None:
    """What is read by the same means as verified layouts but has no fixture: refused rather than guessed."""
    tp = getattr(checkpoint, "tensor_parallel", 1)
    expert_tp = _arg(checkpoint.args, "expert_tensor_parallel_size", default=tp)
    if config.moe_layers and checkpoint.format == "legacy" and tp > 1 and expert_tp != tp:
        raise MegatronCheckpointError(f"a legacy MoE checkpoint saved with expert_tensor_parallel_size {expert_tp} "
                                      f"!= tensor_model_parallel_size {tp} is not supported (save torch_dist)")


class MegatronWeights(CheckpointWeights):
    """``CheckpointWeights`` whose summary names the checkpoint's format and Megatron layer types; ``mtp``: the
    MTP head's ``(MTPConfig, {published mtp.* name: MegatronSource})`` (``megatron.mtp``), or None."""

    description: str = ""
    mtp: tuple | None = None
    checkpoint: MegatronCheckpoint | None = None  # the opened folder (the MTP head is read through it)

    def summary(self) -> str:
        return f"{self.description}; {super().summary()}"


class MegatronFamily(Family):
    def classes(self):
        raise MegatronCheckpointError("Megatron checkpoints have no transformers classes")

    def build(self, config: dict | MegatronConfig) -> MegatronHybridLM:
        return MegatronHybridLM(config["megatron"] if isinstance(config, dict) else config)

    def ignored_on_load(self) -> tuple[str, ...]:
        return ()


class MegatronLM(FlaLM):
    """The exportable model: ``FlaLM`` whose MoE layers run their routed experts as one ``moe_ffn`` node over
    ``ExpertStacks`` (the project's sparse MoE path, as the Hugging Face MoE families do), built here from the
    model being exported and handed to each ``MegatronMoE`` unregistered."""

    def __init__(self, model: MegatronHybridLM, dtype) -> None:
        from gdn_export.hf.blocks import ExpertStacks

        super().__init__(model, dtype)
        stacks = {}
        for name, module in model.named_modules():
            if isinstance(module, MegatronMoE):
                stacks[name.replace(".", "_")] = ExpertStacks(module.experts, module.gate)
                object.__setattr__(module, "stacks", stacks[name.replace(".", "_")])
        self.expert_stacks = nn.ModuleDict(stacks)


FAMILY = MegatronFamily(name="Megatron-LM hybrid", model_types=(MODEL_TYPE,), lm_class=MegatronLM,
                        reference="gdn_export's eager Megatron model (matched against Megatron's own logits in tests)")


def describe(config: MegatronConfig, checkpoint: MegatronCheckpoint) -> str:
    names = {**MIXER_NAMES, "gdp": f"{MIXER_NAMES['gdp']} (n={config.gdp_num_householder})"}
    used = sorted({names[kind] for kind, _, _ in config.blocks}) + (["MLP"] if "-" in config.pattern else [])
    if config.moe_layers:
        routing = (config.moe_router_score_function + (", expert bias" if config.moe_router_expert_bias else "")
                   + (f", {config.moe_router_group_topk} of {config.moe_router_num_groups} groups"
                      if config.moe_router_num_groups > 1 else "")
                   + (f", scaled by {config.moe_router_scaling:g}" if config.moe_router_scaling != 1 else ""))
        used.append(f"MoE ({config.num_experts} experts, top-{config.moe_router_topk} "
                    + routing
                    + (" before top-k" if config.moe_router_pre_softmax else "")
                    + (", gated shared expert" if config.moe_shared_expert_gate else
                       ", shared expert" if config.moe_shared_expert_size else "") + ")")
    if config.attention_output_gate:
        used.append("gated attention output")
    if config.rotary_dim:
        used.append(f"rotary on {config.rotary_dim} of {config.kv_channels} channels")
    if config.rotary_interleaved:
        used.append("interleaved rotary (read as halves over reordered q/k channels)")
    if zero_centred(checkpoint.args):
        used.append("zero-centred (1 + w) norms")
    sizes = {what: int(checkpoint.args.get(f"{key}_model_parallel_size", 1) or 1)
             for what, key in (("tensor", "tensor"), ("pipeline", "pipeline"), ("expert", "expert"))}
    saved = (" saved with " + ", ".join(f"{what}-parallel size {size}" for what, size in sizes.items())
             if any(size > 1 for size in sizes.values()) else "")
    gpt = not _arg(checkpoint.args, "hybrid_layer_pattern", "hybrid_override_pattern")
    layers = f"GPTModel layers {config.pattern} (a mixer and an MLP each)" if gpt else f"pattern {config.pattern}"
    by = " (saved by Megatron-Bridge: run_config.yaml)" if checkpoint.saved_by == "Megatron-Bridge" else ""
    return f"Megatron {checkpoint.format} checkpoint{by}{saved}, {layers} ({', '.join(used)})"


def open_megatron(folder: str | os.PathLike):
    """``(family, layout, model, weights)`` for a Megatron checkpoint folder, as ``hf.checkpoint.open_checkpoint``
    returns for a Hugging Face one: every parameter's tensor found and checked, nothing read."""
    from gdn_export.hf.checkpoint import parameters_on_meta

    checkpoint = MegatronCheckpoint(Path(folder))
    try:
        config = read_config(checkpoint)
    except (ValueError, TypeError) as err:  # a number the args hold as something else: the args are at fault
        raise MegatronCheckpointError(f"{folder}: the checkpoint's args do not describe a model: "
                                      f"{str(err).splitlines()[0][:200]}") from None
    refuse_unverified(config, checkpoint)
    checkpoint.blocks = fused_blocks(config)
    with parameters_on_meta():
        model = MegatronHybridLM(config).eval()
    sources, skipped = parameter_sources(model, checkpoint)
    try:  # every mtp.* tensor mapped and its shape checked, nothing read
        mtp, mtp_left_out = mtp_sources(checkpoint, config), ""
    except MegatronCheckpointError as err:  # the model converts; its MTP block stays out, and the report says why
        mtp, mtp_left_out = None, str(err)
    layout = Layout(model_type=MODEL_TYPE, config={"model_type": MODEL_TYPE, "vocab_size": config.vocab_size,
                                                   "megatron": config})
    weights = MegatronWeights(sources, skipped, None)
    weights.description = describe(config, checkpoint) + (
        f", an MTP head of 1 depth ({'MoE' if mtp[0].num_experts else 'dense MLP'}; mapped to the published "
        "mtp.* names)" if mtp else f", its MTP block left out: {mtp_left_out}" if mtp_left_out else "")
    weights.mtp, weights.checkpoint = mtp, checkpoint
    return FAMILY, layout, model, weights


__all__ = ["FAMILY", "MIXER_NAMES", "GatedDeltaNet2Mixer", "GatedDeltaNetMixer", "GatedDeltaProductMixer",
           "open_megatron", "read_config"]
