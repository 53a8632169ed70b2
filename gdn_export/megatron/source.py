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
