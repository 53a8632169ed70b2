"""The Hugging Face folder source (``gdn_export.checkpoints``): ``config.json`` and safetensors, transformers'
families and flash-linear-attention's (``hf/families/``). The last source tried: it takes any folder, and one without
``config.json`` gets its one-line error here."""

from __future__ import annotations

from pathlib import Path


def recognizes(folder: Path) -> bool:
    return (folder / "config.json").is_file()


def open_folder(folder: Path, family=None, config: dict | None = None):
    from gdn_export.hf.checkpoint import open_checkpoint

    return open_checkpoint(folder, family, config)


def read_config(folder: Path) -> dict:
    from gdn_export.hf.checkpoint import read_config as read

    return read(folder)


def families() -> list:
    from gdn_export.hf.families import all_families

    return all_families()
