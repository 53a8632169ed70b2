"""The one protocol every runner of an exported file implements, whatever its back-end, and the table that picks a
runner by the file's suffix: ``Session`` (a ``.nnef.tgz`` in tract) and ``OnnxSession`` (a ``.onnx`` in onnxruntime
or tract's ONNX loader). The conversion check takes any ``Runner`` and opens files through ``open_runner``;
``perplexity`` still chooses by suffix itself (it passes each runner options of its own)."""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class Runner(Protocol):
    """Token ids in, logits out, the recurrent states and caches carried between calls.

    ``metadata``: the file's gdn_export metadata (states, vocab_size, dtype...); ``prefill(ids [B, S])`` runs S >= 1
    new tokens and returns their logits (``[B, S, vocab]``, or the last position's for a ``--logits last`` archive);
    ``decode(ids [B, 1])`` one token; ``reset()`` forgets the states."""

    path: Path
    metadata: dict

    def reset(self) -> None: ...

    def prefill(self, input_ids) -> np.ndarray: ...

    def decode(self, input_ids) -> np.ndarray: ...


# file suffix -> (module, class) of its runner; the first suffix a file's name ends with
RUNNERS = ((".onnx", ("gdn_export.run.onnx_session", "OnnxSession")),
           (".nnef.tgz", ("gdn_export.run.session", "Session")),
           (".tgz", ("gdn_export.run.session", "Session")))


def runner_class(path: str | os.PathLike) -> type:
    """The runner of ``path`` by its suffix (an unknown suffix: an archive, as ``Session`` reads any tar.gz)."""
    name = Path(path).name
    module, cls = next((target for suffix, target in RUNNERS if name.endswith(suffix)), RUNNERS[-1][1])
    return getattr(importlib.import_module(module), cls)


def open_runner(path: str | os.PathLike, **options) -> Runner:
    """The runner of ``path`` with ``options`` (``Session``'s ``progress``..., ``OnnxSession``'s ``runtime``)."""
    return runner_class(path)(path, **options)


__all__ = ["RUNNERS", "Runner", "open_runner", "runner_class"]
