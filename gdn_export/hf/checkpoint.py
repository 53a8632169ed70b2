"""Reading a local Hugging Face checkpoint: config.json and safetensors only, never code, never pickle.

A checkpoint is matched against the family's model *before* any weight is read: the model is built with its
parameters on torch's meta device (no memory; buffers such as rotary tables are computed as usual), and every
parameter is paired with the checkpoint tensor that holds it (``CheckpointWeights``): renamed through the
published layout (``gdn_export.hf.layout``), strictly (a tensor missing, unknown or of another shape is a
CheckpointError). Weights are then read one tensor at a time: into a float32 model that fits in memory
(``load_model``, for the check), into one layer while it runs (the layer-by-layer check), or straight into the
export's ``.dat`` files (``gdn_export.pipeline.convert``) without a model in memory at all.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch
from torch import nn

from gdn_export.hf.layout import Layout, resolve_layout
from gdn_export.hf.tensors import CheckpointError, TensorEntry, TensorIndex
from gdn_export.models.mtp import PREFIX as MTP_PREFIX, SKIPPED as MTP_TENSORS

__all__ = ["CheckpointError", "CheckpointWeights", "copy_in_dtype", "empty_model", "load_model", "open_checkpoint",
           "read_config"]


def read_config(checkpoint_dir: str | os.PathLike) -> dict:
    folder = Path(checkpoint_dir)
    if not folder.is_dir():
        raise CheckpointError(f"{folder} is not a directory (expected a local checkpoint folder)")
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{folder} has no config.json (expected config.json + *.safetensors)")
    try:
        config = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as err:
        raise CheckpointError(f"{config_path} is not valid JSON: {err}") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise CheckpointError(f"{config_path} has no model_type")
    return config


# config.json fields that size the model: each, where present, an integer >= 1 (>= 0 for the counts that may be none)
POSITIVE_SIZES = ("hidden_size", "intermediate_size", "vocab_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "max_position_embeddings", "linear_key_head_dim",
                  "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads", "linear_conv_kernel_dim",
                  "linear_head_dim", "linear_num_heads", "moe_intermediate_size", "shared_expert_intermediate_size",
                  "num_experts_per_tok", "num_heads", "num_kv_heads", "num_v_heads", "conv_size", "qk_head_dim",
                  "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
COUNTS = ("num_experts", "num_shared_experts", "num_householder")
# of those, the sizes that are a tensor's dimension (or a count of tensors): none can exceed what the checkpoint
# holds, which is checked from the safetensors headers before the model is built (its parameters are allocated
# once, then moved to meta: a hidden_size of 10**9 would allocate terabytes before the shapes were compared)
TENSOR_SIZES = tuple(name for name in POSITIVE_SIZES + COUNTS
                     if name not in ("max_position_embeddings", "num_experts_per_tok"))


def check_config(config: dict, where: str = "config.json") -> None:
    """The model-sizing fields of ``config`` (a language model's): integers of the right range, or a CheckpointError
    naming the field."""
    for name in POSITIVE_SIZES + COUNTS:
        value = config.get(name)
        if value is None:
            continue
        low = 0 if name in COUNTS else 1
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise CheckpointError(f"{where}: {name} must be an integer >= {low}, got {json.dumps(value)[:60]}")


def check_config_against(config: dict, index: TensorIndex, where: str = "config.json") -> None:
    """Every size of ``config`` that is a tensor dimension (``TENSOR_SIZES``) within what ``index``'s tensors hold:
    at most their largest dimension or their count, checked before anything is allocated."""
    largest = max((d for entry in index for d in entry.shape), default=0)
    bound = max(largest, len(index))
    for name in TENSOR_SIZES:
        value = config.get(name)
        if isinstance(value, int) and value > bound:
            raise CheckpointError(f"{where}: {name} {value} is larger than any tensor of the checkpoint allows (its "
                                  f"largest dimension is {largest}, it holds {len(index)} tensors): config.json does "
                                  "not describe these weights")


def check_generation_config(folder: Path, vocab_size: int | None) -> None:
    """generation_config.json, where present: JSON whose token ids (eos, bos, pad) lie in the vocabulary."""
    path = folder / "generation_config.json"
    if not path.is_file():
        return
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as err:
        raise CheckpointError(f"{path} is not valid JSON: {err}") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path} must be a JSON object")
    for name in ("eos_token_id", "bos_token_id", "pad_token_id"):
        value = config.get(name)
        ids = value if isinstance(value, list) else [value] if value is not None else []
        for token in ids:
            if isinstance(token, bool) or not isinstance(token, int) or token < 0 or (
                    vocab_size is not None and token >= vocab_size):
                raise CheckpointError(f"{path}: {name} {json.dumps(value)[:60]} is not a token id of the "
                                      f"vocabulary [0, {vocab_size}) config.json gives")


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside get their parameters on the meta device (shapes only) and their buffers as usual."""
    register = nn.Module.register_parameter

    def on_meta(module, name, param):
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def empty_model(family, layout: Layout) -> nn.Module:
    """The family's model for ``layout``'s config, parameters on meta: nothing read, nothing allocated."""
    with parameters_on_meta():
        model = family.build(layout.config)
    return model.eval()


@dataclass
class CheckpointWeights:
    """The checkpoint tensor of every parameter of a model (by the model's parameter name), and what was left out.

    ``skipped`` counts the checkpoint's tensors not converted, by reason (vision tower, ignored by transformers,
    tied head). Tied parameters (one tensor under two names) are listed once, under the model's first name.
    """

    entries: dict[str, object]  # TensorEntry, or a ParameterSource made by a transformers conversion
    skipped: Counter = field(default_factory=Counter)
    layout: Layout | None = None
    carried: Counter = field(default_factory=Counter)  # tensors written apart from the model, by what carries them

    def carry_apart(self, reason: str, words: str) -> None:
        """The tensors ``skipped`` counted under ``reason`` are written after all, apart from the model (an MTP
        head's ``mtp.*``: its own member): the summary counts them under ``words`` instead of as left out."""
        count = self.skipped.pop(reason, 0)
        if count:
            self.carried[words] += count

    @classmethod
    def match(cls, index: TensorIndex, layout: Layout, model: nn.Module) -> "CheckpointWeights":
        from gdn_export.hf.conversion import parameter_sources

        expected = {name: tuple(p.shape) for name, p in model.named_parameters()}  # deduplicated: ties listed once
        aliases = {name for name, _ in model.named_parameters(remove_duplicate=False)} - set(expected)
        skipped: Counter = Counter()
        kept: dict[str, TensorEntry] = {}
        for entry in index:
            why = layout.left_out(entry.name)
            if why is not None:  # an MTP head's tensors counted apart: convert may carry them (carry_apart)
                skipped[MTP_TENSORS if entry.name.startswith(MTP_PREFIX) else why] += 1
            else:
                kept[layout.model_name(entry.name)] = entry
        sources, unexpected = parameter_sources(model, kept)
        entries = {}
        for name, source in sources.items():
            if name in aliases:  # a tied head stored anyway: transformers reads the table, so do we
                skipped["tied to the embedding table"] += 1
            elif name in expected:
                entries[name] = source
            # else a stored buffer (e.g. inv_freq): recomputed by the model, as transformers does
        missing = sorted(set(expected) - set(entries))
        if missing:
            raise CheckpointError(f"weights missing from the checkpoint: {', '.join(missing[:5])}"
                                  + (f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""))
        if unexpected:
            raise CheckpointError(f"the checkpoint has weights config.json does not describe: "
                                  f"{', '.join(sorted(unexpected)[:5])}"
                                  + (f" (+{len(unexpected) - 5} more)" if len(unexpected) > 5 else ""))
        mismatched = [f"{entries[k].name} {list(entries[k].shape)} in the checkpoint vs {list(v)} from config.json"
                      for k, v in expected.items() if tuple(entries[k].shape) != v]
        if mismatched:
            raise CheckpointError(f"weights disagree with config.json sizes: {', '.join(mismatched[:3])}")
        return cls(entries, skipped, layout)

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())

    def source_dtypes(self) -> Counter:
        return Counter(e.dtype for e in self.entries.values())

    def summary(self) -> str:
        """'N tensors (bf16 M, f32 K) from ... ; left out: ...' for the report."""
        dtypes = ", ".join(f"{k} {v}" for k, v in sorted(self.source_dtypes().items()))
        text = f"{len(self.entries)} tensors ({dtypes}, {self.nbytes / 2 ** 20:.1f} MiB)"
        if self.layout is not None and self.layout.wrapper:
            text += f" of the language model of a {self.layout.wrapper} checkpoint"
        if self.skipped:
            text += "; left out: " + ", ".join(f"{n} {why}" for why, n in sorted(self.skipped.items()))
        if self.carried:
            text += "; carried apart: " + ", ".join(f"{n} {what}" for what, n in sorted(self.carried.items()))
        return text


def open_checkpoint(checkpoint_dir: str | os.PathLike, family=None, config: dict | None = None):
    """``(family, layout, model, weights)`` for a Hugging Face checkpoint folder: its family, its layout, the empty
    model (parameters on meta) and every parameter's tensor, all checked; no weight is read. A folder of any source
    (Megatron too): ``gdn_export.checkpoints.open_checkpoint``."""
    from gdn_export.hf.families import family_for

    config = read_config(checkpoint_dir) if config is None else config
    layout = resolve_layout(config)
    where = "config.json" + ("'s text_config" if layout.wrapper else "")
    check_config(layout.config, where)
    family = family or family_for(layout.model_type)
    index = TensorIndex(checkpoint_dir)
    check_config_against(layout.config, index, where)
    check_generation_config(Path(checkpoint_dir), layout.config.get("vocab_size"))
    model = empty_model(family, layout)
    layout = layout.with_ignored(family.ignored_on_load())
    return family, layout, model, CheckpointWeights.match(index, layout, model)


def materialize(model: nn.Module, weights: CheckpointWeights, dtype: torch.dtype, *,
                placeholders: bool = False, prefix: str = "", exclude: str | None = None) -> nn.Module:
    """Give ``model``'s meta parameters under ``prefix`` (and not under ``exclude``) their values in ``dtype``, read
    from the checkpoint; with
    ``placeholders``, parameters of ``REAL_BYTES`` or more get uninitialized tensors of the right shape instead
    (untouched pages: no memory until written), for a trace whose weights are written from the checkpoint
    (``gdn_export.weights.streamed``). Ties are kept (one tensor)."""
    from gdn_export.models.derived import PLACEHOLDER
    from gdn_export.weights.streamed import REAL_BYTES

    names = {id(p): name for name, p in model.named_parameters()}
    done: dict[int, nn.Parameter] = {}
    for owner_name, owner in model.named_modules():
        for local, param in list(owner._parameters.items()):
            if param is None or param.device.type != "meta":
                continue
            name = names[id(param)]
            if not name.startswith(prefix) or (exclude is not None and name.startswith(exclude)):
                continue
            if id(param) not in done:
                large = param.numel() * dtype.itemsize >= REAL_BYTES
                value = torch.empty(param.shape, dtype=dtype) if placeholders and large else \
                    weights.entries[name].read(dtype)
                done[id(param)] = nn.Parameter(value, requires_grad=False)
                if placeholders and large:
                    setattr(done[id(param)], PLACEHOLDER, True)
            owner._parameters[local] = done[id(param)]
    return model


def release(model: nn.Module, prefix: str) -> None:
    """Put the parameters under ``prefix`` back on meta (the layer-by-layer check frees a layer once it ran)."""
    for name, owner in model.named_modules():
        if name == prefix.rstrip(".") or name.startswith(prefix):
            for local, param in list(owner._parameters.items()):
                if param is not None:
                    owner._parameters[local] = nn.Parameter(param.to("meta"), requires_grad=False)


def cast_buffers(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Floating buffers in ``dtype``, except rotary frequency tables: transformers keeps ``inv_freq`` in f32 in a
    half model (rounded to f16, cos/sin drift by ~0.5 at position 4096 with head_dim 128)."""
    for name, owner in model.named_modules():
        for local, buffer in list(owner._buffers.items()):
            if buffer is not None and buffer.is_floating_point() and not local.endswith("inv_freq"):
                owner._buffers[local] = buffer.to(dtype)
    return model


def load_model(checkpoint_dir: str | os.PathLike, family=None, config: dict | None = None,
               dtype: torch.dtype = torch.float32) -> nn.Module:
    """The family's eager model with every weight read from the checkpoint, in ``dtype`` (the whole model in
    memory: the check's reference where it fits)."""
    family, layout, _, weights = open_checkpoint(checkpoint_dir, family, config)
    return model_in_memory(family, layout, weights, dtype)


def model_in_memory(family, layout: Layout, weights: CheckpointWeights, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The family's eager model for ``layout`` with every weight of ``weights`` read, in ``dtype``."""
    return cast_buffers(materialize(empty_model(family, layout), weights, dtype), dtype)


def copy_in_dtype(hf_model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A copy of the model in ``dtype``, rotary frequency tables kept in f32 (see ``cast_buffers``); ties kept."""
    import copy

    model = copy.deepcopy(hf_model)
    with torch.no_grad():
        for param in model.parameters():  # deduplicated: a tied tensor is cast once, for both names
            if param.is_floating_point():
                param.data = param.data.to(dtype)
    return cast_buffers(model, dtype)
