"""The Hugging Face families gdn_export converts, keyed by config.json's model_type (every source's families, Megatron's
too: ``gdn_export.checkpoints.all_families``)."""

from __future__ import annotations

import importlib

from gdn_export.hf.checkpoint import CheckpointError
from gdn_export.hf.families.base import ExportableLM, Family, StateSpec

# one module per family, each defining FAMILY
FAMILY_MODULES = ("qwen3_5", "qwen3_next", "qwen3_5_moe", "olmo_hybrid", "qwen4_exp", "lara_mini", "kimi_linear",
                 "fla")


def all_families() -> list[Family]:
    families = []
    for name in FAMILY_MODULES:
        try:
            module = importlib.import_module(f"gdn_export.hf.families.{name}")
        except ModuleNotFoundError as err:
            if err.name == f"gdn_export.hf.families.{name}":
                continue  # not written yet
            raise
        families.append(module.FAMILY)
    return families


def family_for(model_type: str, families: list[Family] | None = None) -> Family:
    """The family of config.json's ``model_type`` among ``families`` (default: the Hugging Face ones); a published
    wrapper's (``qwen3_5``) is its language model's."""
    from gdn_export.hf.layout import WRAPPERS

    families = all_families() if families is None else families
    if model_type in WRAPPERS:
        model_type = WRAPPERS[model_type].text_model_type
    for family in families:
        if model_type in family.model_types:
            return family
    known = sorted({t for f in families for t in f.model_types} | set(WRAPPERS))
    raise CheckpointError(f"model_type {model_type!r} is not supported; gdn_export converts: {', '.join(known)}")


__all__ = ["CheckpointError", "ExportableLM", "Family", "StateSpec", "all_families", "family_for"]
