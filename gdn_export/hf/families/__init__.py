"""The Hugging Face families gdn_export converts, keyed by config.json's model_type."""

from __future__ import annotations

import importlib

from gdn_export.hf.checkpoint import CheckpointError
from gdn_export.hf.families.base import ExportableLM, Family, StateSpec

# one module per family, each defining FAMILY
FAMILY_MODULES = ("qwen3_5", "qwen3_next", "qwen3_5_moe", "olmo_hybrid", "qwen4_exp", "lara_mini", "kimi_linear",
                 "fla", "megatron")


def all_families() -> list[Family]:
    families = []
    for name in FAMILY_MODULES:
        try:
            module = importlib.import_module("gdn_export.megatron.family" if name == "megatron"
                                             else f"gdn_export.hf.families.{name}")
        except ModuleNotFoundError as err:
            if err.name == f"gdn_export.hf.families.{name}":
                continue  # not written yet
            raise
        families.append(module.FAMILY)
    return families


def family_for(model_type: str) -> Family:
    """The family of config.json's ``model_type``; a published wrapper's (``qwen3_5``) is its language model's."""
    from gdn_export.hf.layout import WRAPPERS

    if model_type in WRAPPERS:
        model_type = WRAPPERS[model_type].text_model_type
    for family in all_families():
        if model_type in family.model_types:
            return family
    known = sorted({t for f in all_families() for t in f.model_types} | set(WRAPPERS))
    raise CheckpointError(f"model_type {model_type!r} is not supported; gdn_export converts: {', '.join(known)}")


__all__ = ["CheckpointError", "ExportableLM", "Family", "StateSpec", "all_families", "family_for"]
