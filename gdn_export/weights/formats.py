"""Weight formats as units: the registry and the one protocol each format implements.

A format is a folder ``weights/<format>/``: ``format.py`` defines ``FORMAT``, a ``WeightFormat`` (light: no numpy, no
torch, so ``gdn-export --help`` lists the choices cheaply), and the folder's other modules hold its tensor code (how
a tensor is stored, read back and lowered in the graph), imported when a conversion uses them. ``FORMATS`` names the
folders; ``--quantize``'s choices and help, ``convert``'s validation of the options a format owns, the metadata an
archive records and reads back, the report's words, and which back-ends take the format all come from here: nothing
outside a format's folder tests a format's name.

The float format (``quantize=None``: every weight in the graph's dtype) is a format too (``weights/float/``), the
default.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable

from gdn_export.errors import GdnExportError, worded

# the folders of the formats --quantize names, in the CLI's order; the float format is the default (quantize=None)
FORMATS = ("q4_0", "int8", "f16")
FLOAT = "float"


@dataclass(frozen=True)
class OwnedOption:
    """An option of ``convert`` that only one format reads: its keyword, its default (not given), its flag and the
    flag's ``argparse`` keywords (type, choices, action, metavar, help: the CLI adds it from here)."""

    name: str
    default: Any
    flag: str
    cli: dict = field(default_factory=dict)


@dataclass(frozen=True)
class WeightFormat:
    """One weight format. ``name``: ``quantize=``'s value (None for the float format); ``label``: how ``info`` and
    the report name it; ``help``: its sentence of ``--quantize``'s help; ``reference``: what the conversion check's
    reference computes with (``"Q4_0"``: the same rounded weights); ``onnx_refusal``: why an ONNX export refuses it
    ("" when ONNX takes it); ``options``: the ``convert`` options it alone reads, and ``needs``: the (API, command
    line) wording of the error when one of them is given without this format. ``validate(dtype, runtime,
    quantize_embeddings)`` refuses what it cannot store with; ``resolve(options, calibration)`` checks and completes
    its own options in place (before any work); ``metadata(choice)`` (the plan's ``WeightChoice``: ``plan.weights``)
    is what an archive records of it (beside ``quantize``) and ``options_from_metadata(metadata)`` reads that back for ``check``. ``codec``: the module of
    its tensor code, imported on use (``codec_module()``)."""

    name: str | None
    help: str
    reference: str
    label: str = ""  # default: the name in capitals (Q4_0)
    codec: str = ""  # default: the folder's codec.py, gdn_export.weights.<name>.codec
    onnx_refusal: str = ""
    options: tuple[OwnedOption, ...] = ()
    needs: tuple[str, str] = ("", "")
    validate: Callable[[str, str, bool], None] = lambda dtype, runtime, quantize_embeddings: None
    resolve: Callable[[dict, Any], None] = lambda options, calibration: None
    metadata: Callable[[Any], dict] = lambda choice: {}
    options_from_metadata: Callable[[dict], dict] = lambda metadata: {}
    calibration_options: Callable[[Any], dict] = lambda choice: {}  # calibrate()'s keywords (a calibrated format's)

    def __post_init__(self) -> None:
        if self.name is not None:  # what a format of gdn_export's own folder derives from its name
            object.__setattr__(self, "label", self.label or self.name.upper())
            object.__setattr__(self, "codec", self.codec or f"gdn_export.weights.{self.name}.codec")

    def codec_module(self):
        return importlib.import_module(self.codec)


_REGISTRY: dict[str, WeightFormat] = {}


def register(fmt: WeightFormat) -> WeightFormat:
    """Add a format (its folder's ``format.py`` is listed in ``FORMATS``; a test may register one of its own)."""
    if fmt.name is None or fmt.name in _REGISTRY and _REGISTRY[fmt.name] is not fmt:
        raise GdnExportError(f"weight format {fmt.name!r} is registered twice or has no name")
    _REGISTRY[fmt.name] = fmt
    return fmt


def _load() -> dict[str, WeightFormat]:
    for folder in FORMATS:
        fmt = importlib.import_module(f"gdn_export.weights.{folder}.format").FORMAT
        _REGISTRY.setdefault(fmt.name, fmt)
    return _REGISTRY


def names() -> tuple[str, ...]:
    """``--quantize``'s choices."""
    return tuple(_load())


def weight_format(name: str | None) -> WeightFormat:
    """The format of ``quantize=name`` (None: the float format); an unknown name is a one-line error."""
    if name is None:
        return importlib.import_module(f"gdn_export.weights.{FLOAT}.format").FORMAT
    formats = _load()
    if name not in formats:
        raise GdnExportError(f"quantize {name!r} is not one of {', '.join(formats)}")
    return formats[name]


def all_formats() -> list[WeightFormat]:
    """The float format, then every registered one."""
    return [weight_format(None), *_load().values()]


def check_owned_options(name: str | None, options: dict, calibration: Any) -> None:
    """An option a format owns given (not its default) without that format: its one-line error. Then the chosen
    format checks and completes its own options (``resolve``)."""
    chosen = weight_format(name)
    given = {**options, "calibration": calibration}
    for fmt in all_formats():
        if fmt is chosen:
            continue
        if any(option.name in given and given[option.name] != option.default for option in fmt.options):
            api, cli = fmt.needs
            raise worded(GdnExportError(api), cli)
    chosen.resolve(options, calibration)


def codec_attributes(package: str) -> Callable[[str], Any]:
    """A format folder's module ``__getattr__``: ``gdn_export.weights.<format>.X`` is its ``codec.X``, imported on
    first use, so that importing the folder's light ``format.py`` (the registry does) loads no codec."""

    def attribute(name: str) -> Any:
        # a submodule not imported yet (``from ... import format`` then imports it alone), or a dunder probe
        # (``hasattr(module, "__all__")``, copy, pickle...): not the codec's, and never worth importing torch for
        if name in ("format", "codec") or name.startswith("_"):
            raise AttributeError(name)
        return getattr(importlib.import_module(f"{package}.codec"), name)

    return attribute


def unregister(name: str) -> None:
    """Remove a format ``register`` added (a test's own, when the test ends)."""
    if name in FORMATS:
        raise GdnExportError(f"weight format {name!r} is one of gdn_export's own: it cannot be removed")
    _REGISTRY.pop(name, None)


def quantize_help() -> str:
    return "; ".join(f"{fmt.name}: {fmt.help}" for fmt in _load().values())


__all__ = ["FLOAT", "FORMATS", "OwnedOption", "WeightFormat", "all_formats", "check_owned_options",
           "codec_attributes", "names", "quantize_help", "register", "unregister", "weight_format"]
