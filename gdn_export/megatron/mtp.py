"""A Megatron checkpoint's multi-token-prediction (MTP) block as the published Hugging Face ``mtp.*`` head
(``models.mtp.MTPHead``): every Megatron MTP tensor mapped onto the name the MTP path reads.

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

| Megatron | published (``MTPHead``) |
|---|---|
| ``mtp.layers.0.enorm.weight`` | ``mtp.pre_fc_norm_embedding.weight`` |
| ``mtp.layers.0.hnorm.weight`` | ``mtp.pre_fc_norm_hidden.weight`` |
| ``mtp.layers.0.eh_proj.weight`` ``[H, 2H]`` | ``mtp.fc.weight`` |
| attention pre-norm (``...linear_qkv.layer_norm_weight`` / ``input_layernorm``) | ``mtp.layers.0.input_layernorm.weight`` |
| ``linear_qkv`` per query group ``[q.. | gate.. | k | v]`` | ``q_proj`` (per head ``[q | gate]``), ``k_proj``, ``v_proj`` |
| ``linear_proj``, ``q_layernorm``, ``k_layernorm`` | ``o_proj``, ``q_norm``, ``k_norm`` |
| MLP pre-norm (``pre_mlp_layernorm`` / ``...linear_fc1.layer_norm_weight``) | ``mtp.layers.0.post_attention_layernorm.weight`` |
| MoE ``router``, experts ``linear_fc1`` ``[E, 2I, H]`` / ``linear_fc2``, ``shared_experts.*``, ``gate_weight`` | ``mlp.gate``, ``mlp.experts.gate_up_proj`` / ``down_proj``, ``mlp.shared_expert.*``, ``mlp.shared_expert_gate`` |
| dense SwiGLU ``linear_fc1`` ``[gate; up]``, ``linear_fc2`` | ``mlp.gate_proj``, ``mlp.up_proj``, ``mlp.down_proj`` |
| ``mtp.layers.0.final_layernorm.weight`` | ``mtp.norm.weight`` |

The inner layer lives under ``mtp.layers.0.mtp_model_layer.layers.<i>.`` (HybridModel: ``<i>`` the MTP pattern's
layers) or ``mtp.layers.0.transformer_layer.`` (GPTModel, torch_dist; ``mtp_model_layer.`` in a legacy save). ``MTPHead`` computes one depth of Qwen3-Next's head:
zero-centred norms, a gated attention with q/k norms, softmax top-k routing with a gated shared expert (or a dense
SwiGLU MLP); a Megatron MTP block that computes anything else is refused in one line, never approximated.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from gdn_export.megatron.checkpoint import MegatronCheckpoint, MegatronCheckpointError, MegatronSource
from gdn_export.megatron.model import MegatronConfig
from gdn_export.models.mtp import MTPConfig, MTPError, MTPHead

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


def mtp_layout(checkpoint: MegatronCheckpoint) -> tuple[str, str] | None:
    """``(attention prefix, MLP prefix)`` of depth 1's inner layer, or None when the checkpoint has no MTP tensors.
    A HybridModel's MTP pattern (after ``/``) must be one attention layer then one MLP or MoE layer (``*E`` /
    ``*-``) at every depth; a GPTModel's MTP layer is one ``TransformerLayer``. Several depths of one layer
    (``mtp_use_repeated_layer``: Megatron builds and stores ``mtp.layers.0`` alone and runs it at every depth, each
    on the previous depth's output after its ``final_layernorm``, the ids rolled once more) are what the MTP path's
    chained drafts compute with the one head; of depths with weights of their own (``mtp.layers.1.*``, ...) depth 1
    is the head and the others are left out (``mtp_sources``; an archive carries one head)."""
    if not any(name.startswith("mtp.") for name in checkpoint.names()):
        return None
    args = checkpoint.args
    pattern = args.get("hybrid_layer_pattern") or args.get("hybrid_override_pattern")
    depths = mtp_depths(checkpoint)
    if own_depths(checkpoint) == 1 and any(name.startswith("mtp.layers.1.") for name in checkpoint.names()):
        raise MegatronCheckpointError(f"mtp.layers.1.* in a checkpoint of {depths} MTP depth(s) of one layer "
                                      "(mtp_num_layers, mtp_use_repeated_layer): the args do not describe it")
    for depth in range(1, own_depths(checkpoint)):
        if not any(name.startswith(f"mtp.layers.{depth}.") for name in checkpoint.names()):
            raise MegatronCheckpointError(f"the args give {depths} MTP depths with weights of their own "
                                          f"(mtp_use_repeated_layer off) but the checkpoint has no mtp.layers.{depth}.*")
    if isinstance(pattern, str) and pattern:
        parts = pattern.split("/")[1:]
        if len(set(parts)) != 1 or parts[0] not in ("*E", "*-"):
            raise MegatronCheckpointError(
                f"multi-token prediction pattern {'/'.join([''] + parts)!r} (in {pattern!r}): one MTP depth of one "
                "attention layer then one MLP or MoE layer ('/*E' or '/*-', Qwen3-Next's MTP layer) is supported")
        inner = PREFIX + "mtp_model_layer.layers."
        return inner + "0.", inner + "1."
    if depths < 1:
        raise MegatronCheckpointError("mtp_num_layers unset with mtp.* tensors: the args do not describe them")
    # torch_dist keeps the older module name (MultiTokenPredictionLayer.sharded_state_dict maps mtp_model_layer. to
    # transformer_layer.); a legacy save (state_dict) has the module's own
    inner = PREFIX + ("transformer_layer." if any(name.startswith(PREFIX + "transformer_layer.")
                                                  for name in checkpoint.names()) else "mtp_model_layer.")
    if not checkpoint.has(inner + "self_attention.linear_qkv.weight"):
        raise MegatronCheckpointError(f"the MTP layer ({inner}) has no self_attention.linear_qkv: GPTModel builds it "
                                      "from the decoder's last layer, and gdn_export's MTP head is an attention layer")
    return inner, inner


def mtp_config(config: MegatronConfig, checkpoint: MegatronCheckpoint, mlp: str) -> MTPConfig:
    """The ``MTPConfig`` of the model's MTP head; what ``MTPHead`` does not compute is refused in one line."""
    from gdn_export.megatron.family import zero_centred

    def refuse_if(condition: bool, what: str) -> None:
        if condition:
            raise MegatronCheckpointError(f"the MTP layer has {what}: gdn_export's MTP head computes Qwen3-Next's "
                                          "(zero-centred norms, gated attention with q/k norms, softmax top-k "
                                          "routing with a gated shared expert or a dense SwiGLU MLP)")

    moe = checkpoint.has(mlp + "mlp.router.weight")
    refuse_if(not zero_centred(checkpoint.args), "norms that are not zero-centred (apply_layernorm_1p off)")
    refuse_if(not config.attention_output_gate, "no attention output gate")
    refuse_if(not config.qk_layernorm, "no q/k norms")
    refuse_if(config.add_qkv_bias or config.add_bias_linear, "linear biases (add_qkv_bias / add_bias_linear)")
    refuse_if(config.normalization != "RMSNorm", f"{config.normalization} norms")
    refuse_if(config.mlp_activation != "swiglu", f"a {config.mlp_activation} MLP")
    if moe:
        refuse_if(config.moe_router_score_function != "softmax",
                  f"{config.moe_router_score_function} routing scores")
        refuse_if(config.moe_router_num_groups > 1 or config.moe_router_scaling != 1,
                  "grouped or scaled routing")
        refuse_if(not config.moe_shared_expert_gate, "no gated shared expert")
    return MTPConfig(
        hidden_size=config.hidden_size, vocab_size=config.vocab_size, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_query_groups, head_dim=config.kv_channels, rms_norm_eps=config.norm_eps,
        rope_theta=config.rotary_base, partial_rotary_factor=(config.rotary_dim or config.kv_channels) / config.kv_channels,
        intermediate_size=None if moe else config.ffn_hidden_size, num_experts=config.num_experts if moe else 0,
        num_experts_per_tok=config.moe_router_topk if moe else 0,
        moe_intermediate_size=config.moe_ffn_hidden_size if moe else 0,
        shared_expert_intermediate_size=config.moe_shared_expert_size if moe else 0,
        norm_topk_prob=not config.moe_router_pre_softmax, tie_word_embeddings=config.tie_word_embeddings,
        num_layers=1)


def mtp_sources(checkpoint: MegatronCheckpoint, config: MegatronConfig) -> tuple[MTPConfig, dict] | None:
    """``(MTPConfig, {published name: MegatronSource})`` of the checkpoint's MTP block, or None without one. Every
    ``mtp.*`` tensor of the checkpoint must make a published tensor (one that does not is an error naming it)."""
    from gdn_export.megatron.family import _expert_pieces, _whole, head_norm_source, qkv_rows

    layout = mtp_layout(checkpoint)
    if layout is None:
        return None
    attention, mlp = layout
    head = mtp_config(config, checkpoint, mlp)
    hidden, d, heads = config.hidden_size, config.kv_channels, config.num_attention_heads
    sources: dict[str, MegatronSource] = {}
    layer = "mtp.layers.0."

    def whole(name: str, shape, *megatron) -> None:
        sources[name] = _whole(checkpoint, tuple(shape), *megatron)

    whole("mtp.pre_fc_norm_embedding.weight", (hidden,), PREFIX + "enorm.weight")
    whole("mtp.pre_fc_norm_hidden.weight", (hidden,), PREFIX + "hnorm.weight")
    whole("mtp.fc.weight", (hidden, 2 * hidden), PREFIX + "eh_proj.weight")
    whole("mtp.norm.weight", (hidden,), PREFIX + "final_layernorm.weight")
    whole(layer + "input_layernorm.weight", (hidden,), attention + "self_attention.linear_qkv.layer_norm_weight",
          attention + "input_layernorm.weight")
    qkv = attention + "self_attention.linear_qkv.weight"
    if not checkpoint.has(qkv):
        raise MegatronCheckpointError(f"weights missing from the checkpoint: {qkv}")
    rows = qkv_rows(config)
    # published q_proj: per head [q (d) | gate (d)]; Megatron: per query group all its heads' q, then their gates
    per_head = [r for h in range(heads) for part in ("q", "gate") for r in rows[part][h * d:(h + 1) * d]]
    sources[layer + "self_attn.q_proj.weight"] = MegatronSource(checkpoint, [(qkv, per_head)], (2 * heads * d, hidden))
    for part in ("k", "v"):
        sources[f"{layer}self_attn.{part}_proj.weight"] = MegatronSource(
            checkpoint, [(qkv, rows[part])], (config.num_query_groups * d, hidden))
    whole(layer + "self_attn.o_proj.weight", (hidden, heads * d), attention + "self_attention.linear_proj.weight")
    for which in ("q", "k"):
        sources[f"{layer}self_attn.{which}_norm.weight"] = head_norm_source(
            checkpoint, config, f"{attention}self_attention.{which}_layernorm.weight")
    whole(layer + "post_attention_layernorm.weight", (hidden,), mlp + "pre_mlp_layernorm.weight",
          mlp + "mlp.linear_fc1.layer_norm_weight")
    if head.num_experts:
        experts, width, shared = head.num_experts, head.moe_intermediate_size, head.shared_expert_intermediate_size
        whole(layer + "mlp.gate.weight", (experts, hidden), mlp + "mlp.router.weight")
        for published, linear, shape in (("gate_up_proj", "linear_fc1", (experts, 2 * width, hidden)),
                                         ("down_proj", "linear_fc2", (experts, hidden, width))):
            sources[f"{layer}mlp.experts.{published}"] = MegatronSource(
                checkpoint, _expert_pieces(checkpoint, mlp + "mlp.", linear, experts), shape)
        fc1 = mlp + "mlp.shared_experts.linear_fc1.weight"
        whole(layer + "mlp.shared_expert.down_proj.weight", (hidden, shared), mlp + "mlp.shared_experts.linear_fc2.weight")
        whole(layer + "mlp.shared_expert_gate.weight", (1, hidden), mlp + "mlp.shared_experts.gate_weight")
        ffn, where = shared, layer + "mlp.shared_expert."
    else:
        fc1, ffn, where = mlp + "mlp.linear_fc1.weight", config.ffn_hidden_size, layer + "mlp."
        whole(where + "down_proj.weight", (hidden, ffn), mlp + "mlp.linear_fc2.weight")
    if not checkpoint.has(fc1):
        raise MegatronCheckpointError(f"weights missing from the checkpoint: {fc1}")
    for part, span in (("gate_proj", slice(0, ffn)), ("up_proj", slice(ffn, 2 * ffn))):
        sources[f"{where}{part}.weight"] = MegatronSource(checkpoint, [(fc1, span)], (ffn, hidden))
    used = {piece for source in sources.values() for piece, _ in source.pieces}
    # depths 2.. of their own weights: left out (the report says so), each as its args describe it
    deeper = tuple(f"mtp.layers.{d}." for d in range(1, own_depths(checkpoint)))
    for name in checkpoint.names():
        if name.startswith("mtp.") and name not in used and not name.endswith("_extra_state") and \
                not name.startswith(deeper or ("\0",)):
            raise MegatronCheckpointError(f"the checkpoint has {name}, which gdn_export's MTP head does not read "
                                          "(one MTP depth: enorm, hnorm, eh_proj, one attention and one MLP or MoE "
                                          "layer, final_layernorm)")
    for name, source in sources.items():
        if len(source.pieces) == 1 and source.pieces[0][1] is None:
            stored = tuple(checkpoint.info(source.pieces[0][0]).shape)
            if stored != tuple(source.shape):
                raise MegatronCheckpointError(f"{source.pieces[0][0]} is {list(stored)} in the checkpoint; the "
                                              f"model's arguments give {list(source.shape)} for {name}")
    return head, sources


def read_megatron_mtp_head(folder: str | os.PathLike, dtype: torch.dtype = torch.float32,
                           checkpoint: MegatronCheckpoint | None = None) -> MTPHead | None:
    """The Megatron checkpoint's MTP head as ``MTPHead`` (its embedding and output layer the main model's), or
    None when it has none; ``checkpoint``: the folder already opened (a conversion's), else opened here."""
    from gdn_export.megatron.family import read_config

    checkpoint = checkpoint if checkpoint is not None else MegatronCheckpoint(Path(folder))
    config = read_config(checkpoint)
    found = mtp_sources(checkpoint, config)
    if found is None:
        return None
    head_config, sources = found
    embed = checkpoint.read("embedding.word_embeddings.weight").to(dtype)
    output = None if config.tie_word_embeddings else checkpoint.read("output_layer.weight").to(dtype)
    head = MTPHead(head_config, embed, output)
    try:
        head.load_published({name: source.read(dtype) for name, source in sources.items()})
    except MTPError as err:
        raise MegatronCheckpointError(f"{folder}: {err}") from None
    return head.to(dtype).eval()


__all__ = ["mtp_config", "mtp_depths", "mtp_layout", "mtp_sources", "own_depths", "read_megatron_mtp_head"]
