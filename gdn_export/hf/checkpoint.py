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
        raise CheckpointError(f"the weights do not match config.json: {_first_line(err)}") from None
    missing = [k for k in info.get("missing_keys", []) if "rotary" not in k]
    mismatched = info.get("mismatched_keys", [])
    if mismatched:
        shown = ", ".join(f"{m[0]} {tuple(m[1])} vs {tuple(m[2])}" if len(m) == 3 else str(m) for m in mismatched[:3])
        raise CheckpointError(f"weights disagree with config.json sizes: {shown}")
    if missing:
        raise CheckpointError(f"weights missing from the checkpoint: {', '.join(sorted(missing)[:5])}")
    return model.eval()


def _first_line(err: Exception) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
