"""What an archive must be before tract reads it: its members, their sizes and content.

tract reads every member of a ``.nnef.tgz`` it is given, whether the graph uses it or not, and trusts each ``.dat``
header; nothing in the gzip stream it reads is verified. So before tract sees an archive, one pass over it
(``check_archive``) makes sure that:

- every member is a regular file the graph or the metadata names (``graph.nnef``, ``gdn_export.json``, the
  generation files ``gdn_export.json`` lists, and one ``<label>.dat`` per variable of the graph), each once;
- every ``.dat`` header is a tensor file tract reads (NNEF's magic and version), of a data type gdn_export writes,
  whose extents are the variable's declared shape and whose length is what that shape and type take: the archive
  holds no more than what the graph needs;
- each member's SHA-256 is the one recorded at conversion (``gdn_export.json``'s ``digests``, written by ``pack``):
  a damaged member is named; an archive written before digests existed is checked by the gzip stream's own CRC-32
  instead (read to its end here), which finds the damage without naming the member;
- the states ``gdn_export.json`` declares are the graph's state inputs, shape for shape (a Session allocates them
  from the metadata).

A verified archive is remembered (path, size, modification time) for the rest of the process: a second plan of the
same file does not pay the pass again, unless it asks for the members written out (``unpack_to``: the graph planned
in segments, ``run/segments.py``), which the same pass does as it reads them.
"""

from __future__ import annotations

import collections
import hashlib
import io
import os
import re
import struct
import tarfile
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

from gdn_export.run.archive import (DIGESTS_FIELD, METADATA_FILE, MIB, VARIABLE, ArchiveError, gzip_damage,
                                    unreadable)

GRAPH_FILE = "graph.nnef"
GRAPH_LIMIT = 256 * MIB  # the 0.8B shape's graph is 0.7 MiB; a graph is read whole
DAT_HEADER = 128  # NNEF's tensor file header
READ_BYTES = 4 * MIB  # the file is read by this much at a time
# weights written out (for segments) stop past this many times the archive's file: a stored archive's content is its
# file's size, a float one deflated ~0.9 of it; unpack_root checked room for twice the file
UNPACK_RATIO = 2
# stored blocks shorter than this on average are left to zlib: each is a Python step here (pack's are 64 KiB; a
# stream of empty blocks would have cost ~1 s per 5 MB)
MIN_STORED_BLOCK = 256
NNEF_MAGIC = b"\x4e\xef"
# (bits per item, item type) of the .dat files tract reads and gdn_export writes: floats (code 0), signed integers
# (code 4: int8 weights), unsigned integers (code 1)
PLAIN_TYPES = {(16, 0): "f16", (32, 0): "f32", (64, 0): "f64", (8, 4): "i8", (16, 4): "i16", (32, 4): "i32",
               (64, 4): "i64", (8, 1): "u8", (16, 1): "u16", (32, 1): "u32", (64, 1): "u64"}
# tract's block-quantized tensors: bits per item u32::MAX and a format code; Q4_0 blocks of 32 values in 18 bytes
BLOCK_TYPES = {(0xFFFFFFFF, 0x54523040): ("q4_0", 32, 18)}
_EXTERNAL = re.compile(r"^\s*(\w+)\s*=\s*(?:tract_core_external|external\s*<\s*\w+\s*>)\s*\(\s*shape\s*=\s*\[([^\]]*)\]",
                       re.MULTILINE)


@dataclass
class _Seen:
    """What the pass over an archive found."""

    graph: str | None = None
    headers: dict[str, tuple[str, bytes, int]] = field(default_factory=dict)  # label: (member, header, size)
    names: set[str] = field(default_factory=set)
    digests: dict[str, str] = field(default_factory=dict)


_verified: set[tuple] = set()
_verified_lock = threading.Lock()


def archive_identity(path: str | os.PathLike) -> tuple:
    """What tells one file from another at ``path`` for the rest of a process: its resolved path, size,
    modification time and inode (a file replaced or rewritten there is another)."""
    path = Path(path)
    stat = path.stat()
    return (str(path.resolve()), stat.st_size, stat.st_mtime_ns, stat.st_ino)


class ArchiveCache:
    """What is made once per process from an archive file (a tract plan, a Session), by ``archive_identity``: the
    same file is not made again, a file replaced at the same path is (and the old value is dropped), and a failure
    (``GdnExportError``: a damaged or malformed archive) is remembered as well, so that a request after it gets the
    same error without reading or planning the file again. ``make`` runs under the cache's lock: one at a time."""

    def __init__(self) -> None:
        self._made: dict[str, tuple[tuple, object, BaseException | None]] = {}  # path: (identity, value, failure)
        self._lock = threading.Lock()

    def get(self, path: str | os.PathLike, make):
        import copy

        from gdn_export.errors import GdnExportError

        try:
            identity = archive_identity(path)
        except OSError:  # no file there (any more): ``make`` says so in its own words, nothing is kept
            return make()
        with self._lock:
            known = self._made.get(identity[0])
            if known is None or known[0] != identity:
                try:
                    known = (identity, make(), None)
                except GdnExportError as err:
                    known = (identity, None, err)
                self._made[identity[0]] = known
        if known[2] is not None:  # a fresh copy: raising the remembered one would grow its traceback every time
            raise copy.copy(known[2]).with_traceback(None) from None
        return known[1]

    def clear(self) -> None:
        with self._lock:
            self._made.clear()


def check_archive(path: str | os.PathLike, metadata: dict | None, unpack_to: Path | None = None,
                  listener=None) -> str | None:
    """``path`` (a .nnef.tgz) checked as the module says before tract reads it; ArchiveError naming the member at
    fault otherwise. ``metadata``: its gdn_export.json (None: an archive of ``gdn_export.export`` without one). With
    ``unpack_to`` (an empty folder), every ``.dat`` member is also written to ``unpack_to/weights/`` as it is read,
    and the graph's text is returned (while ``listener.wants_weights()``); ``listener.graph(text)`` and
    ``listener.weight(label)`` are then told of the
    graph and of each weight file once its member passed its checks (its digest among them), while the pass goes
    on: a later member's fault still raises here."""
    path = Path(path)
    key = archive_identity(path)
    with _verified_lock:
        if key in _verified and unpack_to is None:
            return None
    graph = check_members(path, metadata or {}, unpack_to, listener)
    with _verified_lock:
        _verified.add(key)
    return graph


def check_members(path: Path, metadata: dict, unpack_to: Path | None = None, listener=None) -> str | None:
    """``check_archive``'s pass, uncached (``run/reading.py`` runs it again to name the member of a damaged archive);
    the graph's text. An archive whose deflate blocks are all stored (``pack``'s) is read without inflating
    (``_StoredContent``); one that turns out to mix in compressed blocks is read again by zlib, or, while members
    are written out (``unpack_to``), left to a whole load (UnpackError)."""
    try:
        return _check_members(path, metadata, unpack_to, listener, stored=True)
    except _MixedBlocks:
        if unpack_to is not None:  # members written out already: the caller loads the archive whole
            raise UnpackError("the archive mixes stored and compressed deflate blocks") from None
        return _check_members(path, metadata, unpack_to, listener, stored=False)


def _check_members(path: Path, metadata: dict, unpack_to: Path | None, listener, stored: bool) -> str | None:
    recorded = metadata.get(DIGESTS_FIELD)
    listed = {METADATA_FILE, GRAPH_FILE, *metadata.get("generation_files", ())} if metadata else {GRAPH_FILE}
    if metadata and isinstance(metadata.get("mtp"), dict):  # the MTP head's own archive (gdn_export/run/mtp.py)
        listed.add(metadata["mtp"].get("member"))
    seen = _Seen()
    labels: dict[str, list[int]] | None = None  # the graph's variables, once its member was read
    unpacked, unpack_budget = 0, UNPACK_RATIO * path.stat().st_size + 64 * 1024
    try:
        with open(path, "rb") as raw, _content(raw, stored) as stream, \
                ThreadPoolExecutor(max_workers=1, thread_name_prefix="gdn_export-hash") as hasher, \
                ThreadPoolExecutor(max_workers=1, thread_name_prefix="gdn_export-write") as writer:
            with tarfile.open(fileobj=stream, mode="r:") as tar:
                for member in tar:
                    name = member.name
                    if name in seen.names:
                        raise ArchiveError(f"{path}: member {name} appears twice")
                    seen.names.add(name)
                    if not member.isfile() or member.issparse():  # a sparse member's size is not its bytes here
                        raise ArchiveError(f"{path}: member {name} is not a regular file; an archive holds only files")
                    if recorded is not None and name != METADATA_FILE:
                        if name not in recorded:
                            raise ArchiveError(f"{path}: member {name} is not one of those recorded at conversion "
                                               f"({METADATA_FILE}'s digests); convert the model again")
                        if member.size != recorded[name]["size"]:
                            raise ArchiveError(f"{path} is damaged: member {name} is {member.size} bytes, "
                                               f"{recorded[name]['size']} were written; convert it again")
                    elif name not in listed and not name.endswith(".dat"):
                        raise ArchiveError(f"{path}: member {name} is neither the graph, a weight (.dat) nor a file "
                                           f"{METADATA_FILE} lists; tract would read it")
                    if name.endswith(".dat") and labels is not None and name[:-4] not in labels:
                        raise ArchiveError(_unused(path, name))
                    handle = _MemberContent(stream, member) if isinstance(stream, _StoredContent) else \
                        tar.extractfile(member)
                    digest = hashlib.sha256()
                    if name == GRAPH_FILE:
                        if member.size > GRAPH_LIMIT:
                            raise ArchiveError(f"{path}: {GRAPH_FILE} is {member.size / MIB:.0f} MiB, more than the "
                                               f"{GRAPH_LIMIT // MIB} MiB a graph may be")
                        data = handle.read()
                        digest.update(data)
                        seen.graph = data.decode("utf-8", "replace")
                        labels = _variables(seen.graph)
                        for label, (member_name, _, _) in seen.headers.items():
                            if label not in labels:
                                raise ArchiveError(_unused(path, member_name))
                    elif name.endswith(".dat"):
                        header = handle.read(DAT_HEADER)
                        _check_header(path, name, header, member.size, labels)
                        seen.headers[name[:-4]] = (name, header, member.size)
                        digest.update(header)
                        if listener is not None and getattr(listener, "stopped", False):
                            raise UnpackError("the load was abandoned")  # a Ctrl-C while the pass ran in a thread
                        wanted = unpack_to is not None and (listener is None or listener.wants_weights())
                        if wanted:
                            unpacked += member.size
                            if unpacked > unpack_budget:  # a compressed archive's content can be 1000x its file
                                raise UnpackError(f"the archive's weights would take more than {unpack_budget} bytes "
                                                  f"written out ({UNPACK_RATIO}x the archive's file)")
                        out = _unpacked(unpack_to / "weights", name, path) if wanted else None
                        try:
                            if out is not None:
                                out.write(header)
                            _hash_rest((hasher, writer), handle, digest, out)
                        finally:
                            if out is not None:
                                out.close()
                    else:
                        _hash_rest((hasher, writer), handle, digest)
                    seen.digests[name] = digest.hexdigest()
                    if listener is not None and (name == GRAPH_FILE or name.endswith(".dat")):
                        _check_digests(path, _Seen(digests={name: seen.digests[name]}), recorded)  # before use
                        if name == GRAPH_FILE:
                            listener.graph(seen.graph)
                        elif unpack_to is not None:
                            listener.weight(name[:-4])
            while stream.read(MIB):  # the end-of-archive blocks: the gzip trailer's CRC-32 is checked at its end
                pass
    except (ArchiveError, _MixedBlocks):
        raise
    except (tarfile.TarError, EOFError, OSError, zlib.error) as err:
        _check_digests(path, seen, recorded)  # a member whose digest differs is named rather than the stream
        raise ArchiveError(unreadable(path, err, gzip_damage(path))) from None
    _check_complete(path, seen, recorded, metadata)
    return seen.graph


def _content(raw, stored: bool = True) -> io.RawIOBase | io.BufferedReader:
    """The content of the gzip file ``raw`` (read from its start): ``_StoredContent`` when its first deflate block
    is stored and ``stored`` allows it, else zlib's inflating (``_Inflated``) behind a buffer."""
    data = _after_gzip_header(raw) or raw.read(READ_BYTES)
    if stored and data and (data[0] >> 1) & 3 == 0:
        return _StoredContent(raw, data)
    return io.BufferedReader(_Inflated(raw, data), MIB)


def _after_gzip_header(raw) -> bytes:
    """What ``raw`` holds past the gzip header (RFC 1952) that begins it, as far as read. A name or comment of any
    length is skipped a read at a time (an archive writer pads its start with a comment: ``run/archive.py``)."""
    data = raw.read(READ_BYTES)
    if len(data) < 10 or data[:3] != b"\x1f\x8b\x08":
        raise OSError("not a gzip file")
    flags, data = data[3], data[10:]
    if flags & 4:  # FEXTRA: at most 64 KiB
        while len(data) < 2 or len(data) < 2 + int.from_bytes(data[:2], "little"):
            more = raw.read(READ_BYTES)
            if not more:
                raise EOFError("the gzip stream ends in its header (the file is truncated)")
            data += more
        data = data[2 + int.from_bytes(data[:2], "little"):]
    for flag in (8, 16):  # FNAME, FCOMMENT: zero-terminated
        if flags & flag:
            while (end := data.find(b"\0")) < 0:
                data = raw.read(READ_BYTES)
                if not data:
                    raise EOFError("the gzip stream ends in its header (the file is truncated)")
            data = data[end + 1:]
    if flags & 2:  # FHCRC
        while len(data) < 2:
            more = raw.read(READ_BYTES)
            if not more:
                raise EOFError("the gzip stream ends in its header (the file is truncated)")
            data += more
        data = data[2:]
    return data


class _GzipContent(io.RawIOBase):
    """What both readings of a gzip stream share: forward seeks, and the trailer's check once all the content was
    read (zlib's own check would fail the read that reaches the trailer, losing the content before it, and with it
    the name of the damaged member)."""

    def __init__(self, raw) -> None:
        self.raw, self.position, self.crc, self.ended = raw, 0, 0, False

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.position

    def seek(self, offset: int, whence: int = 0) -> int:
        target = offset + (self.position if whence == 1 else 0)
        if whence == 2 or target < self.position:
            raise OSError("the archive is read in order: no seeking back")
        while self.position < target:
            if not self._skip(min(target - self.position, 4 * MIB)):
                break
        return self.position

    def _skip(self, n: int) -> int:
        return len(self.read(n))

    def _trailer(self, trailer: bytes) -> None:
        """``trailer``: what follows the deflate data, as far as it was read."""
        while len(trailer) < 8:
            more = self.raw.read(8 - len(trailer))
            if not more:
                raise EOFError("the gzip stream ends before its trailer (the file is truncated)")
            trailer += more
        crc, size = struct.unpack("<II", trailer[:8])
        if crc != self.crc or size != self.position & 0xFFFFFFFF:
            raise zlib.error(f"CRC check failed {crc:#x} != {self.crc:#x}")
        if trailer[8:] or self.raw.read(1):
            raise zlib.error("data after the end of the gzip stream")


class _Inflated(_GzipContent):
    """A gzip stream's content, inflated from reads of 4 MiB of the file (``gzip.GzipFile`` reads it by the 8 KiB
    and took twice as long over a 0.8 GB archive). ``data``: the file's bytes after the gzip header, read already."""

    def __init__(self, raw, data: bytes) -> None:
        super().__init__(raw)
        self.inflate, self.data = zlib.decompressobj(-zlib.MAX_WBITS), data

    def readinto(self, buffer) -> int:
        while True:
            if self.inflate.eof:  # what follows the deflate data is in unused_data (unconsumed_tail too)
                if not self.ended:
                    self._trailer(self.inflate.unused_data)
                    self.ended = True
                return 0
            if self.inflate.unconsumed_tail:
                data = self.inflate.unconsumed_tail
            elif self.data:
                data, self.data = self.data, b""
            else:
                data = self.raw.read(4 * MIB)
                if not data:
                    raise EOFError("the gzip stream ends before its end (the file is truncated)")
            out = self.inflate.decompress(data, len(buffer))
            if out:
                buffer[:len(out)] = out
                self.position += len(out)
                self.crc = zlib.crc32(out, self.crc)
                return len(out)


class _MixedBlocks(Exception):
    """A compressed deflate block after stored ones, or stored blocks too small to read in Python:
    ``_StoredContent`` does not read on (``check_members``)."""


class _StoredContent(_GzipContent):
    """The content of a gzip stream whose deflate blocks are stored (``pack`` writes level 0: blocks of raw bytes
    behind a 5-byte header), taken from the file's bytes without inflating them: each 4 MiB read of the file has its
    block headers squeezed out in place, and ``take(n)`` gives views of those reads, which the pass hashes and writes
    out as they are. zlib's inflating of the same blocks copied every byte once more at ~1 GB/s: the pass over the
    0.8 GB int8 archive took 1.4-1.7 s, now 1.0 s, the f32 one's 2.6 GB 4.2 s, now 2.7 s (benchmarks/RESULTS.md,
    2026-12-05). A block of another type raises _MixedBlocks (the pass is then read by zlib)."""

    def __init__(self, raw, data: bytes) -> None:
        super().__init__(raw)
        self.carry = bytes(data)  # the file's bytes read and not yet parsed (a block header cut by a read)
        self.block_left = 0  # content bytes of the current block not yet read
        self.final = False  # the current block is the last
        self.pending: collections.deque = collections.deque()  # content read, not taken

    def take(self, n: int) -> list[memoryview]:
        """Views of the next ``n`` bytes of content (fewer at its end)."""
        out = []
        while n > 0:
            if not self.pending and not self._read():
                break
            view = self.pending[0]
            if len(view) > n:
                view, self.pending[0] = view[:n], view[n:]
            else:
                self.pending.popleft()
            out.append(view)
            n -= len(view)
            self.crc = zlib.crc32(view, self.crc)
            self.position += len(view)
        return out

    def readinto(self, buffer) -> int:
        at = 0
        for view in self.take(len(buffer)):
            buffer[at:at + len(view)] = view
            at += len(view)
        return at

    def _skip(self, n: int) -> int:
        return sum(map(len, self.take(n)))

    def _read(self) -> bool:
        """Read on into ``pending``; False once the last block was read (and the trailer checked)."""
        while True:
            if self.final and not self.block_left:
                if not self.ended:
                    self.ended = True
                    self._trailer(self.carry)
                return False
            # a new buffer each time: views of the last ones may still be hashed
            chunk = bytearray(max(READ_BYTES, len(self.carry) + READ_BYTES))
            size = len(self.carry)
            chunk[:size] = self.carry
            got = self.raw.readinto(memoryview(chunk)[size:])
            content = self._squeezed(memoryview(chunk)[:size + got])
            if content:
                self.pending.append(content)
                return True
            if not got and not (self.final and not self.block_left):
                raise EOFError("the gzip stream ends before its end (the file is truncated)")

    def _squeezed(self, view: memoryview) -> memoryview:
        """The content in ``view`` (a read of the file) moved to its start, block headers out; what follows the
        last whole header (a header cut by the read, or the trailer) kept in ``carry``."""
        at = kept = headers = 0
        while at < len(view):
            if not self.block_left:
                if self.final or len(view) - at < 5:
                    break
                headers += 1
                if headers > len(view) // MIN_STORED_BLOCK + 64:  # blocks this small: zlib reads them in C
                    raise _MixedBlocks()
                header = view[at:at + 5]
                if (header[0] >> 1) & 3:
                    raise _MixedBlocks()
                length, check = struct.unpack("<HH", header[1:])
                if length ^ check != 0xFFFF:
                    raise zlib.error("invalid stored block lengths")
                self.final, self.block_left = bool(header[0] & 1), length
                at += 5
                continue
            step = min(self.block_left, len(view) - at)
            if kept != at:
                view[kept:kept + step] = view[at:at + step]
            kept, at, self.block_left = kept + step, at + step, self.block_left - step
        self.carry = bytes(view[at:])
        return view[:kept]


class _MemberContent:
    """One member's content out of a ``_StoredContent`` (in place of ``TarFile.extractfile``): ``read`` copies,
    ``views`` does not."""

    def __init__(self, stream: _StoredContent, member: tarfile.TarInfo) -> None:
        stream.seek(member.offset_data)
        self.stream, self.left = stream, member.size

    def views(self, n: int) -> list[memoryview]:
        out = self.stream.take(min(n, self.left))
        self.left -= sum(map(len, out))
        return out

    def read(self, n: int = -1) -> bytes:
        return b"".join(self.views(self.left if n < 0 else n))


class UnpackError(Exception):
    """Writing an archive's weights out failed (disk full, a removed folder...): not the archive's fault. Not an
    OSError, so that the pass does not report it as a damaged archive; the caller loads the archive whole."""


def _hash_rest(workers: tuple[ThreadPoolExecutor, ThreadPoolExecutor], handle, digest, out=None) -> None:
    """The rest of a member into ``digest`` (and written to ``out``), beside the reading: the hash runs in the pass's
    hashing thread and the write in its writing thread (one each: the chunks in order) while this one reads the next
    chunk (hashlib, zlib and file writes release the GIL: the pass takes the longest of the three rather than their
    sum; the f32 0.8B archive's 2.6 GB take 1.2 s to hash and 1.1 s to write to /dev/shm here)."""
    hasher, writer = workers

    def hashed(pieces: list) -> None:
        for piece in pieces:
            digest.update(piece)

    def written(pieces: list) -> None:
        try:
            out.writelines(pieces)
        except OSError as err:
            raise UnpackError(f"writing the weights out: {err}") from None

    views = getattr(handle, "views", None)
    pending: list = []
    try:
        while chunk := (views(4 * MIB) if views is not None else handle.read(4 * MIB)):
            pieces = chunk if isinstance(chunk, list) else [chunk]  # views of a stored archive's reads, or bytes
            pending.append(hasher.submit(hashed, pieces))
            if out is not None:
                pending.append(writer.submit(written, pieces))
            while len(pending) > 6:  # at most a few chunks held
                pending.pop(0).result()
    finally:  # every queued hash and write done (or failed) before the caller closes ``out``
        wait(pending)
    for future in pending:
        future.result()


def _unpacked(folder: Path, name: str, path: Path):
    """``folder / name`` opened for writing (created, never overwritten); a name that would leave the folder
    (absolute, with ``..``) is an ArchiveError."""
    target = folder / name
    if Path(name).is_absolute() or ".." in Path(name).parts or not target.resolve().is_relative_to(folder.resolve()):
        raise ArchiveError(f"{path}: member {name} names a path outside the archive")
    try:
        if not folder.is_dir():  # removed (an abandoned load): never made again
            raise UnpackError(f"{folder} is gone")
        target.parent.mkdir(parents=True, exist_ok=True)
        return open(target, "xb")
    except OSError as err:
        raise UnpackError(f"writing the weights out: {err}") from None


def _unused(path: Path, name: str) -> str:
    return f"{path}: member {name} is a weight the graph has no variable for; tract would read it"


def _dims(text: str) -> list:
    return [int(d) if d.strip().isdigit() else d.strip() for d in text.split(",") if d.strip()]


def _variables(graph: str) -> dict[str, list[int]]:
    return {label: _dims(shape) for _, label, shape in VARIABLE.findall(graph)}


def _check_header(path: Path, name: str, header: bytes, size: int, labels: dict | None) -> None:
    """A .dat member's header: NNEF's tensor file, a type gdn_export writes, its data length that of its extents and
    the member's size; its extents those the graph declares (when the graph was read already; else at the end)."""
    where = f"{path}: weight {name}"
    if len(header) < DAT_HEADER or header[:2] != NNEF_MAGIC or header[2] != 1:
        raise ArchiveError(f"{where} is not an NNEF tensor file (its header lacks NNEF's magic and version 1)")
    length, rank = struct.unpack_from("<II", header, 4)
    if rank > 8:
        raise ArchiveError(f"{where} has rank {rank}; NNEF tensors have at most 8 dimensions")
    extents = list(struct.unpack_from(f"<{rank}I", header, 12))
    bits, item = struct.unpack_from("<II", header, 44)
    count = 1
    for extent in extents:
        count *= extent
    if (bits, item) in PLAIN_TYPES:
        expected = count * bits // 8
    elif (bits, item) in BLOCK_TYPES:
        _, block, block_bytes = BLOCK_TYPES[(bits, item)]
        expected = -(-count // block) * block_bytes
    else:
        raise ArchiveError(f"{where} has item type ({bits} bits, code {item:#x}), not one gdn_export writes")
    if length != expected or size != DAT_HEADER + length:
        raise ArchiveError(f"{where}: its header says {length} bytes of data, its extents {extents} take {expected}, "
                           f"the member holds {size - DAT_HEADER}")
    if labels is not None:
        declared = labels[name[:-4]]
        if declared != extents:
            raise ArchiveError(f"{where} has extents {extents}, the graph declares {declared}")


def _check_complete(path: Path, seen: _Seen, recorded: dict | None, metadata: dict) -> None:
    if seen.graph is None:
        raise ArchiveError(f"{path} holds no {GRAPH_FILE}: not a .nnef.tgz archive that gdn-export wrote")
    labels = _variables(seen.graph)
    for label, (name, header, size) in seen.headers.items():
        _check_header(path, name, header, size, labels)
    missing = sorted(f"{label}.dat" for label in labels if label not in seen.headers)
    if missing:
        raise ArchiveError(f"{path} is damaged: it lacks {missing[0]}" + (f" (+{len(missing) - 1} more weights)"
                                                                         if len(missing) > 1 else ""))
    if recorded is not None:
        absent = sorted(set(recorded) - seen.names)
        if absent:
            raise ArchiveError(f"{path} is damaged: it lacks member {absent[0]}, recorded at conversion")
    _check_digests(path, seen, recorded)
    check_states(path, metadata, seen.graph)


def _check_digests(path: Path, seen: _Seen, recorded: dict | None) -> None:
    for name, digest in seen.digests.items():
        if recorded is not None and name != METADATA_FILE and digest != recorded[name]["sha256"]:
            raise ArchiveError(f"{path} is damaged: member {name} does not match the digest recorded at conversion "
                               "(its content changed since); convert it again")


def graph_inputs(graph: str) -> dict[str, list]:
    """The graph's external inputs and their declared shapes (sizes, or symbols such as ``B``)."""
    return {name: _dims(shape) for name, shape in _EXTERNAL.findall(graph)}


NOT_STATES = ("input_ids", "past_len", "seq_len", "hidden", "next_ids")  # the inputs of gdn-export's graphs that are no state


def check_states(path: Path, metadata: dict, graph: str) -> None:
    """``metadata``'s states are the graph's state inputs (those after ``input_ids`` and a serving graph's
    ``past_len``/``seq_len``; an MTP head's after ``hidden`` and ``next_ids``), each of the shape the graph declares."""
    states = metadata.get("states")
    if states is None:
        return
    inputs = graph_inputs(graph)
    names = [n for n in metadata.get("inputs", list(inputs)) if n not in NOT_STATES]
    if len(names) != len(states):
        raise ArchiveError(f"{path}: {METADATA_FILE} declares {len(states)} states, the graph takes {len(names)}")
    for name, state in zip(names, states):
        if name not in inputs:
            raise ArchiveError(f"{path}: {METADATA_FILE} names input {name}, which the graph does not take")
        if [str(d) for d in state["shape"]] != [str(d) for d in inputs[name]]:
            raise ArchiveError(f"{path}: {METADATA_FILE}'s state {state['name']} has shape {state['shape']}, the "
                               f"graph's input {name} {inputs[name]}")
