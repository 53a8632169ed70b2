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
from gdn_export.megatron.checkpoint import (MegatronCheckpoint, MegatronCheckpointError, MegatronSource, expert_names,
                                            stacked_expert_name)
from gdn_export.layers.common import LayerNorm, RMSNorm
from gdn_export.megatron.mtp import mtp_depths, mtp_sources, own_depths
from gdn_export.models.mtp import SKIPPED as MTP_TENSORS
from gdn_export.megatron.model import (MIXER_NAMES, GatedDeltaNet2Mixer, GatedDeltaNetMixer, GatedDeltaProductMixer,
                                       Mamba2Mixer, MegatronConfig, MegatronHybridLM, MegatronMoE)

MODEL_TYPE = "megatron_hybrid"
SUPPORTED_SYMBOLS = {"G": "GatedDeltaNet / GatedDeltaNet2", "M": "GatedDeltaProductMixer / MambaMixer (Mamba2)",
                     "*": "SelfAttention",
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

    # the layers the arguments must describe: the decoder's and a HybridModel's MTP layers (after '/'; a GPTModel's
    # MTP layer is its last layer's kind)
    raw = _arg(args, "hybrid_layer_pattern", "hybrid_override_pattern", default="")
    every = pattern + ("".join(raw.split("/")[1:]) if isinstance(raw, str) else "")
    # Megatron-LM's arguments default to LayerNorm and add_bias_linear (its GPT defaults)
    normalization = _arg(args, "normalization", default="LayerNorm")
    refuse_if(normalization not in ("RMSNorm", "LayerNorm"), f"normalization {normalization!r} (RMSNorm or LayerNorm)")
    bias = bool(_arg(args, "add_bias_linear", default=True))
    interleaved = bool(_arg(args, "rotary_interleaved", default=False))
    # HybridModel builds its RotaryEmbedding without rotary_interleaved (its table in halves: cos(f[j mod r/2]))
    # while its attention rotates adjacent pairs: the two channels of a pair turn by different angles, which is not
    # a rotation (Megatron-LM main, megatron-core 0.19); a GPTModel builds the table to match
    refuse_if(interleaved and "*" in str(_arg(args, "hybrid_layer_pattern", "hybrid_override_pattern", default="")),
              "rotary_interleaved in a HybridModel (its rotary table is built in halves while pairs of adjacent "
              "channels are rotated: not a rotation; GPTModels with rotary_interleaved are read)")
    if "*" in every:
        refuse_if(_arg(args, "position_embedding_type", default="rope") != "rope",
                  f"position_embedding_type {_arg(args, 'position_embedding_type')!r} (only rope)")
    swiglu, squared = bool(_arg(args, "swiglu", default=False)), bool(_arg(args, "squared_relu", default=False))
    if "-" in every and not (swiglu or squared):
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
    if "*" in every:  # what the attention computes otherwise than scaled dot products on plain rotary: refused
        scale = _arg(args, "softmax_scale")
        refuse_if(scale is not None and abs(float(scale) - kv_channels ** -0.5) > 1e-9 * kv_channels ** -0.5,
                  f"softmax_scale {scale} (attention scales by kv_channels ** -0.5 = {kv_channels ** -0.5:.6g})")
        refuse_if(bool(_arg(args, "use_rope_scaling", "rope_scaling", default=False)),
                  "rope scaling (use_rope_scaling / rope_scaling: plain rotary only)")
        factor = _arg(args, "rotary_seq_len_interpolation_factor", "seq_len_interpolation_factor")
        refuse_if(factor not in (None, 1, 1.0), f"rotary_seq_len_interpolation_factor {factor} (plain rotary only)")
        refuse_if(_arg(args, "mrope_section") is not None,
                  f"mrope_section {_arg(args, 'mrope_section')} (multimodal rotary; plain rotary only)")
    if "E" in every:  # the experts are SwiGLU (MegatronMoE)
        refuse_if(not swiglu, "MoE experts without swiglu (only SwiGLU experts)")
    if "*" in every:
        refuse_if(rotary_dim % 2 or not 0 < rotary_dim <= kv_channels,
                  f"rotary_percent {_arg(args, 'rotary_percent')} ({rotary_dim} of {kv_channels} channels; an even "
                  "number of at least 2)")
    embedding = checkpoint.info("embedding.word_embeddings.weight") if checkpoint.has(
        "embedding.word_embeddings.weight") else None
    if embedding is None:
        raise MegatronCheckpointError("the checkpoint has no embedding.word_embeddings.weight")
    tied = not bool(_arg(args, "untie_embeddings_and_output_weights", default=False))
    kinds = {"G": "gdn2" if variant == "gdn2" else "gdn", "M": "gdp", "*": "attention"}
    blocks, lead = [], []
    for symbol, index in layers:
        if symbol in "-E":  # after the last mixer's block, or before the first mixer (run on the embeddings)
            (blocks[-1][2] if blocks else lead).append(index)
        else:  # an 'M' layer with a D skip is Megatron's Mamba2 MambaMixer, without one a GatedDeltaProductMixer
            mamba2 = symbol == "M" and checkpoint.has(f"decoder.layers.{index}.mixer.D")
            blocks.append(("mamba2" if mamba2 else kinds[symbol], index, []))
    if not blocks:
        raise MegatronCheckpointError(f"layer pattern {pattern!r} has no mixer layer (G, M or *)")
    conv = int(_arg(args, "linear_conv_kernel_dim", default=4))
    gdp_conv = 4
    if len({kind for kind, _, _ in blocks} & {"gdp", "mamba2"}) > 1:
        raise MegatronCheckpointError("'M' layers of both kinds (GatedDeltaProductMixer and MambaMixer) in one "
                                      "model are not supported")
    for kind, index, _ in blocks:
        if kind in ("gdp", "mamba2"):
            gdp_conv = int(checkpoint.info(_first(checkpoint, _conv_name(
                checkpoint, f"decoder.layers.{index}.mixer.", "weight"))).shape[-1])
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
        # MambaMixer without mamba_num_heads: d_inner = 2 · hidden (its expand), heads of mamba_head_dim
        mamba_num_heads=int(_arg(args, "mamba_num_heads", default=0) or 0) or
        2 * hidden // int(_arg(args, "mamba_head_dim", default=64)),
        gdp_num_householder=int(_arg(args, "gdp_num_householder", default=3)), gdp_conv_kernel_dim=gdp_conv,
        attention_output_gate=bool(_arg(args, "attention_output_gate", default=False)),
        rotary_dim=rotary_dim if rotary_dim != kv_channels else 0, rotary_interleaved=interleaved,
        **(_moe_config(args, hidden) if "E" in every else {}),
        moe_layers=[i for s, i in layers if s == "E"], normalization=normalization, add_bias_linear=bias,
        lead_mlps=lead)


def _moe_config(args: dict, hidden: int) -> dict:
    """The ``E`` layers' arguments, checked against the routings gdn_export computes: Megatron's ``TopKRouter`` with
    softmax, sigmoid or sqrtsoftplus scores, a scaling (Megatron's ``if scaling_factor:``: 0 or none is no scaling),
    an expert bias (sigmoid, sqrtsoftplus), groups scored by the sum of their top ``topk // group_topk``."""
    def refuse_if(condition: bool, what: str) -> None:
        if condition:
            raise MegatronCheckpointError(f"MoE layers with {what} are not supported (softmax, sigmoid or sqrtsoftplus "
                                          "top-k routing, groups of equal size each scored by the sum of its top "
                                          "topk // group_topk >= 1 scores; expert bias with sigmoid or sqrtsoftplus "
                                          "scores)")

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
    expert_count = int(_arg(args, "num_experts", default=0) or 0)
    # Megatron's TransformerConfig asserts equal groups and group_topk <= num_groups; a group scored by its top 0
    # (topk < group_topk) ties every group (torch.topk's pick among ties is unspecified), and a top beyond the
    # group's size makes Megatron's own topk raise: no Megatron run routes either
    refuse_if(groups > 1 and (expert_count % groups or not 1 <= group_topk <= groups
                              or not 1 <= top_k // group_topk <= expert_count // groups),
              f"moe_router_num_groups {groups}, moe_router_group_topk {group_topk} and moe_router_topk {top_k} "
              f"(a group scored by its top-{top_k // group_topk} sum)")
    experts = _arg(args, "num_experts", default=None)
    if not experts:
        raise MegatronCheckpointError("the layer pattern has MoE ('E') layers but the args give no num_experts")
    if not 0 < int(experts) <= MAX_EXPERTS:
        raise MegatronCheckpointError(f"num_experts {experts} in the args: 1 to {MAX_EXPERTS} experts are read")
    shared = int(_arg(args, "moe_shared_expert_intermediate_size", default=0) or 0)
    if shared and bool(_arg(args, "add_bias_linear", default=True)):
        raise MegatronCheckpointError("a shared expert with add_bias_linear is not supported: Megatron's "
                                      "SharedExpertMLP asserts add_bias_linear is off, so no Megatron release writes it")
    return dict(num_experts=int(experts), moe_router_topk=top_k,
                moe_ffn_hidden_size=int(_arg(args, "moe_ffn_hidden_size", "ffn_hidden_size", default=4 * hidden)),
                moe_router_pre_softmax=bool(_arg(args, "moe_router_pre_softmax", default=False)),
                moe_router_score_function=score, moe_router_expert_bias=bias, moe_router_scaling=scaling,
                moe_router_num_groups=groups, moe_router_group_topk=group_topk if groups > 1 else 1,
                moe_shared_expert_size=shared,
                moe_shared_expert_gate=bool(shared and _arg(args, "moe_shared_expert_gate", default=False)))


def _mtp_summary(checkpoint: MegatronCheckpoint) -> str:
    """The report's words for the MTP head a checkpoint's MTP block gives (``megatron.mtp.mtp_layout``)."""
    depths = mtp_depths(checkpoint)
    if depths <= 1:
        return ", an MTP head of 1 depth"
    if own_depths(checkpoint) == 1:
        return (f", an MTP head of 1 layer that Megatron runs at {depths} depths (mtp_use_repeated_layer), as "
                "chained drafts run it")
    deeper = "depth 2" if depths == 2 else f"depths 2 to {depths}"
    return (f", an MTP head of depth 1 of {depths} ({deeper}, with weights of {'its' if depths == 2 else 'their'} "
            "own, left out: an archive carries one MTP head, which every draft step runs)")


def zero_centred(args: dict) -> bool:
    """Megatron's norms compute with ``1 + w`` (Transformer Engine's ``zero_centered_gamma``)."""
    return bool(_arg(args, "apply_layernorm_1p", "layernorm_zero_centered_gamma", default=False))


def _conv_name(checkpoint: MegatronCheckpoint, where: str, param: str) -> str:
    """A mixer's conv ``weight`` / ``bias``: ``conv1d.<param>`` (an ``nn.Conv1d``, and every torch_dist save), or
    ``conv1d_<param>`` (``MambaMixer``'s own parameters, as its legacy ``state_dict`` names them)."""
    legacy = f"{where}conv1d_{param}"
    return legacy if checkpoint.has(legacy) else f"{where}conv1d.{param}"


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

    def put_norm(param: str, *names: str) -> None:
        norm_sources(checkpoint, config, shapes, put, param, *names)

    put("model.embeddings.weight", _whole(checkpoint, shapes["model.embeddings.weight"], "embedding.word_embeddings.weight"))
    put_norm("model.norm", "decoder.final_norm.weight", "decoder.final_layernorm.weight")
    if not config.tie_word_embeddings:
        put("lm_head.weight", _whole(checkpoint, shapes["lm_head.weight"], "output_layer.weight"))
    for b, (kind, index, mlps) in enumerate(config.blocks):
        layer, prefix = f"decoder.layers.{index}.", f"model.layers.{b}."
        mixer = model.model.layers[b].attn
        if kind == "attention":
            attention_layer_sources(checkpoint, config, shapes, put, prefix + "attn_norm", prefix + "attn.", layer)
            continue
        mamba = kind in ("gdp", "mamba2")  # a MambaLayer: its mixer and pre-norm names
        where = layer + ("mixer." if mamba else "self_attention.")
        put_norm(prefix + "attn_norm", where + "in_proj.layer_norm_weight",
                 layer + ("norm.weight" if mamba else "input_layernorm.weight"))
        sections = type(mixer).sections(config)
        for part, _ in sections:
            name = f"{prefix}attn.in_proj.{part}.weight"
            put(name, _sections_source(checkpoint, where + "in_proj.weight", sections, [part], shapes[name]))
        conv_parts = {"gdp": [f"V{i}" for i in range(config.gdp_num_householder)]
                      + [f"K{i}" for i in range(config.gdp_num_householder)] + ["Q"],
                      "mamba2": ["x", "B", "C"]}.get(kind, ["query", "key", "value"])
        conv_sections = [(p, s) for p, s in sections if p in conv_parts]
        put(prefix + "attn.conv.weight", _sections_source(checkpoint, _conv_name(checkpoint, where, "weight"),
                                                          conv_sections, conv_parts, shapes[prefix + "attn.conv.weight"]))
        params = ("A_log", "dt_bias") + (("D",) if kind == "mamba2" else ())
        for param in params:
            put(prefix + "attn." + param, _whole(checkpoint, shapes[prefix + "attn." + param], where + param))
        if kind == "mamba2":  # MambaMixer's conv always has a bias (its constructor asserts conv_bias)
            put(prefix + "attn.conv_bias", _sections_source(checkpoint, _conv_name(checkpoint, where, "bias"),
                                                             conv_sections, conv_parts, shapes[prefix + "attn.conv_bias"]))
        if mamba:
            put(prefix + "attn.norm", _whole(checkpoint, shapes[prefix + "attn.norm"], where + "norm.weight"))
        else:
            put_norm(prefix + "attn.out_norm", where + "out_norm.weight")
        put(prefix + "attn.out_proj.weight", _whole(checkpoint, shapes[prefix + "attn.out_proj.weight"],
                                                    where + "out_proj.weight"))
        for bias in ("in_proj.bias", "out_proj.bias") + (() if kind == "mamba2" else ("conv1d.bias",)):
            if any(n == where + bias or n.startswith(where + bias + ".") for n in checkpoint.names()):
                raise MegatronCheckpointError(f"{where + bias}: biases in the delta-rule mixers are not supported")
    # the MLP / MoE layers: after each block's mixer, and those before the first mixer (run on the embeddings)
    mlp_layers = [(f"model.layers.{b}.mlp_norms.{j}", f"model.layers.{b}.mlps.{j}.", index)
                  for b, (_, _, mlps) in enumerate(config.blocks) for j, index in enumerate(mlps)]
    mlp_layers += [(f"model.lead_norms.{j}", f"model.lead_mlps.{j}.", index) for j, index in enumerate(config.lead_mlps)]
    for norm, prefix, index in mlp_layers:
        mlp_layer_sources(checkpoint, config, shapes, put, norm, prefix, f"decoder.layers.{index}.",
                          index in config.moe_layers)
    zero_centred_norms(model, sources, checkpoint.args)
    check_sources(checkpoint, shapes, sources, "")
    skipped: Counter = Counter()
    for name in checkpoint.names():
        if name in used:
            continue
        if name.startswith("mtp."):  # read as the MTP head by megatron.mtp (checked there)
            skipped[MTP_TENSORS] += 1
        elif name.endswith("rotary_pos_emb.inv_freq") or name.endswith("_extra_state"):
            skipped["buffers"] += 1
        elif name == "output_layer.weight" and config.tie_word_embeddings:
            skipped["tied to the embedding table"] += 1
        else:
            raise MegatronCheckpointError(f"the checkpoint has {name}, which the model's arguments do not describe")
    return sources, skipped


def check_sources(checkpoint, shapes: dict, sources: dict, what: str) -> None:
    """Every parameter of ``shapes`` has a source, every piece is in the checkpoint, and a whole tensor has the
    parameter's shape (``what``: whose parameters, for the message)."""
    missing = sorted(set(shapes) - set(sources))
    if missing:
        raise MegatronCheckpointError(f"no checkpoint tensor for {what}{', '.join(missing[:5])}")
    for name, source in sources.items():
        for piece, rows in source.pieces:
            if not checkpoint.has(piece):  # a part of a fused tensor (rows of linear_qkv, ...) the args ask for
                raise MegatronCheckpointError(f"weights missing from the checkpoint: {piece}")
            info = checkpoint.info(piece)
            if rows is None and len(source.pieces) == 1 and info.shape != shapes[name]:
                raise MegatronCheckpointError(f"{piece} is {list(info.shape)} in the checkpoint; the model's "
                                              f"arguments give {list(shapes[name])}")


def norm_sources(checkpoint, config: MegatronConfig, shapes: dict, put, param: str, *names: str) -> None:
    """A norm's ``weight`` from the first of ``names`` the checkpoint holds and, for a LayerNorm, its ``bias``
    stored beside it (``...layer_norm_bias`` beside ``...layer_norm_weight``, ``<norm>.bias``)."""
    weight = _whole(checkpoint, shapes[param + ".weight"], *names)
    put(param + ".weight", weight)
    if config.normalization == "LayerNorm":
        put(param + ".bias", _whole(checkpoint, shapes[param + ".bias"],
                                    weight.pieces[0][0].removesuffix("weight") + "bias"))


def mlp_layer_sources(checkpoint, config: MegatronConfig, shapes: dict, put, norm: str, prefix: str, layer: str,
                      moe: bool) -> None:
    """One Megatron MLP or MoE layer (``layer``: its Megatron prefix, ``decoder.layers.<i>.``): its pre-norm as
    ``norm``, its ``MegatronMLP`` / ``MegatronMoE`` under ``prefix``."""
    norm_sources(checkpoint, config, shapes, put, norm, layer + "mlp.linear_fc1.layer_norm_weight",
                 layer + "pre_mlp_layernorm.weight")
    if moe:
        _moe_sources(checkpoint, config, layer + "mlp.", prefix, shapes, put)
    else:
        _mlp_sources(checkpoint, config, layer + "mlp.", prefix, put)


def attention_layer_sources(checkpoint, config: MegatronConfig, shapes: dict, put, norm: str, prefix: str,
                            layer: str) -> None:
    """One Megatron attention layer (``layer``: its Megatron prefix): its pre-norm as ``norm``, its attention
    under ``prefix``."""
    norm_sources(checkpoint, config, shapes, put, norm, layer + "self_attention.linear_qkv.layer_norm_weight",
                 layer + "input_layernorm.weight")
    _attention_sources(checkpoint, config, layer + "self_attention.", prefix, shapes, put)


def zero_centred_norms(model: nn.Module, sources: dict, args: dict) -> None:
    """With zero-centred norms, every norm Megatron builds from its config (``RMSNorm`` / ``LayerNorm`` modules of
    ``model``) reads ``1 + w`` (a LayerNorm's bias as stored); not GDP's gated norm."""
    if zero_centred(args):
        for name, module in model.named_modules():
            if isinstance(module, (RMSNorm, LayerNorm)):
                sources[name + ".weight"].offset = 1.0


def _mlp_sources(checkpoint, config: MegatronConfig, where: str, prefix: str, put) -> None:
    """A dense ``MLP``: SwiGLU ``linear_fc1`` = ``[gate; up]`` (or squared ReLU's ``up``), ``linear_fc2``; their
    biases with ``add_bias_linear`` (``linear_fc1.bias`` split as its weight)."""
    ffn, hidden = config.ffn_hidden_size, config.hidden_size
    fc1 = checkpoint.info(where + "linear_fc1.weight") if checkpoint.has(where + "linear_fc1.weight") else None
    swiglu = config.mlp_activation == "swiglu"
    if fc1 is None or fc1.shape != ((1 + swiglu) * ffn, hidden):
        raise MegatronCheckpointError(f"{where}linear_fc1.weight should be [{(1 + swiglu) * ffn}, {hidden}] "
                                      f"({config.mlp_activation}), got {fc1 and list(fc1.shape)}")
    parts = [("gate_proj", slice(0, ffn)), ("up_proj", slice(ffn, 2 * ffn))] if swiglu else [("up_proj", None)]
    biases = [("weight", (ffn, hidden))] + ([("bias", (ffn,))] if config.add_bias_linear else [])
    for param, rows in parts:
        for kind, shape in biases:
            name = f"{where}linear_fc1.{kind}"
            if not checkpoint.has(name):
                raise MegatronCheckpointError(f"weights missing from the checkpoint: {name}")
            put(f"{prefix}{param}.{kind}", MegatronSource(checkpoint, [(name, rows)], shape))
    put(prefix + "down_proj.weight", _whole(checkpoint, (hidden, ffn), where + "linear_fc2.weight"))
    if config.add_bias_linear:
        put(prefix + "down_proj.bias", _whole(checkpoint, (hidden,), where + "linear_fc2.bias"))


def _expert_pieces(checkpoint, where: str, linear: str, experts: int, param: str = "weight") -> list:
    """The routed experts' ``linear`` (``linear_fc1`` / ``linear_fc2``) ``param`` (``weight`` or ``bias``) in expert
    order: one stacked tensor ``experts.experts.<linear>.<param>`` (torch_dist, with the expert axis first, for
    sequential and grouped-GEMM experts alike), or one tensor per expert in a legacy checkpoint (``SequentialMLP``:
    ``experts.local_experts.<e>.<linear>.<param>``; ``TEGroupedMLP``: ``experts.<linear>.<param><e>``; the old
    ``GroupedMLP``'s ``weight1`` / ``weight2`` are cut into the latter when the checkpoint is opened)."""
    stacked = stacked_expert_name(where + "experts.", f"{linear}.{param}")
    if checkpoint.has(stacked):
        return [(stacked, None)]
    for layout in range(2):  # SequentialMLP's names, TEGroupedMLP's
        names = [expert_names(where + "experts.", f"{linear}.{param}", e)[layout] for e in range(experts)]
        if all(checkpoint.has(name) for name in names):
            return [(name, None) for name in names]
    raise MegatronCheckpointError(f"weights missing from the checkpoint: {stacked} (or the {experts} experts' "
                                  f"{where}experts.local_experts.<e>.{linear}.{param})")


def _moe_sources(checkpoint, config: MegatronConfig, where: str, prefix: str, shapes, put) -> None:
    """An ``E`` layer's ``MoELayer``: router, routed experts (``linear_fc1`` = ``[gate; up]`` per expert), shared
    expert and its gate; with ``add_bias_linear`` the router's and the routed experts' biases (Megatron's
    ``SharedExpertMLP`` refuses one)."""
    put(prefix + "router.weight", _whole(checkpoint, shapes[prefix + "router.weight"], where + "router.weight"))
    if config.add_bias_linear:
        put(prefix + "router.bias", _whole(checkpoint, shapes[prefix + "router.bias"], where + "router.bias"))
    if config.moe_router_expert_bias:
        put(prefix + "expert_bias", _whole(checkpoint, shapes[prefix + "expert_bias"], where + "router.expert_bias"))
    linears = [("gate_up_proj", "linear_fc1", "weight"), ("down_proj", "linear_fc2", "weight")]
    if config.add_bias_linear:
        linears += [("gate_up_bias", "linear_fc1", "bias"), ("down_bias", "linear_fc2", "bias")]
    for param, linear, kind in linears:
        name = f"{prefix}experts.{param}"
        put(name, MegatronSource(checkpoint, _expert_pieces(checkpoint, where, linear, config.num_experts, kind),
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
    """A q / k norm weight or LayerNorm bias (one per head channel) in ``head_channel_order``."""
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
    if config.add_qkv_bias or config.add_bias_linear:  # linear_qkv's bias, rows as its weight's
        for part in ("q", "k", "v") + (("gate",) if config.attention_output_gate else ()):
            put(f"{prefix}{part}_proj.bias", MegatronSource(checkpoint, [(where + "linear_qkv.bias", rows[part])],
                                                            shapes[f"{prefix}{part}_proj.bias"]))
    put(prefix + "o_proj.weight", _whole(checkpoint, shapes[prefix + "o_proj.weight"], where + "linear_proj.weight"))
    if config.add_bias_linear:
        put(prefix + "o_proj.bias", _whole(checkpoint, shapes[prefix + "o_proj.bias"], where + "linear_proj.bias"))
    if config.qk_layernorm:
        for which in ("q", "k"):
            for param in ("weight", "bias") if config.normalization == "LayerNorm" else ("weight",):
                put(f"{prefix}{which}_norm.{param}",
                    head_norm_source(checkpoint, config, f"{where}{which}_layernorm.{param}"))


def fused_blocks(config: MegatronConfig) -> dict[str, list[int]]:
    """The part sizes of every fused projection (packed ``in_proj``, its conv, SwiGLU ``linear_fc1``), by tensor:
    how a legacy tensor-parallel checkpoint's shards are merged (each rank holds its slice of every part)."""
    mixers = {"gdn": GatedDeltaNetMixer, "gdn2": GatedDeltaNet2Mixer, "gdp": GatedDeltaProductMixer,
              "mamba2": Mamba2Mixer}
    blocks: dict[str, list[int]] = {}
    for kind, index, _ in config.blocks:
        if kind in mixers:
            where = f"decoder.layers.{index}." + ("mixer." if kind in ("gdp", "mamba2") else "self_attention.")
            sections = mixers[kind].sections(config)
            conv = ("z", "beta", "alpha", "f", "b", "w", "a", "dt") + tuple(f"b{i}" for i in range(config.gdp_num_householder))
            blocks[where + "in_proj.weight"] = [size for _, size in sections]
            for name in ("conv1d.weight", "conv1d.bias", "conv1d_weight", "conv1d_bias"):  # _conv_name's names
                blocks[where + name] = [size for part, size in sections if part not in conv]
    for mlp in config.lead_mlps + [mlp for _, _, mlps in config.blocks for mlp in mlps]:
        where = f"decoder.layers.{mlp}.mlp."
        if mlp in config.moe_layers:  # every SwiGLU expert, as SequentialMLP and TEGroupedMLP name them
            for e in range(config.num_experts):
                for param in ("weight", "bias"):
                    for name in expert_names(where + "experts.", f"linear_fc1.{param}", e):
                        blocks[name] = [config.moe_ffn_hidden_size] * 2
            if config.moe_shared_expert_size:
                blocks[where + "shared_experts.linear_fc1.weight"] = [config.moe_shared_expert_size] * 2
        elif config.mlp_activation == "swiglu":
            blocks[where + "linear_fc1.weight"] = blocks[where + "linear_fc1.bias"] = [config.ffn_hidden_size] * 2
    return blocks


class MegatronWeights(CheckpointWeights):
    """``CheckpointWeights`` whose summary names the checkpoint's format and Megatron layer types; ``mtp``: the
    MTP head's depth 1 (``megatron.mtp.MegatronMTP``: its config, parts and sources), or None."""

    description: str = ""
    mtp: object | None = None
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
                   + (f", {config.moe_router_group_topk} of {config.moe_router_num_groups} groups by their top-"
                      f"{config.moe_router_topk // config.moe_router_group_topk} sum"
                      if config.moe_router_num_groups > 1 else "")
                   + (f", scaled by {config.moe_router_scaling:g}" if config.moe_router_scaling != 1 else ""))
        used.append(f"MoE ({config.num_experts} experts, top-{config.moe_router_topk} "
                    + routing
                    + (" before top-k" if config.moe_router_pre_softmax else "")
                    + (", gated shared expert" if config.moe_shared_expert_gate else
                       ", shared expert" if config.moe_shared_expert_size else "")
                    + (", router and expert biases" if config.add_bias_linear else "") + ")")
    attention = any(kind == "attention" for kind, _, _ in config.blocks)  # the args name these for any model
    if attention and config.attention_output_gate:
        used.append("gated attention output")
    if attention and config.rotary_dim:
        used.append(f"rotary on {config.rotary_dim} of {config.kv_channels} channels")
    if attention and config.rotary_interleaved:
        used.append("interleaved rotary (read as halves over reordered q/k channels)")
    if config.normalization == "LayerNorm":
        used.append("LayerNorm norms")
    if zero_centred(checkpoint.args):
        used.append("zero-centred (1 + w) norms")
    if config.add_bias_linear:
        used.append("linear biases (add_bias_linear)")
    if config.lead_mlps:
        used.append(f"{len(config.lead_mlps)} MLP / MoE layer(s) before the first mixer, run on the embeddings")
    sizes = {what: int(checkpoint.args.get(f"{key}_model_parallel_size", 1) or 1)
             for what, key in (("tensor", "tensor"), ("pipeline", "pipeline"), ("expert", "expert"))}
    context = int(checkpoint.args.get("context_parallel_size") or 1)
    parts = [f"{what}-parallel size {size}" for what, size in sizes.items()] + \
        ([f"context-parallel size {context}"] if context > 1 else [])
    saved = " saved with " + ", ".join(parts) if any(size > 1 for size in sizes.values()) or context > 1 else ""
    saved += " (ranks numbered tp-pp-dp)" if saved and checkpoint.args.get("use_tp_pp_dp_mapping") else ""
    virtual = int(checkpoint.args.get("virtual_pipeline_model_parallel_size") or 1)
    saved += f" ({virtual} virtual pipeline stages a rank)" if virtual > 1 else ""
    expert_tp = int(checkpoint.args.get("expert_tensor_parallel_size") or sizes["tensor"])
    saved += f" (experts: tensor-parallel size {expert_tp})" if config.moe_layers and expert_tp != sizes["tensor"] else ""
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
        _mtp_summary(checkpoint) + f" ({mtp.parts.words}; the decoder's layers)" if mtp
        else f", its MTP block left out: {mtp_left_out}" if mtp_left_out else "")
    weights.mtp, weights.checkpoint = mtp, checkpoint
    return FAMILY, layout, model, weights


__all__ = ["FAMILY", "MIXER_NAMES", "GatedDeltaNet2Mixer", "GatedDeltaNetMixer", "GatedDeltaProductMixer",
           "open_megatron", "read_config"]
