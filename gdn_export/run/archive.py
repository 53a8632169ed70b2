"""The ``.nnef.tgz`` archive gdn_export writes: packing, the path rule, and the ``gdn_export.json`` it carries."""

from __future__ import annotations

import json
import os
import tarfile
from pathlib import Path

from gdn_export.errors import GdnExportError

METADATA_FILE = "gdn_export.json"


# gzip without compression ("stored" blocks): tract reads the gzip stream all the same, and deflate even at its
# fastest level packed ~55 MB/s here, a third of a large model's conversion, for ~10% on float16 weights
COMPRESS_LEVEL = 0


def pack(folder: Path, archive: Path) -> None:
    """tar.gz the folder's files at the archive root (what tract loads), stored without compression."""
    with tarfile.open(archive, "w:gz", compresslevel=COMPRESS_LEVEL) as tar:
        for file in sorted(folder.iterdir()):
            tar.add(file, arcname=file.name)


def read_metadata(path: str | os.PathLike) -> dict | None:
    """The ``gdn_export.json`` stored in an archive by ``export(..., metadata=...)``, or None; GdnExportError when
    ``path`` is not a readable .nnef.tgz archive."""
    path = Path(path)
    if not path.is_file():
        raise GdnExportError(f"no file at {path} (expected a .nnef.tgz written by gdn-export)")
    try:
        with tarfile.open(path) as tar:
            try:
                member = tar.extractfile(METADATA_FILE)
            except KeyError:
                return None
            return json.loads(member.read()) if member is not None else None
    except (tarfile.TarError, EOFError, OSError, json.JSONDecodeError, UnicodeDecodeError) as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise GdnExportError(f"{path} is not a .nnef.tgz archive that gdn-export wrote ({reason.rstrip(':')})") from None


def nnef_tgz_path(path: str | os.PathLike) -> Path:
    """``path`` as a Path, refused unless it names a ``.nnef.tgz`` (what tract loads as an archive)."""
    path = Path(path)
    if not path.name.endswith(".nnef.tgz"):
        raise GdnExportError(f"output path {path} must end with .nnef.tgz")
    return path
