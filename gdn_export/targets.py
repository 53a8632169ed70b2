"""The one table of the back-ends (``BACKENDS``: each output format, its suffix, where its files run, what writes and
runs them) and of the float types: every format, runtime and dtype name the package accepts. The bottom layer (no
import of gdn_export but its errors, no numpy, no torch): the CLI's ``--help`` reads it, the run side and the
converters choose and validate against it. A torch type is ``getattr(torch, name)`` (the convert side; this module
imports no torch)."""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gdn_export.errors import GdnExportError, worded

# --runtime of an NNEF export: where tract will run the archive (the gated delta rule's policy keys its lowering
# order by these; "any": no runtime-specific lowering)
NNEF_RUNTIMES = ("any", "cpu", "cuda")
# --runtime of an ONNX export: what will run the .onnx ("any": only what both run)
ONNX_RUNTIMES = ("onnxruntime", "tract-onnx", "any")
# what an OnnxSession runs a .onnx with (an export's "any" is a promise about the file, not a runner)
ONNX_RUNNERS = tuple(r for r in ONNX_RUNTIMES if r != "any")
# every --runtime, in the CLI's order
ALL_RUNTIMES = NNEF_RUNTIMES + tuple(r for r in ONNX_RUNTIMES if r not in NNEF_RUNTIMES)

# the float types a graph computes in (--dtype), by the name torch, numpy and the archive's metadata share
FLOAT_DTYPES = ("float32", "float16")
# tract's NNEF datum type of each float type (tract_core_cast's "to", a .dat file's variable)
NNEF_DATUM = {"float16": "f16", "float32": "f32", "float64": "f64"}


def parse_version(version: str) -> tuple[int, int, int]:
    """A tract version: '0.23.9' -> (0, 23, 9); raises ValueError naming the bad string."""
    parts = str(version).strip().lstrip("v").split(".")
    try:
        numbers = tuple(int(p) for p in parts[:3])
    except ValueError:
        raise ValueError(f"tract version {version!r} is not of the form MAJOR.MINOR.PATCH") from None
    if len(numbers) != 3:
        raise ValueError(f"tract version {version!r} is not of the form MAJOR.MINOR.PATCH")
    return numbers  # type: ignore[return-value]


def numpy_dtype(name: str):
    """The numpy type of a float type name (``FLOAT_DTYPES``)."""
    import numpy as np

    if name not in FLOAT_DTYPES:
        raise KeyError(f"float type {name!r} is not one of {', '.join(FLOAT_DTYPES)}")
    return np.dtype(name)



@dataclass(frozen=True)
class BackendOption:
    """An option of ``convert`` (its ``flag``) or of ``export`` (``export``) that only one back-end takes: any other
    refuses it when given (``refuse_others``), rather than ignoring it. ``why``: the command line's reason; ``shown``:
    convert's error shows the value given; ``truthy``: given when true (a switch), else when not None."""

    name: str
    flag: str | None
    why: str = ""
    shown: bool = True
    export: bool = False
    truthy: bool = False

    def given(self, options: dict) -> bool:
        value = options.get(self.name)
        return bool(value) if self.truthy else value is not None


@dataclass(frozen=True)
class Backend:
    """One output format, as one unit: the pieces that write, convert and run its files, named ``"module:attribute"``
    and imported on first use (``load``), so that reading the table imports nothing (the CLI's ``--help``, the run
    side).

    ``name``: ``format=`` / ``--format``; ``suffix``: its files' (what ``backend_for`` chooses by); ``runtimes``:
    ``--runtime``'s choices for it; ``help``: the CLI's words; ``export``: ``gdn_export.export(format=name)`` (the
    ops' registrations and plan, then the back-end's export loop, ``backends/<name>/``); ``steps``: ``convert``'s
    steps (``pipeline.convert.run_plan``); ``runner``: the ``run.runner.Runner`` that runs its files; ``metadata``:
    reads a file's gdn_export metadata (None where it has none) without running it; ``owns``: the options only it
    takes (every other back-end refuses them, ``refuse_others``)."""

    name: str
    suffix: str
    runtimes: tuple[str, ...]
    help: str
    export: str
    steps: str
    runner: str
    metadata: str
    owns: tuple[BackendOption, ...] = ()


Q4_0 = "tract's Q4_0 format"
BACKENDS: tuple[Backend, ...] = (  # the first is the default: a file of no known suffix is an NNEF archive (tar.gz)
    Backend("nnef", ".nnef.tgz", NNEF_RUNTIMES, "nnef (.nnef.tgz for tract)", "gdn_export.pipeline.export:to_nnef",
            "gdn_export.pipeline.convert:NNEF", "gdn_export.run.session:Session",
            "gdn_export.run.reading:read_metadata",
            owns=(  # in the order the command line lists them (the first given is the one refused)
                BackendOption("quantize_embeddings", "--quantize-embeddings", Q4_0, shown=False, truthy=True),
                BackendOption("q4_rule", "--q4-rule", Q4_0),
                BackendOption("calibration", "--calibration", Q4_0, shown=False),
                BackendOption("core_dtype", "--core-dtype", "tract's fused op only", export=True),
                BackendOption("chunk_size", "--chunk-size", "tract's chunked lowering only", export=True),
                BackendOption("tail_chunk", "--tail-chunk", "tract's chunked lowering only", export=True),
                BackendOption("tract_version", "--tract-version", "an ONNX file is not for one tract version",
                              export=True),
                BackendOption("weights", None, export=True),  # streamed weights: NNEF's writers
                BackendOption("extra_files", None, export=True),  # files beside the graph in the archive
            )),
    Backend("onnx", ".onnx", ONNX_RUNTIMES, "onnx (.onnx)", "gdn_export.pipeline.export:to_onnx",
            "gdn_export.pipeline.onnx_convert:ONNX", "gdn_export.run.onnx_session:OnnxSession",
            "gdn_export.run.onnx_session:read_onnx_metadata"),
)


def backend_named(name: str) -> Backend:
    """The back-end of ``format=name``; GdnExportError naming the formats there are."""
    for backend in BACKENDS:
        if backend.name == name:
            return backend
    raise GdnExportError(f"format {name!r} is not one of {', '.join(b.name for b in BACKENDS)}")


def backend_for(path: str | os.PathLike) -> Backend:
    """The back-end whose suffix ``path``'s name ends with (none: the first, an NNEF archive: tract reads any
    tar.gz)."""
    name = Path(path).name
    return next((backend for backend in BACKENDS if name.endswith(backend.suffix)), BACKENDS[0])


def load(reference: str) -> Any:
    """The attribute a ``"module:attribute"`` reference of the table names (its module imported)."""
    module, _, attribute = reference.partition(":")
    return getattr(importlib.import_module(module), attribute)


def refuse_others(name: str, options: dict, *, export: bool = False) -> None:
    """Refuse the first option of ``options`` given that another back-end owns and back-end ``name`` does not take:
    GdnExportError in the API's words (``export``: ``gdn_export.export``'s keywords, else ``convert``'s), worded for
    the command line too."""
    for other in BACKENDS:
        for option in () if other.name == name else other.owns:
            if (option.export if export else option.flag is not None) and option.given(options):
                shown = f"={options[option.name]!r}" if option.shown and not export else ""
                raise worded(GdnExportError(f"{option.name}{shown} is an {other.name.upper()} option: not available "
                                            f"with format={name!r}"),
                             f"{option.flag} is not available with --format {name} ({option.why})")
