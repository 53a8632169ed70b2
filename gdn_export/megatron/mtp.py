"""A Megatron checkpoint's multi-token-prediction (MTP) block as an MTP head (``models.mtp.MTPHead``): its inner
layers built by the Megatron decoder's own code (``megatron.model.MegatronMTPLayer``: ``Block``, ``build_mixer``,
``mlp_layers``), its tensors mapped by the decoder's own source functions (``megatron.family``).

Megatron's ``MultiTokenPredictionLayer`` (``megatron/core/transformer/multi_token_prediction.py``), one depth:

    x      = eh_proj( cat[ enorm(embedding(input_ids rolled left by 1)), hnorm(h) ] )     # embedding first
    x      = mtp_model_layer(x)          # a HybridModel: the MTP pattern after '/' (e.g. '*E'), a HybridStack
                                         # without final norm; a GPTModel: one TransformerLayer
    hidden = final_layernorm(x)
    logits = output_layer(hidden)        # the model's own head (process_mtp_loss)

``h`` is the decoder's output as ``HybridModel.forward`` / ``GPTModel.forward`` hand it to the MTP block: after the
decoder's final norm (``HybridStack.final_norm``, ``TransformerBlock.final_layernorm``; the fixture
``megatron_moe_mtp`` records it and checks it equal to ``final_norm``'s output). The rotary positions are the main
model's (0..S-1): position t embeds token t+1. That is what ``MTPHead`` computes with ``reads = "final_norm"``.

| Megatron (``mtp.layers.<d>.``) | ``MTPHead`` (``MTPParts`` of ``megatron_parts``) |
|---|---|
| ``enorm``, ``hnorm``, ``final_layernorm`` (weight, and bias for LayerNorm) | ``pre_fc_norm_embedding``, ``pre_fc_norm_hidden``, ``norm``: ``megatron_norm`` of the config |
| ``eh_proj.weight`` ``[H, 2H]`` (no bias: Megatron builds it with ``bias=False``) | ``fc.weight`` |
| the attention layer of ``mtp_model_layer.layers.<i>.`` (or ``transformer_layer.``) | ``layers.0.block.attn_norm``, ``layers.0.block.attn`` (the decoder's attention mapping) |
| each MLP / MoE layer after it | ``layers.0.block.mlp_norms.<j>``, ``layers.0.block.mlps.<j>`` (the decoder's MLP / MoE mapping) |

The inner layers live under ``mtp.layers.<d>.mtp_model_layer.layers.<i>.`` (HybridModel: ``<i>`` the MTP pattern's
layers) or ``mtp.layers.<d>.transformer_layer.`` (GPTModel, torch_dist; ``mtp_model_layer.`` in a legacy save).
Any MTP pattern of one attention layer followed by MLP / MoE layers is read, with whatever the decoder computes
(RMSNorm or LayerNorm, zero-centred or not, biases, output gate or not, partial rotary, q/k norms, every routing).
An MTP layer whose mixer is a delta-rule layer is left out with the reason: the MTP path's drafter cuts the head's
cache by length after each draft, which an attention KV cache allows and a recurrent state does not.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch

from gdn_export.megatron.checkpoint import MegatronCheckpoint, MegatronCheckpointError, MegatronSource
from gdn_export.megatron.model import MegatronConfig, MegatronMTPLayer, megatron_norm
from gdn_export.models.mtp import MTPConfig, MTPHead, MTPParts

PREFIX = "mtp.layers.0."


def mtp_depths(checkpoint: MegatronCheckpoint) -> int:
    """The MTP depths Megatron runs (``mtp_num_layers``; a HybridModel: its pattern's ``/`` parts)."""
    pattern = checkpoint.args.get("hybrid_layer_pattern") or checkpoint.args.get("hybrid_override_pattern")
    if isinstance(pattern, str) and pattern:
        return pattern.count("/")
    return int(checkpoint.args.get("mtp_num_layers") or 0)


def own_depths(checkpoint: MegatronCheckpoint) -> int:
    """The MTP depths with weights of their own (``mtp.layers.<d>.*``): 1 with ``mtp_use_repeated_layer``."""
    return 1 if checkpoint.args.get("mtp_use_repeated_layer", False) else mtp_depths(checkpoint)


def mtp_layout(checkpoint: MegatronCheckpoint, depth: int = 1) -> list[tuple[str, str]] | None:
    """``[(symbol, Megatron prefix)]`` of MTP depth ``depth``'s inner layers (``*`` attention, ``-`` MLP, ``E`` MoE,
    ``G`` / ``M`` delta-rule mixers), or None when the checkpoint has no MTP tensors. A HybridModel's MTP pattern is
    the part after ``/`` (every depth the same); a GPTModel's MTP layer is one ``TransformerLayer`` (a mixer and an
    MLP or MoE). Several depths of one layer (``mtp_use_repeated_layer``: Megatron builds and stores
    ``mtp.layers.0`` alone and runs it at every depth, each on the previous depth's output after its
    ``final_layernorm``, the ids rolled once more) are what the MTP path's chained drafts compute with the one
    head; depths with weights of their own are ``mtp.layers.<d - 1>.*``."""
    if not any(name.startswith("mtp.") for name in checkpoint.names()):
        return None
    args = checkpoint.args
    pattern = args.get("hybrid_layer_pattern") or args.get("hybrid_override_pattern")
    depths = mtp_depths(checkpoint)
    if own_depths(checkpoint) == 1 and any(name.startswith("mtp.layers.1.") for name in checkpoint.names()):
        raise MegatronCheckpointError(f"mtp.layers.1.* in a checkpoint of {depths} MTP depth(s) of one layer "
                                      "(mtp_num_layers, mtp_use_repeated_layer): the args do not describe it")
    for own in range(1, own_depths(checkpoint)):
        if not any(name.startswith(f"mtp.layers.{own}.") for name in checkpoint.names()):
            raise MegatronCheckpointError(f"the args give {depths} MTP depths with weights of their own "
                                          f"(mtp_use_repeated_layer off) but the checkpoint has no mtp.layers.{own}.*")
    if not 1 <= depth <= own_depths(checkpoint):
        raise MegatronCheckpointError(f"MTP depth {depth}: the checkpoint has {own_depths(checkpoint)} with weights "
                                      "of their own")
    base = f"mtp.layers.{depth - 1}."
    if isinstance(pattern, str) and pattern:
        parts = pattern.split("/")[1:]
        if len(set(parts)) != 1:
            raise MegatronCheckpointError(f"multi-token prediction pattern {'/'.join([''] + parts)!r} (in "
                                          f"{pattern!r}): MTP depths of different layers (Megatron builds one)")
        inner = base + "mtp_model_layer.layers."
        return [(symbol, f"{inner}{i}.") for i, symbol in enumerate(parts[0])]
    if depths < 1:
        raise MegatronCheckpointError("mtp_num_layers unset with mtp.* tensors: the args do not describe them")
    # torch_dist keeps the older module name (MultiTokenPredictionLayer.sharded_state_dict maps mtp_model_layer. to
    # transformer_layer.); a legacy save (state_dict) has the module's own
    inner = base + ("transformer_layer." if any(name.startswith(base + "transformer_layer.")
                                                for name in checkpoint.names()) else "mtp_model_layer.")
    if checkpoint.has(inner + "self_attention.linear_qkv.weight"):
        mixer = "*"
    elif any(name.startswith(inner + "self_attention.in_proj.") for name in checkpoint.names()):
        mixer = "G"  # GPTModel builds its MTP layer from the decoder's last layer spec
    else:
        raise MegatronCheckpointError(f"the MTP layer ({inner}) has no self_attention.linear_qkv or in_proj")
    return [(mixer, inner), ("E" if checkpoint.has(inner + "mlp.router.weight") else "-", inner)]


def mtp_model_config(config: MegatronConfig, layers: list[tuple[str, str]]) -> MegatronConfig:
    """The decoder's ``MegatronConfig`` for an MTP depth's layers (one block: the attention layer and the MLP /
    MoE layers after it); layers the head cannot carry are refused in one line."""
    symbols = "".join(symbol for symbol, _ in layers)
    mixer = next((s for s in symbols if s not in "*-E"), None)
    if mixer is not None:
        why = (f"a delta-rule mixer ({mixer!r}), whose state the MTP path's drafter could not cut back: it drops the "
               "chained drafts' entries from the head's cache by length (an attention KV cache)")
    elif not symbols.startswith("*") or symbols.count("*") != 1:
        why = "not one attention layer first (the head has one KV cache, its first layer's)"
    else:
        return dataclasses.replace(config, pattern=symbols, blocks=[("attention", 0, list(range(1, len(symbols))))],
                                   moe_layers=[i for i, s in enumerate(symbols) if s == "E"], lead_mlps=[],
                                   layer_types=["full_attention"])
    raise MegatronCheckpointError(f"multi-token prediction pattern '/{symbols}' has {why}: an MTP depth of one "
                                  "attention layer followed by MLP / MoE layers is read")


def megatron_parts(config: MegatronConfig) -> MTPParts:
    """``MTPHead``'s parts for a Megatron MTP depth of ``config`` (``mtp_model_config``): the config's norms and
    the decoder's own layers."""
    words = "MoE" if config.moe_layers else "dense MLP"
    return MTPParts(norm=lambda width: megatron_norm(config, width), layer=lambda: MegatronMTPLayer(config),
                    words=f"attention + {words}" if len(config.pattern) == 2 else f"layers {config.pattern}")


def mtp_head_config(config: MegatronConfig) -> MTPConfig:
    """The ``MTPConfig`` of an MTP depth of ``config`` (``mtp_model_config``): the cache's sizes and the report's."""
    moe = bool(config.moe_layers)
    return MTPConfig(
        hidden_size=config.hidden_size, vocab_size=config.vocab_size, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_query_groups, head_dim=config.kv_channels, rms_norm_eps=config.norm_eps,
        rope_theta=config.rotary_base, partial_rotary_factor=(config.rotary_dim or config.kv_channels) / config.kv_channels,
        intermediate_size=config.ffn_hidden_size, num_experts=config.num_experts if moe else 0,
        num_experts_per_tok=config.moe_router_topk if moe else 0,
        moe_intermediate_size=config.moe_ffn_hidden_size if moe else 0,
        shared_expert_intermediate_size=config.moe_shared_expert_size if moe else 0,
        norm_topk_prob=not config.moe_router_pre_softmax, tie_word_embeddings=config.tie_word_embeddings,
        num_layers=1)


@dataclasses.dataclass(frozen=True)
class MegatronMTP:
    """One MTP depth of a Megatron checkpoint: its head's config and parts, and every parameter's source."""

    config: MTPConfig
    parts: MTPParts
    sources: dict  # MTPHead parameter name -> MegatronSource (the embedding and output layer: the main model's)


def mtp_sources(checkpoint: MegatronCheckpoint, config: MegatronConfig, depth: int = 1) -> MegatronMTP | None:
    """MTP depth ``depth`` of the checkpoint (``MegatronMTP``), or None without an MTP block: every parameter of
    its head found and its shape checked, nothing read. Every tensor of that depth (``mtp.layers.<depth - 1>.*``)
    must make a parameter (one that does not is an error naming it), and every ``mtp.*`` tensor must belong to a
    depth the args give."""
    from gdn_export.hf.checkpoint import parameters_on_meta
    from gdn_export.megatron.family import (_whole, attention_layer_sources, check_sources, mlp_layer_sources,
                                            norm_sources, zero_centred_norms)

    layers = mtp_layout(checkpoint, depth)
    if layers is None:
        return None
    model_config = mtp_model_config(config, layers)
    parts = megatron_parts(model_config)
    head_config = mtp_head_config(model_config)
    with parameters_on_meta():
        shaped = MTPHead(head_config, torch.empty(config.vocab_size, config.hidden_size, device="meta"), None, parts)
    shapes = {name: tuple(p.shape) for name, p in shaped.named_parameters()
              if not name.startswith(("embed_tokens.", "lm_head.", "layers.0.expert_stacks."))}
    sources: dict[str, MegatronSource] = {}

    def put(name: str, source: MegatronSource) -> None:
        sources[name] = source

    base = f"mtp.layers.{depth - 1}."
    for norm, stored in (("pre_fc_norm_embedding", "enorm"), ("pre_fc_norm_hidden", "hnorm"),
                         ("norm", "final_layernorm")):
        norm_sources(checkpoint, model_config, shapes, put, norm, f"{base}{stored}.weight")
    put("fc.weight", _whole(checkpoint, shapes["fc.weight"], base + "eh_proj.weight"))
    (_, attention), *mlps = layers
    attention_layer_sources(checkpoint, model_config, shapes, put, "layers.0.block.attn_norm", "layers.0.block.attn.",
                            attention)
    for j, (symbol, where) in enumerate(mlps):
        mlp_layer_sources(checkpoint, model_config, shapes, put, f"layers.0.block.mlp_norms.{j}",
                          f"layers.0.block.mlps.{j}.", where, symbol == "E")
    zero_centred_norms(shaped, sources, checkpoint.args)
    check_sources(checkpoint, shapes, sources, "the MTP head's ")
    used = {piece for source in sources.values() for piece, _ in source.pieces}
    depths = tuple(f"mtp.layers.{d}." for d in range(own_depths(checkpoint)))
    for name in checkpoint.names():
        if not name.startswith("mtp.") or name in used or name.endswith(("_extra_state", "rotary_pos_emb.inv_freq")):
            continue
        if name.startswith(base) or not name.startswith(depths):
            raise MegatronCheckpointError(f"the checkpoint has {name}, which gdn_export's MTP head does not read "
                                          f"(an MTP depth: enorm, hnorm, eh_proj, the layers {model_config.pattern!r}, "
                                          "final_layernorm)")
    return MegatronMTP(head_config, parts, sources)


def read_megatron_mtp_head(folder: str | os.PathLike, dtype: torch.dtype = torch.float32,
                           checkpoint: MegatronCheckpoint | None = None, depth: int = 1) -> MTPHead | None:
    """The Megatron checkpoint's MTP depth ``depth`` as ``MTPHead`` (its embedding and output layer the main
    model's), or None when it has none; ``checkpoint``: the folder already opened (a conversion's), else opened
    here. Depth 1 is the archive's head; a depth d > 1 with weights of its own is read the same way (the torch
    reference of Megatron's depth d)."""
    from gdn_export.megatron.family import read_config

    checkpoint = checkpoint if checkpoint is not None else MegatronCheckpoint(Path(folder))
    config = read_config(checkpoint)
    found = mtp_sources(checkpoint, config, depth)
    if found is None:
        return None
    embed = checkpoint.read("embedding.word_embeddings.weight").to(dtype)
    output = None if config.tie_word_embeddings else checkpoint.read("output_layer.weight").to(dtype)
    head = MTPHead(found.config, embed, output, found.parts)
    params = dict(head.named_parameters())
    with torch.no_grad():
        for name, source in found.sources.items():
            params[name].copy_(source.read(torch.float32))
    head.layers[0].attach_stacks()  # the MoE layers' stacks from the weights just read
    return head.to(dtype).eval()


__all__ = ["MegatronMTP", "megatron_parts", "mtp_depths", "mtp_head_config", "mtp_layout", "mtp_model_config",
           "mtp_sources", "own_depths", "read_megatron_mtp_head"]
