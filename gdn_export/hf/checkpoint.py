"""Reading a local Hugging Face checkpoint: config.json and safetensors only, never code, never pickle."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from gdn_export.errors import GdnExportError

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


class CheckpointError(GdnExportError):
    """The checkpoint folder is missing, malformed, unsupported or inconsistent."""


def read_config(checkpoint_dir: str | os.PathLike) -> dict:
    folder = Path(checkpoint_dir)
    if not folder.is_dir():
        raise CheckpointError(f"{folder} is not a directory (expected a local checkpoint folder)")
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{folder} has no config.json (expected config.json + *.safetensors)")
    try:
        config = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{config_path} is not valid JSON: {err}") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise CheckpointError(f"{config_path} has no model_type")
    return config


def safetensors_files(checkpoint_dir: str | os.PathLike) -> list[Path]:
    """The checkpoint's safetensors files, each checked to open and to hold whole tensors."""
    from safetensors import safe_open

    folder = Path(checkpoint_dir)
    files = sorted(folder.glob("*.safetensors"))
    _check_index(folder)
    if not files:
        pickles = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickles:
            raise CheckpointError(
                f"{folder} holds only pickle weights ({', '.join(pickles)}); gdn_export reads safetensors only "
                "(pickle files can run code when loaded). Convert them to safetensors first."
            )
        raise CheckpointError(f"{folder} has no *.safetensors weights")
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as handle:
                for key in handle.keys():
                    handle.get_slice(key)  # the header's offsets must fit the file
        except Exception as err:  # safetensors raises its own error types
            raise CheckpointError(f"{path.name} is truncated or not a safetensors file: {err}") from None
        _check_offsets(path)
    return files


INDEX_FILE = "model.safetensors.index.json"


def _check_index(folder: Path) -> None:
    """A sharded checkpoint's index must be readable and every shard it names present."""
    index = folder / INDEX_FILE
    if not index.is_file():
        return
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        shards = sorted(set(weight_map.values()))
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError):
        raise CheckpointError(f"{index} is not a valid safetensors index (expected JSON with a weight_map)") from None
    missing = [name for name in shards if not (folder / name).is_file()]
    if missing:
        raise CheckpointError(f"{folder} is missing {len(missing)} of the {len(shards)} shards named in {INDEX_FILE}: "
                              f"{', '.join(missing[:3])}" + (" ..." if len(missing) > 3 else ""))


def _check_offsets(path: Path) -> None:
    """safetensors opens lazily: compare the header's data end with the file size to catch truncation."""
    with path.open("rb") as handle:
        header_len = int.from_bytes(handle.read(8), "little")
        try:
            header = json.loads(handle.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise CheckpointError(f"{path.name} has a malformed safetensors header") from None
    data_end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    actual = path.stat().st_size - 8 - header_len
    if actual < data_end:
        raise CheckpointError(f"{path.name} is truncated: its header needs {data_end} bytes of data, the file has {actual}")


def load_model(checkpoint_dir: str | os.PathLike, family, config: dict) -> torch.nn.Module:
    """Build the family's transformers model from config.json and load the safetensors weights into it (f32).

    Every weight must be present with the shape the config implies: a missing or mis-shaped tensor is an
    error, never a random initialization.
    """
    safetensors_files(checkpoint_dir)
    own_loader = getattr(family, "load", None)
    if own_loader is not None:  # families with no transformers classes (FLA) build their model themselves
        return own_loader(checkpoint_dir, config)
    config_class, model_class = family.classes()
    fields = {k: v for k, v in config.items() if k not in ("auto_map",)}
    try:
        hf_config = config_class(**fields)
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"config.json does not describe a {family.name} model: {err}") from None
    try:
        model, info = model_class.from_pretrained(
            str(checkpoint_dir), config=hf_config, dtype=torch.float32, use_safetensors=True,
            trust_remote_code=False, output_loading_info=True, local_files_only=True,
        )
    except (RuntimeError, ValueError, OSError) as err:
        mismatched = _shape_mismatches(checkpoint_dir, model_class, hf_config)
        if mismatched:
            raise CheckpointError(f"weights disagree with config.json sizes: {', '.join(mismatched[:3])}") from None
        raise CheckpointError(f"the weights do not match config.json: {_first_line(err)}") from None
    missing = [k for k in info.get("missing_keys", []) if "rotary" not in k]
    mismatched = info.get("mismatched_keys", [])
    if mismatched:
        shown = ", ".join(f"{m[0]} {tuple(m[1])} vs {tuple(m[2])}" if len(m) == 3 else str(m) for m in mismatched[:3])
        raise CheckpointError(f"weights disagree with config.json sizes: {shown}")
    if missing:
        raise CheckpointError(f"weights missing from the checkpoint: {', '.join(sorted(missing)[:5])}")
    return model.eval()


def read_safetensors(checkpoint_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint's safetensors files (one or several shards), by name."""
    from safetensors import safe_open

    tensors: dict[str, torch.Tensor] = {}
    for path in safetensors_files(checkpoint_dir):
        with safe_open(str(path), framework="pt") as handle:
            for key in handle.keys():
                if key in tensors:
                    raise CheckpointError(f"tensor {key} appears in more than one safetensors file")
                tensors[key] = handle.get_tensor(key)
    return tensors


def assign_weights(model: torch.nn.Module, tensors: dict[str, torch.Tensor], ignore: tuple[str, ...] = ()) -> None:
    """Copy ``tensors`` into ``model``'s parameters and buffers by name, cast to their dtype.

    Strict: a missing, unexpected or mis-shaped tensor is a CheckpointError (the config then describes
    another model than the weights). Names in ``ignore`` may be present or not (tied weights).
    """
    expected = model.state_dict()
    missing = sorted(k for k in expected if k not in tensors and k not in ignore)
    unexpected = sorted(k for k in tensors if k not in expected)
    if missing:
        raise CheckpointError(f"weights missing from the checkpoint: {', '.join(missing[:5])}"
                              + (f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""))
    if unexpected:
        raise CheckpointError(f"the checkpoint has weights config.json does not describe: {', '.join(unexpected[:5])}"
                              + (f" (+{len(unexpected) - 5} more)" if len(unexpected) > 5 else ""))
    mismatched = [f"{k} {tuple(tensors[k].shape)} vs {tuple(v.shape)}" for k, v in expected.items()
                  if k in tensors and k not in ignore and tensors[k].shape != v.shape]
    if mismatched:
        raise CheckpointError(f"weights disagree with config.json sizes: {', '.join(mismatched[:3])}")
    with torch.no_grad():
        for key, target in expected.items():
            if key in tensors and key not in ignore:
                target.copy_(tensors[key].to(target.dtype))


def _shape_mismatches(checkpoint_dir, model_class, hf_config) -> list[str]:
    """'name (checkpoint shape) vs (config shape)' for tensors named alike in the files and the model."""
    try:
        with torch.device("meta"):
            expected = {k: tuple(v.shape) for k, v in model_class(hf_config).state_dict().items()}
    except Exception:  # a config transformers cannot even build: the caller reports the original error
        return []
    mismatched = []
    for path in safetensors_files(checkpoint_dir):
        with path.open("rb") as handle:
            header = json.loads(handle.read(int.from_bytes(handle.read(8), "little")))
        for name, entry in header.items():
            if name in expected and tuple(entry["shape"]) != expected[name]:
                mismatched.append(f"{name} {tuple(entry['shape'])} in the checkpoint vs {expected[name]} from config.json")
    return mismatched


def _first_line(err: Exception) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def copy_in_dtype(hf_model, dtype: torch.dtype):
    """The model in ``dtype``, except rotary frequency tables: transformers keeps ``inv_freq`` in f32 in a
    half model (rounded to f16, cos/sin drift by ~0.5 at position 4096 with head_dim 128)."""
    import copy

    model = copy.deepcopy(hf_model)
    kept = {name: buffer.clone() for name, buffer in model.named_buffers() if name.endswith("inv_freq")}
    model = model.to(dtype)
    for name, buffer in kept.items():
        owner = model.get_submodule(name.rpartition(".")[0])
        setattr(owner, name.rpartition(".")[2], buffer)
    return model
