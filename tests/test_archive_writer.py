"""The archive writer (``run/archive.ArchiveWriter``, what ``pack`` and every conversion write with) against Python's
own tarfile, gzip and hashlib: the members in ``member_order``, each byte as given, the digests gdn_export.json
records, a gzip stream whose CRC-32 and size check, whatever the gap left for gdn_export.json and the graph."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import tarfile
import zlib

import pytest

from gdn_export.errors import GdnExportError
from gdn_export.run.archive import PARALLEL_HASH_BYTES, STREAM_CHUNK, ArchiveWriter, crc32_combine, pack

# a graph reading its weights in an order that is not their names' (the writer must follow the graph)
GRAPH = """version 1.0;

graph G(input) -> (output)
{
    w_late = variable<scalar>(label = 'zeta', shape = [3, 4]);
    w_big = variable<scalar>(label = 'beta', shape = [2]);
    w_streamed = variable<scalar>(label = 'streamed', shape = [5]);
    w_early = variable<scalar>(label = 'alpha', shape = [1]);
    output = add(input, w_late);
}
"""


def _folder(tmp_path):
    folder = tmp_path / "model.nnef"
    folder.mkdir()
    (folder / "graph.nnef").write_text(GRAPH)
    contents = {"zeta.dat": os.urandom(1000), "beta.dat": os.urandom(PARALLEL_HASH_BYTES + 70_001),
                "alpha.dat": b"", "notes.txt": b"a file the graph does not name"}
    for name, data in contents.items():
        (folder / name).write_bytes(data)
    return folder, contents


def _read(archive):
    """(member names in order, their bytes, the gzip stream's content): tarfile for the members, gzip (which checks
    the trailer's CRC-32 and size) for the whole stream."""
    with tarfile.open(archive, "r:gz") as tar:
        members = tar.getmembers()
        data = {m.name: tar.extractfile(m).read() for m in members}
    with gzip.open(archive, "rb") as stream:
        content = stream.read()
    return [m.name for m in members], data, content


def test_pack_writes_members_in_graph_order_with_their_digests(tmp_path):
    folder, contents = _folder(tmp_path)
    (folder / "gdn_export.json").write_text(json.dumps({"format": 1, "outputs": ["output"]}))
    pack(folder, tmp_path / "a.nnef.tgz")
    names, data, content = _read(tmp_path / "a.nnef.tgz")
    assert names == ["gdn_export.json", "graph.nnef", "zeta.dat", "beta.dat", "alpha.dat", "notes.txt"]
    assert len(content) % tarfile.RECORDSIZE == 0  # padded to a record, as tarfile pads
    assert data["graph.nnef"] == GRAPH.encode()
    metadata = json.loads(data.pop("gdn_export.json"))
    assert metadata["format"] == 1 and metadata["outputs"] == ["output"]
    for name, value in contents.items():
        assert data[name] == value, name
    assert metadata["digests"] == {name: {"size": len(value), "sha256": hashlib.sha256(value).hexdigest()}
                                   for name, value in sorted(data.items())}
    assert list(metadata["digests"]) == sorted(metadata["digests"])


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "direct"])
@pytest.mark.parametrize("bound, growth", [(0, 0), (1000, 300), (1000, 5000)], ids=["exact", "padded", "outgrown"])
def test_streamed_members_and_a_graph_rewritten_meanwhile(tmp_path, bound, growth, direct):
    """A member written by a callable (in two writes), the graph rewritten while the body is written (the output
    names' pass does that) and gdn_export.json longer or shorter than its draft: the archive is the same whether
    the gap fits exactly, is padded (the gzip comment) or was outgrown (the body copied behind a larger start),
    and whether the body went through the page cache or past it (O_DIRECT, where the file system has it)."""
    folder, contents = _folder(tmp_path)
    streamed = os.urandom(STREAM_CHUNK + 3 * 65_535 + 7)  # the body more than one chunk of the writer's buffer

    def write(file):
        file.write(streamed[:100])
        file.write(memoryview(streamed)[100:])

    archive = tmp_path / "b.nnef.tgz"
    draft = {"format": 1, "names": ["x" * 40]}
    with ArchiveWriter(archive, folder, {"streamed.dat": (len(streamed), write)}, metadata_draft=draft,
                       graph_growth=bound, direct=direct) as writer:
        writer.write_body()
        grown = GRAPH.replace("output = add", "# " + "g" * growth + "\n    output = add")
        (folder / "graph.nnef").write_text(grown)
        metadata = {"format": 1, "names": ["x" * 10]}
        writer.finish(metadata)
    names, data, _ = _read(archive)
    assert names == ["gdn_export.json", "graph.nnef", "zeta.dat", "beta.dat", "streamed.dat", "alpha.dat",
                     "notes.txt"]
    assert data["streamed.dat"] == streamed and data["graph.nnef"] == grown.encode()
    recorded = json.loads(data.pop("gdn_export.json"))
    assert recorded["names"] == metadata["names"]
    assert recorded["digests"] == {name: {"size": len(value), "sha256": hashlib.sha256(value).hexdigest()}
                                   for name, value in sorted(data.items())}
    flags = archive.read_bytes()[3]
    assert bool(flags & 0x10) == (0 < growth < bound)  # FCOMMENT: the gap's unused bytes


@pytest.mark.parametrize("written", [9, 11])
def test_a_writer_that_writes_another_size_is_refused(tmp_path, written):
    folder, _ = _folder(tmp_path)
    with ArchiveWriter(tmp_path / "c.nnef.tgz", folder, {"streamed.dat": (10, lambda f: f.write(b"x" * written))},
                       metadata_draft={}) as writer:
        with pytest.raises(GdnExportError, match="streamed.dat was announced as 10 bytes"):
            writer.write_body()


def test_crc32_combine_is_zlibs():
    for first, second in [(b"", b"x"), (b"abc", b""), (os.urandom(1000), os.urandom(77_777)),
                          (os.urandom(3), os.urandom(1 << 20))]:
        assert crc32_combine(zlib.crc32(first), zlib.crc32(second), len(second)) == zlib.crc32(first + second)
