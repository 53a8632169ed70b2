"""The ``.nnef.tgz`` archive gdn_export writes: packing, the path rule, and the ``gdn_export.json`` it carries."""

from __future__ import annotations

import errno
import hashlib
import json
import mmap
import os
import re
import struct
import tarfile
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterable, Mapping

from gdn_export.errors import GdnExportError
from gdn_export.targets import FLOAT_DTYPES

METADATA_FILE = "gdn_export.json"
DIGESTS_FIELD = "digests"  # gdn_export.json's record of every other member's size and SHA-256 (``pack``)
MIB = 1 << 20
# what an archive member may hold before it is refused (read whole into memory, so bounded): a tokenizer.json of a
# 250k-token vocabulary is ~11 MiB; the other files are configs and templates of kilobytes
MEMBER_LIMITS = {"tokenizer.json": 64 * MIB, "tokenizer.model": 64 * MIB, "vocab.json": 64 * MIB,
                 "merges.txt": 64 * MIB}
DEFAULT_MEMBER_LIMIT = 16 * MIB
# the checkpoint files an archive carries for generation (convert copies those the checkpoint has; tract ignores them)
GENERATION_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                    "chat_template.json", "generation_config.json", "vocab.json", "merges.txt", "tokenizer.model")


class ArchiveError(GdnExportError):
    """An archive that is damaged, not gdn_export's, or whose gdn_export.json breaks its schema."""


# gzip without compression ("stored" deflate blocks): tract reads the gzip stream all the same, and deflate even at
# its fastest level packed ~55 MB/s here, a third of a large model's conversion, for ~10% on float16 weights
STORED_BLOCK = 65535  # the most bytes one stored deflate block holds
COPY_CHUNK = 8 * MIB  # a member copied from a file is read this much at a time
PARALLEL_HASH_BYTES = MIB  # a write at least this large is hashed in a second thread while it is written
STREAM_CHUNK = 8 * MIB  # the archive's body is written this much at a time
DIRECT_ALIGN = 4096  # what an O_DIRECT write's offset, length and buffer are multiples of


def pack(folder: Path, archive: Path) -> None:
    """tar.gz the folder's files at the archive root (what tract loads), stored without compression; when the folder
    holds a gdn_export.json, every other file's size and SHA-256 are recorded in it (``DIGESTS_FIELD``: what
    ``gdn_export.run.integrity`` checks before tract reads the archive). ``ArchiveWriter`` writes it, each file
    read once."""
    metadata_file = folder / METADATA_FILE
    metadata = json.loads(metadata_file.read_text()) if metadata_file.is_file() else None
    with ArchiveWriter(archive, folder, metadata_draft=metadata, skip=(METADATA_FILE,)) as writer:
        writer.write_body()
        writer.finish(metadata)


# a variable of graph.nnef: its label (group 2: the weight file ``<label>.dat``) and shape (group 3)
VARIABLE = re.compile(r"variable\s*<\s*\w+\s*>\s*\(\s*label\s*=\s*(['\"])(.*?)\1\s*,\s*shape\s*=\s*\[([^\]]*)\]")


def member_order(folder: Path, extra_names: Iterable[str] = (), metadata: bool | None = None) -> list[str]:
    """The names of the members ``pack`` writes from a folder's files and ``extra_names`` (members written from
    elsewhere), in order: the metadata (``metadata``: whether there is one; None: whether the folder holds it) and
    the graph first, then each weight in the order the graph first reads it, then the rest by name. A reader that
    goes through the archive once (the integrity pass) then knows the graph before the weights, and has the first
    layers' weights first: a model planned in segments (run/segments.py) starts loading its first segment while the
    pass reads the others' weights."""
    names = {entry.name for entry in folder.iterdir()} | set(extra_names)
    if metadata is not None:
        names = names - {METADATA_FILE} | ({METADATA_FILE} if metadata else set())
    text = (folder / "graph.nnef").read_text() if "graph.nnef" in names else ""
    first = [name for name in (METADATA_FILE, "graph.nnef") if name in names]
    weights = [name for name in dict.fromkeys(f"{m.group(2)}.dat" for m in VARIABLE.finditer(text)) if name in names]
    rest = sorted(names - set(first) - set(weights))
    return first + weights + rest


class ArchiveWriter:
    """Writes the ``.nnef.tgz`` ``pack`` describes (gdn_export.json, graph.nnef, the weights in graph order, the
    rest: one tar in a gzip stream of stored deflate blocks) with each member's bytes written once and hashed as
    they pass: a weight need not be staged in a file first, and no file is read back to be hashed.

    gdn_export.json holds the digests and comes first, so the members after the graph (the body, ``write_body``)
    are written first, after a gap left at the start of the file, and gdn_export.json and the graph last, into the
    gap (``finish``), with the gzip trailer's CRC-32 combined from both parts'. The gap's unused bytes are the gzip
    header's comment (RFC 1952's FCOMMENT, spaces), which gzip readers skip. The gap is sized from
    ``metadata_draft`` (gdn_export.json's content but the digests, no field shorter than it will be; None: no
    gdn_export.json) and the graph's size plus ``graph_growth`` (bytes the graph may still gain before ``finish``):
    a metadata or graph that outgrows it is still written, the body then copied once behind it.

    ``streamed``: members written by a callable instead of from a file of ``folder`` (``name -> (size,
    write(file))``: e.g. a weight straight from the checkpoint, which must write exactly ``size`` bytes);
    ``extra``: members copied from files elsewhere (``name -> path``); ``skip``: files of ``folder`` left out;
    ``direct``: the body written past the page cache (``_StoredStream``), for an archive this process does not read
    back."""

    def __init__(self, archive: Path, folder: Path, streamed: Mapping[str, tuple[int, Callable]] | None = None,
                 extra: Mapping[str, Path] | None = None, metadata_draft: dict | None = None, graph_growth: int = 0,
                 skip: Iterable[str] = (), direct: bool = False) -> None:
        self.archive, self.folder = Path(archive), Path(folder)
        self.streamed, self.extra = dict(streamed or {}), dict(extra or {})
        self.skip, self.metadata = set(skip), metadata_draft is not None
        self.order = self._order()
        self.head = [name for name in self.order if name in (METADATA_FILE, "graph.nnef")]
        self.body = self.order[len(self.head):]
        self.digests: dict[str, dict] = {}
        self.mtime = time.time()
        head = self._member_bytes("graph.nnef", self._size("graph.nnef") + graph_growth) \
            if "graph.nnef" in self.head else 0
        if metadata_draft is not None:
            placeholders = {name: {"size": self._size(name), "sha256": "0" * 64} for name in self._digested()}
            head += self._member_bytes(METADATA_FILE, len(_metadata_bytes(metadata_draft, placeholders)))
        self.gap = len(_gzip_header(self.archive.name, 0)) + _stored_bytes(head)
        self.file = open(self.archive, "wb", buffering=0)
        self.stream = _StoredStream(self.archive, self.file.fileno(), self.gap, direct)

    def __enter__(self) -> "ArchiveWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.stream.close()
        self.file.close()

    def _order(self) -> list[str]:
        files = {entry.name for entry in self.folder.iterdir() if entry.name not in self.skip}
        order = member_order(self.folder, [*self.streamed, *self.extra], self.metadata)
        return [name for name in order if name in files or name in self.streamed or name in self.extra
                or name == METADATA_FILE]

    def _digested(self) -> list[str]:
        """The members gdn_export.json records, by name."""
        return sorted(name for name in self.order if name != METADATA_FILE)

    def _member_bytes(self, name: str, size: int) -> int:
        """What member ``name`` of ``size`` bytes takes in the tar: its headers and its data padded to a block."""
        return len(self._header(name, size)) + size + (-size % tarfile.BLOCKSIZE)

    def _size(self, name: str) -> int:
        if name in self.streamed:
            return self.streamed[name][0]
        return (self.extra[name] if name in self.extra else self.folder / name).stat().st_size

    def write_body(self) -> None:
        """Every member after the graph, in ``member_order``, each hashed as it is written."""
        for name in self.body:
            size = self._size(name)
            self.stream.write(self._header(name, size))
            member = _Member(self.stream, name, size)
            if name in self.streamed:
                self.streamed[name][1](member)
            else:
                with open(self.extra.get(name, self.folder / name), "rb") as source:
                    while chunk := source.read(COPY_CHUNK):
                        member.write(chunk)
            self.digests[name] = member.close()
            self.stream.write(bytes(-size % tarfile.BLOCKSIZE))

    def finish(self, metadata: dict | None) -> None:
        """The tar's end, then gdn_export.json (``metadata`` with every other member's size and SHA-256; None: no
        such member) and the graph into the gap, and the gzip trailer."""
        if self._order() != self.order:  # the graph reads its weights in another order, or files came or went
            raise GdnExportError(f"{self.archive}: the members changed while the archive was written")
        graph = (self.folder / "graph.nnef").read_bytes() if "graph.nnef" in self.head else None
        if graph is not None:
            self.digests["graph.nnef"] = {"size": len(graph), "sha256": hashlib.sha256(graph).hexdigest()}
        head = b""
        if (metadata is None) != (METADATA_FILE not in self.head):
            raise GdnExportError("the archive's gdn_export.json was announced and not given, or given unannounced")
        if metadata is not None:
            data = _metadata_bytes(metadata, {name: self.digests[name] for name in self._digested()})
            head += self._header(METADATA_FILE, len(data)) + data + bytes(-len(data) % tarfile.BLOCKSIZE)
        if graph is not None:
            head += self._header("graph.nnef", len(graph)) + graph + bytes(-len(graph) % tarfile.BLOCKSIZE)
        # the end-of-archive blocks, the whole tar padded to a record as tarfile pads it
        self.stream.write(bytes(2 * tarfile.BLOCKSIZE + (-(len(head) + self.stream.size + 2 * tarfile.BLOCKSIZE)
                                                         % tarfile.RECORDSIZE)))
        self.stream.end()
        crc = crc32_combine(zlib.crc32(head), self.stream.crc, self.stream.size)
        trailer = struct.pack("<II", crc, (len(head) + self.stream.size) & 0xFFFFFFFF)
        start = _gzip_header(self.archive.name, 0) + _stored(head)
        _write_all(self.file.fileno(), [trailer])
        if len(start) > self.gap:  # outgrew the gap: the body copied once behind a new start
            self._rewrite(start)
            return
        self.file.seek(0)
        _write_all(self.file.fileno(), [_gzip_header(self.archive.name, self.gap - len(start)), _stored(head)])

    def _rewrite(self, start: bytes) -> None:
        moved = self.archive.with_name(self.archive.name + ".grown")
        with open(moved, "wb") as out, open(self.archive, "rb") as body:
            out.write(start)
            body.seek(self.gap)
            while chunk := body.read(COPY_CHUNK):
                out.write(chunk)
        self.file.close()
        os.replace(moved, self.archive)

    def _header(self, name: str, size: int) -> bytes:
        """A member's tar header as ``tarfile.add`` writes one for a file this process just wrote."""
        info = tarfile.TarInfo(name)
        info.size, info.mtime, info.mode = size, self.mtime, 0o666 & ~_UMASK
        info.uid, info.gid = os.getuid(), os.getgid()
        info.uname, info.gname = _owner_names(info.uid, info.gid)
        return info.tobuf(tarfile.DEFAULT_FORMAT, tarfile.ENCODING, "surrogateescape")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_UMASK = _umask()


def _owner_names(uid: int, gid: int) -> tuple[str, str]:
    import grp
    import pwd

    try:
        user = pwd.getpwuid(uid)[0]
    except KeyError:
        user = ""
    try:
        group = grp.getgrgid(gid)[0]
    except KeyError:
        group = ""
    return user, group


def _metadata_bytes(metadata: dict, digests: dict) -> bytes:
    return json.dumps({**metadata, DIGESTS_FIELD: digests}, indent=1).encode()


def _stored_bytes(size: int) -> int:
    """What ``size`` bytes take as stored deflate blocks (5 bytes of header each)."""
    return size + 5 * -(-size // STORED_BLOCK)


def _stored(data: bytes) -> bytes:
    """``data`` as stored deflate blocks, none final."""
    view = memoryview(data)
    return b"".join(_block_header(len(view[at:at + STORED_BLOCK])) + view[at:at + STORED_BLOCK]
                    for at in range(0, len(view), STORED_BLOCK))


def _block_header(length: int, final: bool = False) -> bytes:
    return struct.pack("<BHH", int(final), length, length ^ 0xFFFF)


def _gzip_header(name: str, padding: int) -> bytes:
    """The gzip header Python's gzip module writes for ``name`` at compression level 0 (the name's ``.gz`` dropped,
    the modification time now), with a comment of ``padding`` bytes (spaces and its terminating zero) when
    ``padding`` is not 0."""
    name = name[:-3] if name.endswith(".gz") else name
    flags = 0x08 | (0x10 if padding else 0)  # FNAME, FCOMMENT
    comment = b" " * (padding - 1) + b"\0" if padding else b""
    return (b"\x1f\x8b\x08" + bytes([flags]) + struct.pack("<I", int(time.time())) + b"\x00\xff"
            + name.encode("latin-1", "replace") + b"\0" + comment)


class _StoredStream:
    """A deflate stream of stored blocks written to the file at ``path`` from offset ``start`` (``fd``: the file
    open for writing), its content's CRC-32 and size kept. The blocks are framed into a page-aligned buffer
    written ``STREAM_CHUNK`` bytes at a time; with ``direct``, through a second descriptor opened with O_DIRECT
    where the file system allows it: the bytes go from the buffer to the disk, not through the page cache (buffered,
    2.6 GB took 2.4-6.4 s of kernel time here, as pages were allocated and reclaimed; direct, 1.2-1.5 s of the
    disk's). The O_DIRECT writes cover whole aligned blocks: the bytes before ``start`` in the first block and
    after the end in the last are the caller's to write afterwards (``end`` truncates the file to the stream's
    end)."""

    def __init__(self, path: Path, fd: int, start: int, direct: bool = False) -> None:
        self.fd, self.crc, self.size = fd, 0, 0
        self.direct_fd = _open_direct(path) if direct else None
        self.base = start - start % DIRECT_ALIGN if self.direct_fd is not None else start  # the buffer's offset
        self.buffer = mmap.mmap(-1, STREAM_CHUNK)  # page-aligned, as O_DIRECT needs
        self.fill = start - self.base
        self.hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gdn_export-hash")

    def write(self, data, hash_update: Callable | None = None) -> None:
        """``data`` written; ``hash_update(data)`` runs meanwhile, in a second thread when ``data`` is large."""
        view = memoryview(data).cast("B")
        hashed = self.hasher.submit(hash_update, view) if hash_update is not None and len(view) >= PARALLEL_HASH_BYTES \
            else None
        if hash_update is not None and hashed is None:
            hash_update(view)
        self.crc = zlib.crc32(view, self.crc)
        self.size += len(view)
        for at in range(0, len(view), STORED_BLOCK):
            piece = view[at:at + STORED_BLOCK]
            self._put(_block_header(len(piece)))
            self._put(piece)
        if hashed is not None:
            hashed.result()

    def _put(self, data) -> None:
        while len(data):
            take = min(len(data), STREAM_CHUNK - self.fill)
            self.buffer[self.fill:self.fill + take] = data[:take]
            self.fill += take
            data = data[take:]
            if self.fill == STREAM_CHUNK:
                self._flush(STREAM_CHUNK)

    def _flush(self, length: int) -> None:
        """The buffer's first ``length`` bytes to the file at ``self.base``."""
        view = memoryview(self.buffer)[:length]
        try:
            if self.direct_fd is not None:
                try:
                    _pwrite_all(self.direct_fd, view, self.base)
                except OSError as err:
                    if err.errno != errno.EINVAL:
                        raise
                    os.close(self.direct_fd)  # the file system takes no O_DIRECT write of this kind: buffered
                    self.direct_fd = None
                    _pwrite_all(self.fd, view, self.base)
            else:
                _pwrite_all(self.fd, view, self.base)
        finally:
            view.release()
        self.base += length
        self.fill = 0

    def end(self) -> None:
        """The final (empty) block and what the buffer holds written, the file cut at the stream's end and ``fd``
        placed there."""
        self._put(_block_header(0, final=True))
        end = self.base + self.fill
        padded = self.fill if self.direct_fd is None else -(-self.fill // DIRECT_ALIGN) * DIRECT_ALIGN
        self.buffer[self.fill:padded] = bytes(padded - self.fill)
        self._flush(padded)
        os.ftruncate(self.fd, end)
        os.lseek(self.fd, end, os.SEEK_SET)

    def close(self) -> None:
        self.hasher.shutdown(wait=True)
        if self.direct_fd is not None:
            os.close(self.direct_fd)
            self.direct_fd = None
        self.buffer.close()


def _open_direct(path: Path) -> int | None:
    """``path`` opened for writing with O_DIRECT, or None where the system or file system has none."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    try:
        return os.open(path, os.O_WRONLY | flag)
    except OSError:
        return None


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while len(data):
        done = os.pwrite(fd, data, offset)
        data, offset = data[done:], offset + done


def _write_all(fd: int, parts: list) -> None:
    for part in parts:
        view = memoryview(part).cast("B")
        while len(view):
            view = view[os.write(fd, view):]


class _Member:
    """The file a member's bytes are written to (``write``): they go to the archive's stream, hashed, and must come
    to the size announced in the member's header."""

    def __init__(self, stream: _StoredStream, name: str, size: int) -> None:
        self.stream, self.name, self.size, self.written = stream, name, size, 0
        self.digest = hashlib.sha256()

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self.written += len(view)
        if self.written > self.size:
            raise GdnExportError(f"archive member {self.name} was announced as {self.size} bytes and written "
                                 f"longer: its writer does not write what it declared")
        self.stream.write(view, self.digest.update)
        return len(view)

    def close(self) -> dict:
        if self.written != self.size:
            raise GdnExportError(f"archive member {self.name} was announced as {self.size} bytes and {self.written} "
                                 "were written: its writer does not write what it declared")
        return {"size": self.size, "sha256": self.digest.hexdigest()}


def crc32_combine(crc1: int, crc2: int, length2: int) -> int:
    """The CRC-32 of A + B from A's (``crc1``), B's (``crc2``) and B's length (zlib's ``crc32_combine``, which
    Python's zlib does not expose): ``crc1`` carried through ``length2`` zero bytes by squaring the operator of
    one zero bit over GF(2)."""
    def times(matrix: list[int], vector: int) -> int:
        total, row = 0, 0
        while vector:
            if vector & 1:
                total ^= matrix[row]
            vector >>= 1
            row += 1
        return total

    def square(matrix: list[int]) -> list[int]:
        return [times(matrix, matrix[n]) for n in range(32)]

    if length2 <= 0:
        return crc1
    odd = [0xEDB88320] + [1 << n for n in range(31)]  # one zero bit
    even = square(odd)  # two
    odd = square(even)  # four
    while True:
        even = square(odd)  # the first time: one zero byte
        if length2 & 1:
            crc1 = times(even, crc1)
        length2 >>= 1
        if not length2:
            break
        odd = square(even)
        if length2 & 1:
            crc1 = times(odd, crc1)
        length2 >>= 1
        if not length2:
            break
    return crc1 ^ crc2


def digests_valid(value) -> bool:
    """gdn_export.json's ``digests``: ``{member: {"size": bytes, "sha256": 64 hex digits}}``."""
    hexdigits = set("0123456789abcdef")
    return isinstance(value, dict) and all(
        isinstance(name, str) and isinstance(entry, dict) and isinstance(entry.get("size"), int)
        and not isinstance(entry["size"], bool) and entry["size"] >= 0 and isinstance(entry.get("sha256"), str)
        and len(entry["sha256"]) == 64 and set(entry["sha256"]) <= hexdigits for name, entry in value.items())


def members_named(tar: tarfile.TarFile, names) -> dict[str, tarfile.TarInfo]:
    """The members named ``names``, the archive's headers read in order only until all are found (the metadata
    lies near an archive's start: ``pack`` sorts the names)."""
    wanted, found = set(names), {}
    for member in tar:
        if member.name in wanted and member.name not in found:
            found[member.name] = member
            if len(found) == len(wanted):
                break
    return found


def read_member(tar: tarfile.TarFile, name: str, path: Path, limit: int | None = None,
                member: tarfile.TarInfo | None = None) -> bytes | None:
    """The bytes of archive member ``name`` (None when absent), refused unless it is a regular file of at most
    ``limit`` bytes (default: ``MEMBER_LIMITS``'s, else ``DEFAULT_MEMBER_LIMIT``): a member is read whole, so its
    size is checked from its header before anything is read (a sparse 3 GiB member is refused at once)."""
    member = member or members_named(tar, [name]).get(name)
    if member is None:
        return None
    if not member.isfile():
        kind = "a symbolic link" if member.issym() or member.islnk() else "not a regular file"
        raise ArchiveError(f"{path}: member {name} is {kind}; gdn_export reads only regular files")
    limit = MEMBER_LIMITS.get(name, DEFAULT_MEMBER_LIMIT) if limit is None else limit
    if member.size > limit:
        raise ArchiveError(f"{path}: member {name} is {member.size / MIB:.1f} MiB, more than the {limit / MIB:.0f} MiB "
                           "gdn_export reads")
    handle = tar.extractfile(member)
    return handle.read(limit + 1) if handle is not None else None


def unreadable(path: Path, err: BaseException, corrupt: str | None) -> str:
    """What is wrong with the archive at ``path``, which failed to read with ``err``, without naming a member: a
    damaged gzip stream (``corrupt``: why, ``gzip_damage``) named as such, else "not a .nnef.tgz archive"
    (``run/reading.py``'s ``damage`` names the member whose recorded digest differs)."""
    reason = str(err).strip().splitlines()[0].rstrip(":") if str(err).strip() else type(err).__name__
    if corrupt is not None:
        return damaged_message(path, corrupt)
    return f"{path} is not a .nnef.tgz archive that gdn-export wrote ({reason})"


def damaged_message(path: Path, why: str) -> str:
    return f"{path} is a damaged gzip file ({why}): the archive is truncated or corrupted; convert it again"


def gzip_damage(path: Path) -> str | None:
    """Why the file at ``path`` is a gzip stream that does not decompress to its end (None: not gzip, or whole)."""
    import gzip

    try:
        with open(path, "rb") as raw:
            if raw.read(2) != b"\x1f\x8b":
                return None
        with gzip.open(path, "rb") as stream:
            while stream.read(MIB):
                pass
    except (OSError, EOFError, zlib.error) as err:
        return str(err).strip() or type(err).__name__
    return None


def first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def text_member(data: bytes, name: str, path: Path) -> str:
    """Member ``name``'s bytes as UTF-8 text, or an ArchiveError."""
    try:
        return data.decode()
    except UnicodeDecodeError:
        raise ArchiveError(f"{path}: {name} is not UTF-8 text") from None


def json_member(data: bytes, name: str, path: Path) -> dict:
    """Member ``name``'s bytes as a JSON object, or an ArchiveError."""
    try:
        value = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError) as err:
        raise ArchiveError(f"{path}: {name} is not valid JSON ({first_line(err)})") from None
    if not isinstance(value, dict):
        raise ArchiveError(f"{path}: {name} must be a JSON object, got {type(value).__name__}")
    return value


# --- gdn_export.json's schema: every field a reader uses, its type and range ----------------------------------

def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _names(value) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) and v for v in value)


def _dimension(value) -> bool:
    return (_is_int(value) and value >= 0) or value in ("B", "P", "S")


def _state(value) -> bool:
    return (isinstance(value, dict) and isinstance(value.get("name"), str) and value["name"]
            and isinstance(value.get("shape"), list) and all(_dimension(d) for d in value["shape"])
            and value.get("dtype") in FLOAT_DTYPES and isinstance(value.get("kind", ""), str)
            and (value.get("layer") is None or _is_int(value["layer"])))


# field: (test, what it must be, required)
METADATA_SCHEMA = {
    "format": (lambda v: _is_int(v) and v >= 1, "an integer >= 1", False),
    "family": (lambda v: isinstance(v, str), "a string", False),
    "model_type": (lambda v: isinstance(v, str), "a string", False),
    "text_model_type": (lambda v: isinstance(v, str), "a string", False),
    "dtype": (lambda v: v in FLOAT_DTYPES, " or ".join(FLOAT_DTYPES), False),
    "core_dtype": (lambda v: v is None or v == "float16", "null or float16", False),
    "vocab_size": (lambda v: _is_int(v) and v >= 1, "an integer >= 1", False),
    "context_length": (lambda v: v is None or _is_int(v) and v >= 1, "null or an integer >= 1", False),
    "inputs": (_names, "a list of names", False),
    "outputs": (_names, "a list of names", False),
    "generation_files": (lambda v: isinstance(v, list) and all(n in GENERATION_FILES for n in v),
                         f"a list of names among {', '.join(GENERATION_FILES)}", False),
    # the weight format's name (gdn_export.weights.formats, a registry the run side does not import: any format's
    # archive runs; the name is shown, never used to read anything)
    "quantize": (lambda v: v is None or isinstance(v, str) and v.isidentifier() and len(v) <= 32,
                 "null or a weight format's name (an identifier of at most 32 characters)", False),
    "logits": (lambda v: v in ("all", "last"), "all or last", False),
    "serving": (lambda v: isinstance(v, bool), "true or false", False),
    "quantized": (lambda v: _is_int(v) and v >= 0, "an integer >= 0", False),
    "states": (lambda v: isinstance(v, list) and all(_state(s) for s in v),
               "a list of {name, shape (sizes >= 0, B, P or S), dtype float32|float16, kind, layer}", False),
    "runtime": (lambda v: isinstance(v, str), "a string", False),
    "decisions": (lambda v: isinstance(v, list) and all(isinstance(d, dict) for d in v), "a list of objects", False),
    DIGESTS_FIELD: (lambda v: digests_valid(v), "an object of {member: {size, sha256}}", False),
    "mtp": (lambda v: isinstance(v, dict) and v.get("member") == "mtp.nnef.tgz"
            and all(_is_int(v.get(k)) and v[k] >= 1 for k in ("hidden_size", "num_key_value_heads", "head_dim"))
            and v.get("dtype") in FLOAT_DTYPES,
            "an object {member: mtp.nnef.tgz, hidden_size, num_key_value_heads, head_dim (integers >= 1), dtype}",
            False),
}


def check_metadata(metadata, where: str = METADATA_FILE) -> dict:
    """``metadata`` (a parsed gdn_export.json) returned as it is once every field a reader uses has its type and
    range (``METADATA_SCHEMA``), else an ArchiveError naming the field; fields it does not know are kept (a later
    version's, or those of ``export(metadata=...)``'s caller). A ``Session`` further needs ``states``."""
    if not isinstance(metadata, dict):
        raise ArchiveError(f"{where} must be a JSON object, got {type(metadata).__name__}")
    for name, (test, expected, required) in METADATA_SCHEMA.items():
        if name not in metadata:
            if required:
                raise ArchiveError(f"{where} has no '{name}' (not written by gdn-export convert)")
            continue
        if not test(metadata[name]):
            raise ArchiveError(f"{where}: '{name}' must be {expected}, got {json.dumps(metadata[name])[:80]}")
    return metadata


def nnef_tgz_path(path: str | os.PathLike) -> Path:
    """``path`` as a Path, refused unless it names a ``.nnef.tgz`` (what tract loads as an archive)."""
    path = Path(path)
    if not path.name.endswith(".nnef.tgz"):
        raise GdnExportError(f"output path {path} must end with .nnef.tgz")
    return path
