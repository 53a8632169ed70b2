"""The one table of where an exported file runs and in which float types: every runtime and dtype name the package
accepts, for every back-end. The bottom layer (no import of gdn_export, no numpy, no torch): the CLI's ``--help``
reads it, the run side and the converters validate against it. A torch type is ``getattr(torch, name)`` (the convert
side; this module imports no torch)."""

from __future__ import annotations

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


def numpy_dtype(name: str):
    """The numpy type of a float type name (``FLOAT_DTYPES``)."""
    import numpy as np

    if name not in FLOAT_DTYPES:
        raise KeyError(f"float type {name!r} is not one of {', '.join(FLOAT_DTYPES)}")
    return np.dtype(name)

