"""Checkpoint sources: where a model comes from, one registry entry each.

A source recognizes a folder and opens it into ``(family, layout, model, weights)``: the family, its layout, the
empty model (parameters on meta) and every parameter's tensor, checked, nothing read. The pipelines ask this registry
(``open_checkpoint``, ``family_for``), never a source by name, so a source is one module and one line of ``SOURCES``:

* ``recognizes(folder) -> bool``: cheap (a file or two looked at), never raises for a folder of another source;
* ``read_config(folder) -> dict``: the model's config as a Hugging Face ``config.json`` would hold it (its
  ``model_type`` names the family);
* ``open_folder(folder, family=None, config=None) -> (family, layout, model, weights)`` (``family`` and ``config``:
  what the caller already resolved from ``read_config``, not read again);
* ``families() -> list[Family]``: the families it builds (what ``family_for`` and ``gdn-export --help`` list).

The first source that recognizes a folder opens it; the last one (Hugging Face folders, ``config.json``) takes any
folder, so a folder no source knows gets its one-line error (no ``config.json``, ...). Sources sit above ``hf``
(checkpoint reading, the families) and below ``pipeline``: a source may import ``hf``, ``hf`` imports no source.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType


@dataclass(frozen=True)
class CheckpointSource:
    name: str    # what the source reads, as the documentation says it
    module: str  # defines recognizes(), open_folder(), families()

    def load(self) -> ModuleType:
        return importlib.import_module(self.module)


# in the order folders are tried: Megatron first (its folders have no config.json), Hugging Face last (any folder)
SOURCES = (
    CheckpointSource("Megatron-LM (torch_dist, legacy)", "gdn_export.megatron.source"),
    CheckpointSource("Hugging Face / flash-linear-attention folder (config.json + safetensors)",
                     "gdn_export.hf.source"),
)


def source_for(folder: str | os.PathLike) -> CheckpointSource:
    """The first source that recognizes ``folder`` (the last source, Hugging Face folders, takes any)."""
    for source in SOURCES[:-1]:
        if source.load().recognizes(Path(folder)):
            return source
    return SOURCES[-1]


def open_checkpoint(checkpoint_dir: str | os.PathLike, family=None, config: dict | None = None):
    """``(family, layout, model, weights)`` for a checkpoint folder of any source (``family`` and ``config``: what
    the caller already resolved from the source's ``read_config``)."""
    return source_for(checkpoint_dir).load().open_folder(Path(checkpoint_dir), family, config)


def read_config(checkpoint_dir: str | os.PathLike) -> dict:
    """The model's config of a checkpoint folder of any source, as config.json holds it."""
    return source_for(checkpoint_dir).load().read_config(Path(checkpoint_dir))


def all_families() -> list:
    """Every family of every source."""
    return [family for source in SOURCES for family in source.load().families()]


def family_for(model_type: str):
    """The family of ``model_type`` among every source's (config.json's, or a source's own such as Megatron's)."""
    from gdn_export.hf.families import family_for as find

    return find(model_type, all_families())


__all__ = ["SOURCES", "CheckpointSource", "all_families", "family_for", "open_checkpoint", "read_config", "source_for"]
