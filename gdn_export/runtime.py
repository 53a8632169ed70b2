"""Running exported models in tract through its Python bindings (no tract binary anywhere)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import numpy as np

from gdn_export.errors import TractRuntimeError


def tract_version() -> str:
    """The version of the installed tract Python bindings, e.g. '0.23.9'."""
    import tract

    return tract.version()


def load_tract_model(path: str | os.PathLike):
    """Load a ``.nnef.tgz`` (or folder) with the transformers extension and make it runnable."""
    import tract

    path = Path(path)
    if not path.exists():
        raise TractRuntimeError(f"no model at {path}")
    try:
        model = tract.nnef().with_tract_transformers().load(str(path))
        return model.into_runnable()
    except Exception as err:  # tract raises plain Exceptions with its own message
        raise TractRuntimeError(f"tract could not load {path}: {err}") from err


def run_tract(path_or_runnable, inputs: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Run a model in tract on positional inputs (graph-input order); return its outputs as numpy arrays."""
    runnable = (
        load_tract_model(path_or_runnable) if isinstance(path_or_runnable, (str, os.PathLike)) else path_or_runnable
    )
    arrays = [np.ascontiguousarray(np.asarray(x)) for x in inputs]
    try:
        outputs = runnable.run(arrays)
    except Exception as err:
        raise TractRuntimeError(f"tract failed to run the model: {err}") from err
    return [o.to_numpy() for o in outputs]
