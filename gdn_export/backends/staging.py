"""The staging folder a conversion writes in, beside its output, and the removal of those a killed run left.

A conversion writes its archive in a hidden folder beside the output and moves it into place once complete; an
interruption (Ctrl-C, SIGTERM) removes the folder, but SIGKILL (the OOM killer, ``kill -9``) cannot be caught. The
folder's name carries the process id and the host, so a later conversion into the same folder removes those whose
process is gone: on this host only (a shared file system may hold another host's live run), and, for folders named
before the process id was part of the name, only when untouched for a day.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import tempfile
import time
import zlib
from pathlib import Path

PREFIX = ".gdn_export_"
OLD_STAGING_SECONDS = 24 * 3600
_NAMED = re.compile(re.escape(PREFIX) + r"(\d+)-([0-9a-f]{8})_")


def _host() -> str:
    return f"{zlib.crc32(socket.gethostname().encode()):08x}"


def staging_folder(parent: Path) -> tempfile.TemporaryDirectory:
    """A new staging folder in ``parent`` (removed on exit), the stale ones of killed runs removed first."""
    remove_stale(parent)
    return tempfile.TemporaryDirectory(prefix=f"{PREFIX}{os.getpid()}-{_host()}_", dir=parent)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def remove_stale(parent: Path) -> list[Path]:
    """Remove the staging folders in ``parent`` that no running conversion owns; return them."""
    removed = []
    try:
        entries = list(Path(parent).glob(PREFIX + "*"))
    except OSError:
        return removed
    for entry in entries:
        if entry.is_symlink() or not entry.is_dir():
            continue
        named = _NAMED.match(entry.name)
        if named is not None:
            stale = named.group(2) == _host() and int(named.group(1)) != os.getpid() and not _alive(int(named.group(1)))
        else:
            try:
                stale = time.time() - entry.stat().st_mtime > OLD_STAGING_SECONDS
            except OSError:
                stale = False
        if stale:
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed
