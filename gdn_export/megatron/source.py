"""The Megatron-LM checkpoint source (``gdn_export.checkpoints``): a folder with ``latest_checkpointed_iteration.txt``
or one ``iter_*`` and no ``config.json``, torch_dist or legacy."""

from __future__ import annotations

from pathlib import Path

from gdn_export.megatron.checkpoint import is_megatron_checkpoint


def recognizes(folder: Path) -> bool:
    return is_megatron_checkpoint(folder)


def open_folder(folder: Path, family=None, config: dict | None = None):
    """The model comes from the checkpoint's own ``args``: ``family`` and ``config`` (``read_config``'s) add nothing."""
    from gdn_export.megatron.family import open_megatron

    return open_megatron(folder)


def read_config(folder: Path) -> dict:
    return open_folder(folder)[1].config


def families() -> list:
    from gdn_export.megatron.family import FAMILY

    return [FAMILY]


def _opened(folder: Path, weights):
    """The checkpoint ``open_folder`` opened (``weights``: its ``MegatronWeights``), else opened now."""
    from gdn_export.megatron.checkpoint import MegatronCheckpoint

    checkpoint = getattr(weights, "checkpoint", None)
    return checkpoint if checkpoint is not None else MegatronCheckpoint(folder)


def has_mtp(folder: Path, weights=None) -> bool:
    """Whether the checkpoint holds a multi-token-prediction block (``mtp.*``); ``weights``: what ``open_folder``
    gave, whose opened checkpoint is asked (not opened a second time)."""
    return any(name.startswith("mtp.") for name in _opened(folder, weights).names())


def read_mtp_head(folder: Path, dtype, weights=None):
    """The checkpoint's MTP block as the published MTP head (``megatron.mtp``), or None; ``weights`` as ``has_mtp``."""
    from gdn_export.megatron.mtp import read_megatron_mtp_head

    return read_megatron_mtp_head(folder, dtype, _opened(folder, weights))
