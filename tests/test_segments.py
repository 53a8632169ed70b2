"""An archive planned in segments (``run/segments.py``): the graph cut at layer boundaries, each segment planned by
tract on its own and run in turn. The reference is the same archive planned whole: every position's logits and every
state after a prefill and decode steps must be the same to the bit (the same operations on the same values, cut
between two of them), on the first load of a graph (segments planned one after the other, their cuts' facts
recorded) and on a later one (planned side by side from the record)."""

import io
import json
import shutil
import tarfile

import numpy as np
import pytest

from gdn_export.run.archive import ArchiveError
from gdn_export.run import segments
from gdn_export.run.runtime import tract_version
from gdn_export.run.session import Session

from helpers import by_fixture


def _run(path, tokens):
    """Logits of a prefill then two decode steps, and every state after them, of a fresh Session on ``path``."""
    session = Session(path)
    outputs = [session.prefill(tokens)]
    for step in range(2):
        outputs.append(session.decode(tokens[:, step:step + 1]))
    return outputs + [state.to_numpy() for state in session._states]


@pytest.mark.parametrize("name", by_fixture("qwen3_5", "kimi_linear"))
def test_segments_match_the_whole_plan_bit_for_bit(name, converted, tmp_path, monkeypatch, capfd):
    archive = tmp_path / "copy.nnef.tgz"  # a copy: conftest plans its converted archives once, whole
    shutil.copy(converted(name), archive)
    monkeypatch.setenv(segments.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setenv(segments.UNPACK_ENV, str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    vocab = Session(archive).metadata["vocab_size"]
    tokens = np.random.default_rng(7).integers(0, vocab, size=(1, 70))  # past a chunk of 64: both GDN paths
    monkeypatch.setenv(segments.SEGMENTS_ENV, "1")
    whole = _run(archive, tokens)
    for count in (2, 3):
        monkeypatch.setenv(segments.SEGMENTS_ENV, str(count))
        graph = tarfile.open(archive).extractfile("graph.nnef").read().decode()
        plan = segments.plan(graph, count)
        assert len(plan.segments) == count and all(s.crossing_in for s in plan.segments[1:])
        record = segments.facts_file(graph, plan, tract_version())
        assert not record.exists()
        first = _run(archive, tokens)  # planned one segment after the other: the cuts' facts recorded
        assert record.exists()
        later = _run(archive, tokens)  # planned side by side from the record, each as its weights are read
        for got in (first, later):
            assert len(got) == len(whole)
            for a, b in zip(got, whole):
                assert a.shape == b.shape and np.array_equal(a, b)
    # an archive packed before the graph came first (members by name: some weights before the graph, the
    # metadata after some): the same segments, from the same record
    shuffled = tmp_path / "by_name.nnef.tgz"
    with tarfile.open(archive) as tar, tarfile.open(shuffled, "w:gz", compresslevel=0) as out:
        members = {m.name: (m, tar.extractfile(m).read()) for m in tar}
        for name in sorted(members):
            out.addfile(members[name][0], io.BytesIO(members[name][1]))
    got = _run(shuffled, tokens)
    assert all(np.array_equal(a, b) for a, b in zip(got, whole))
    assert list((tmp_path / "tmp").iterdir()) == []  # every unpacked folder removed
    assert "loaded whole" not in capfd.readouterr().err  # no fallback: the segments ran


def test_a_graph_too_small_to_cut_is_loaded_whole_with_a_warning(converted, tmp_path, monkeypatch, capfd):
    archive = tmp_path / "copy.nnef.tgz"
    shutil.copy(converted("qwen3_5"), archive)
    monkeypatch.setenv(segments.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setenv(segments.SEGMENTS_ENV, "8")
    tokens = np.arange(5)[None]
    got = Session(archive).prefill(tokens)
    assert "loaded whole, not in 8 segments" in capfd.readouterr().err
    monkeypatch.setenv(segments.SEGMENTS_ENV, "1")
    assert np.array_equal(got, Session(archive).prefill(tokens))


def test_a_damaged_archive_is_still_an_error_when_planned_in_segments(converted, tmp_path, monkeypatch):
    """The integrity pass that unpacks the weights for the segments is the one that checks them: a changed byte in a
    weight is the error naming it, not a fallback, and nothing unpacked is left behind."""
    archive, damaged = tmp_path / "damaged.nnef.tgz", None
    with tarfile.open(converted("qwen3_5")) as tar, tarfile.open(archive, "w:gz") as out:
        for member in tar:
            data = tar.extractfile(member).read()
            if damaged is None and member.name.endswith(".dat") and member.size > 1024:
                data, damaged = data[:-1] + bytes([data[-1] ^ 1]), member.name  # one bit of one weight
            out.addfile(member, io.BytesIO(data))
    monkeypatch.setenv(segments.SEGMENTS_ENV, "2")
    monkeypatch.setenv(segments.UNPACK_ENV, str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    with pytest.raises(ArchiveError, match=damaged):
        Session(archive).prefill(np.arange(3)[None])
    assert list((tmp_path / "tmp").iterdir()) == []


def test_weights_too_heavy_for_their_graph_are_loaded_whole(converted, tmp_path, monkeypatch):
    """Cutting pays in graph and costs in bytes (the weights written out and read back): past
    MAX_BYTES_PER_STATEMENT an archive is loaded whole, and the integrity pass stops writing its weights out."""
    monkeypatch.delenv(segments.SEGMENTS_ENV, raising=False)
    monkeypatch.setenv(segments.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(segments, "STATEMENTS_PER_SEGMENT", 100)  # the fixture's small graph taken as a big one
    text = tarfile.open(converted("qwen3_5")).extractfile("graph.nnef").read().decode()
    statements = text.count(";\n")
    for per_statement, cut in ((segments.MAX_BYTES_PER_STATEMENT + 1, False), (segments.MAX_BYTES_PER_STATEMENT, True)):
        load = segments.SegmentedLoad(tmp_path, 2, tract_version(), None, None, None, None,
                                      archive_bytes=per_statement * statements)
        assert load.wants_weights()  # before the graph is known
        load.graph(text)
        assert (load.plan is not None) == cut and load.wants_weights() == cut
    monkeypatch.setattr(segments, "MAX_STATEMENTS", statements - 1)  # a graph too big to plan a cut for: whole
    load = segments.SegmentedLoad(tmp_path, 2, tract_version(), None, None, None, None, archive_bytes=1)
    load.graph(text)
    assert load.plan is None and load.fault and not load.wants_weights()


def test_a_wrong_record_is_removed_and_the_archive_still_runs(converted, tmp_path, monkeypatch, capfd):
    """A facts record that is not what tract states (edited, or left by another cutter) never reaches a call: the
    segment that gives the tensor finds the difference, the record is removed and the archive loaded whole."""
    archive = tmp_path / "copy.nnef.tgz"
    shutil.copy(converted("qwen3_5"), archive)
    monkeypatch.setenv(segments.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setenv(segments.SEGMENTS_ENV, "2")
    tokens = np.arange(7)[None]
    right = Session(archive).prefill(tokens)  # records the facts
    graph = tarfile.open(archive).extractfile("graph.nnef").read().decode()
    record = segments.facts_file(graph, segments.plan(graph, 2), tract_version())
    facts = json.loads(record.read_text())
    facts["facts"] = {k: v.replace("B,", "1,", 1) if v.startswith("B,") else "B," + v for k, v in facts["facts"].items()}
    record.write_text(json.dumps(facts))
    capfd.readouterr()
    assert np.array_equal(Session(archive).prefill(tokens), right)
    assert "loaded whole" in capfd.readouterr().err and not record.exists()


def test_info_reads_a_segmented_archive_as_one_model(converted, tmp_path, monkeypatch, capsys):
    from gdn_export.cli import main

    monkeypatch.setenv(segments.SEGMENTS_ENV, "2")
    monkeypatch.setenv(segments.CACHE_ENV, str(tmp_path))
    assert main(["info", str(converted("qwen3_5"))]) == 0
    assert "logits" in capsys.readouterr().out
