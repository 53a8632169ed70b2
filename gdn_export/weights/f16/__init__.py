"""The f16 weight format: format.py (the registry's entry: options, validation, metadata; light) and codec.py (how a
tensor is stored, read back and lowered; numpy and torch). ``gdn_export.weights.f16.X`` is ``codec.X``, imported
on first use, so that the registry's light import of format.py does not load the codec."""

import importlib


def __getattr__(name: str):
    if name in ("format", "codec"):  # a submodule not imported yet: ``from ... import format`` imports it (no codec)
        raise AttributeError(name)
    return getattr(importlib.import_module(f"{__name__}.codec"), name)
