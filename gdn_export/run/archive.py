"""The ``.nnef.tgz`` archive gdn_export writes: packing, the path rule, and the ``gdn_export.json`` it carries."""

from __future__ import annotations

import hashlib
import json
import os
import re
import tarfile
import zlib
from pathlib import Path

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


# gzip without compression ("stored" blocks): tract reads the gzip stream all the same, and deflate even at its
# fastest level packed ~55 MB/s here, a third of a large model's conversion, for ~10% on float16 weights
COMPRESS_LEVEL = 0


def pack(folder: Path, archive: Path) -> None:
    """tar.gz the folder's files at the archive root (what tract loads), stored without compression; when the folder
    holds a gdn_export.json, every other file's size and SHA-256 are recorded in it first (``DIGESTS_FIELD``: what
    ``gdn_export.run.integrity`` checks before tract reads the archive)."""
    metadata_file = folder / METADATA_FILE
    if metadata_file.is_file():
        metadata = json.loads(metadata_file.read_text())
        metadata[DIGESTS_FIELD] = file_digests(folder)
        metadata_file.write_text(json.dumps(metadata, indent=1))
    with tarfile.open(archive, "w:gz", compresslevel=COMPRESS_LEVEL) as tar:
        for file in member_order(folder):
            tar.add(file, arcname=file.name)


# a variable of graph.nnef: its label (group 2: the weight file ``<label>.dat``) and shape (group 3)
VARIABLE = re.compile(r"variable\s*<\s*\w+\s*>\s*\(\s*label\s*=\s*(['\"])(.*?)\1\s*,\s*shape\s*=\s*\[([^\]]*)\]")


def member_order(folder: Path) -> list[Path]:
    """The order ``pack`` writes a folder's files in: the metadata and the graph first, then each weight in the order
    the graph first reads it, then the rest by name. A reader that goes through the archive once (the integrity
    pass) then knows the graph before the weights, and has the first layers' weights first: a model planned in
    segments (run/segments.py) starts loading its first segment while the pass reads the others' weights."""
    files = {entry.name: entry for entry in folder.iterdir()}
    graph = files.get("graph.nnef")
    text = graph.read_text() if graph is not None else ""
    labels = [match.group(2) for match in VARIABLE.finditer(text)]
    first = [name for name in (METADATA_FILE, "graph.nnef") if name in files]
    weights = [name for name in dict.fromkeys(f"{label}.dat" for label in labels) if name in files]
    rest = sorted(set(files) - set(first) - set(weights))
    return [files[name] for name in first + weights + rest]


def file_digests(folder: Path) -> dict[str, dict]:
    """``{name: {"size", "sha256"}}`` of the files of ``folder`` but gdn_export.json (what ``pack`` records)."""
    digests = {}
    for file in sorted(folder.iterdir()):
        if file.name == METADATA_FILE or not file.is_file():
            continue
        digest = hashlib.sha256()
        with open(file, "rb") as handle:
            while chunk := handle.read(8 * MIB):
                digest.update(chunk)
        digests[file.name] = {"size": file.stat().st_size, "sha256": digest.hexdigest()}
    return digests


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
