"""The one protocol every runner of an exported file implements, whatever its back-end, and ``open_runner``, which
picks a runner by the file's suffix from the table of back-ends (``targets.BACKENDS``): ``Session`` (a ``.nnef.tgz``
in tract) and ``OnnxSession`` (a ``.onnx`` in onnxruntime or tract's ONNX loader). The conversion check and
``perplexity`` open files through it (``offered``: options each runner takes where it declares them)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping, Protocol, runtime_checkable

import numpy as np

from gdn_export.targets import backend_for, load


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


def runner_class(path: str | os.PathLike) -> type:
    """The runner of ``path`` by its suffix (an unknown suffix: an archive, as ``Session`` reads any tar.gz)."""
    return load(backend_for(path).runner)


def open_runner(path: str | os.PathLike, offered: Mapping[str, Any] | None = None, **options: Any) -> Runner:
    """The runner of ``path`` with ``options`` (``Session``'s ``progress``..., ``OnnxSession``'s ``runtime``), and of
    ``offered`` those its ``OPTIONS`` names (a caller that opens any file offers each runner its own)."""
    cls = runner_class(path)
    return cls(path, **{k: v for k, v in (offered or {}).items() if k in cls.OPTIONS}, **options)


__all__ = ["Runner", "open_runner", "runner_class"]
