"""The f16 weight format: format.py (the registry's entry: options, validation, metadata; light) and codec.py (how a
tensor is stored, read back and lowered; numpy and torch). ``gdn_export.weights.f16.X`` is ``codec.X``, imported
on first use (``formats.codec_attributes``)."""

from gdn_export.weights.formats import codec_attributes

__getattr__ = codec_attributes(__name__)
