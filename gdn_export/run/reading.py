"""Reading an archive's members, its damage named: a truncated or corrupted ``.nnef.tgz`` is an ArchiveError that
names the member whose digest differs from the one recorded at conversion (``integrity.check_members``), or the
damaged gzip stream. Above both ``archive.py`` (the format: members, limits, metadata schema) and ``integrity.py``
(the check before tract reads an archive), so that dependencies point one way."""

from __future__ import annotations

import json
import os
import tarfile
import threading
import zlib
from pathlib import Path

from gdn_export.errors import GdnExportError
from gdn_export.run.archive import (DIGESTS_FIELD, METADATA_FILE, ArchiveError, check_metadata, members_named,
                                    damaged_message, gzip_damage, read_member, unreadable)
from gdn_export.run.integrity import check_members


def read_metadata(path: str | os.PathLike) -> dict | None:
    """The ``gdn_export.json`` stored in an archive by ``export(..., metadata=...)``, checked against its schema
    (``check_metadata``), or None; GdnExportError when ``path`` is not a readable .nnef.tgz archive."""
    path = Path(path)
    if not path.is_file():
        raise GdnExportError(f"no file at {path} (expected a .nnef.tgz written by gdn-export)")
    with _opened(path) as tar:
        data = read_member(tar, METADATA_FILE, path)
    if data is None:
        corrupt = gzip_damage(path)  # a stream damaged before the metadata member reads as a tar ending early
        if corrupt is not None:
            raise ArchiveError(damaged_message(path, corrupt))
        return None
    try:
        metadata = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError) as err:
        raise ArchiveError(f"{path}: {METADATA_FILE} is not valid JSON ({err})") from None
    return check_metadata(metadata, f"{path}: {METADATA_FILE}")


def read_members(path: str | os.PathLike, names) -> dict[str, bytes]:
    """The members ``names`` that the archive at ``path`` holds (``read_member``'s checks), each read once."""
    path = Path(path)
    with _opened(path) as tar:
        members = members_named(tar, names)
        found = {name: read_member(tar, name, path, member=member) for name, member in members.items()}
    return {name: data for name, data in found.items() if data is not None}


class _opened:
    """``tarfile.open(path)`` whose damage (a truncated or corrupted gzip, a broken tar) is an ArchiveError naming
    it, raised from opening or from any read inside the block."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __enter__(self) -> tarfile.TarFile:
        try:
            self.tar = tarfile.open(self.path)
        except BaseException as err:
            self.__exit__(type(err), err, None)
            raise
        return self.tar

    def __exit__(self, kind, err, traceback) -> None:
        tar = getattr(self, "tar", None)
        if tar is not None:
            tar.close()
        if err is not None and isinstance(err, (tarfile.TarError, EOFError, OSError, zlib.error)):
            raise ArchiveError(damage(self.path, err)) from None


def damage(path: Path, err: BaseException) -> str:
    """What is wrong with the archive at ``path``, which failed to read with ``err``: a damaged gzip stream named as
    such, by the member whose recorded digest differs where one does (which reads the archive once more), else "not
    a .nnef.tgz archive"."""
    corrupt = gzip_damage(path)
    return (damaged_member(path) if corrupt is not None else None) or unreadable(path, err, corrupt)


_naming = threading.local()


def damaged_member(path: Path) -> str | None:
    """Which member of a damaged archive (its gzip stream does not check) differs from the digest recorded at
    conversion, as the one-line message ``check_archive`` gives; None when the archive records no digests, its
    metadata cannot be read, or no member's digest differs."""
    if getattr(_naming, "active", False):  # reading the metadata below failed in turn
        return None
    _naming.active = True
    try:
        metadata = read_metadata(path)
        if not metadata or DIGESTS_FIELD not in metadata:
            return None
        check_members(path, metadata)
    except ArchiveError as err:
        return str(err) if "recorded at conversion" in str(err) else None
    except Exception:  # noqa: BLE001 (naming the member is a courtesy: the caller reports the damage anyway)
        return None
    finally:
        _naming.active = False
    return None
