"""A Hugging Face checkpoint's multi-token-prediction head (``mtp.*`` of Qwen3.5, Qwen3.5-MoE, Qwen3-Next) as
``models.mtp.MTPHead``: the published names read from the safetensors headers, the embedding table and the LM head
shared with the language model (a published wrapper's ``model.language_model.*`` names included)."""

from __future__ import annotations

import os

import torch

from gdn_export.hf.checkpoint import read_config
from gdn_export.hf.layout import resolve_layout
from gdn_export.hf.tensors import CheckpointError, TensorIndex
from gdn_export.models.mtp import PREFIX, MTPConfig, MTPError, MTPHead

# the families whose published checkpoints carry an MTP head under mtp.*
MTP_FAMILIES = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")


def has_mtp(index: TensorIndex) -> bool:
    """Whether the checkpoint holds any ``mtp.*`` tensor."""
    return any(name.startswith(PREFIX) for name in index.entries)


def read_mtp_head(checkpoint_dir: str | os.PathLike, dtype: torch.dtype = torch.float32,
                  index: TensorIndex | None = None) -> MTPHead | None:
    """The checkpoint's MTP head in ``dtype``, or None when it has no ``mtp.*`` tensor. A checkpoint whose ``mtp.*``
    tensors or config do not make a head (another family, missing or misshapen tensors, ``mtp_num_hidden_layers``
    other than 1) is a ``CheckpointError`` naming what is wrong."""
    index = index if index is not None else TensorIndex(checkpoint_dir)
    if not has_mtp(index):
        return None
    layout = resolve_layout(read_config(checkpoint_dir))
    if layout.model_type not in MTP_FAMILIES:
        raise CheckpointError(f"{checkpoint_dir}: mtp.* tensors in a {layout.model_type} checkpoint; MTP heads are "
                              f"read for {', '.join(MTP_FAMILIES)}")
    by_model_name = {layout.model_name(name): entry for name, entry in index.entries.items()}
    try:
        config = MTPConfig.from_config(layout.config)
        embed = by_model_name.get("model.embed_tokens.weight")
        head = None if config.tie_word_embeddings else by_model_name.get("lm_head.weight")
        if embed is None or (head is None and not config.tie_word_embeddings):
            raise MTPError("the MTP head shares the model's embed_tokens and lm_head, and the checkpoint lacks one")
        mtp = MTPHead(config, embed.read(dtype), None if head is None else head.read(dtype))
        entries = {name: entry for name, entry in index.entries.items() if name.startswith(PREFIX)}
        declared, expected = sum(entry.numel for entry in entries.values()), mtp.published_numel()
        if declared > expected:  # checked from the headers: nothing read beyond what a head of this config holds
            raise MTPError(f"the mtp.* tensors hold {declared} values where an MTP head of this config holds "
                           f"{expected}: extra or oversized tensors")
        mtp.load_published({name: entry.read(dtype) for name, entry in entries.items()})
    except MTPError as err:
        raise CheckpointError(f"{checkpoint_dir}: {err}") from None
    return mtp.to(dtype).eval()
