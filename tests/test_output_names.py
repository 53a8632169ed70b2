"""tract's output names are learnt without reading the weights and without loading the whole graph: the graph with
its weight matrices declared as inputs (``tract_names(..., inputs_from_bytes=...)``) reports the same names as the
graph itself, and ``renamed_outputs`` (the first layers' cut of it, outputs of one kind answered by the earliest)
names the outputs tract's load of the whole graph renames, no more, no fewer, on every fixture."""

import json
import re
import tarfile
from pathlib import Path

import pytest

from gdn_export.backends.nnef.output_names import RAW_SUFFIX, renamed_outputs, tract_names
from helpers import CHECKPOINTS, by_fixture



def unwrapped(archive: Path, folder: Path) -> list[str]:
    """The archive's graph in ``folder`` as torch-to-nnef wrote it: the select wrappers of the renamed outputs
    removed, their ``__raw`` names given back. Returns the names that had been renamed."""
    with tarfile.open(archive) as tar:
        tar.extractall(folder)
    renamed = json.loads((folder / "gdn_export.json").read_text())["output_names_kept"]
    text = (folder / "graph.nnef").read_text()
    for name in renamed:
        text = re.sub(rf"^\s*{re.escape(name)}(__c)? = .*;\n", "", text, flags=re.M)
        text = re.sub(rf"(?<![\w.]){re.escape(name + RAW_SUFFIX)}(?![\w.])", name, text)
    (folder / "graph.nnef").write_text(text)
    return renamed


@pytest.mark.parametrize("name", by_fixture(*CHECKPOINTS))
def test_names_without_the_weights_are_tracts_names(name, converted, tmp_path):
    agrees_with_tract(converted(name), tmp_path)


@pytest.mark.parametrize("name", by_fixture("qwen3_5"))
def test_names_of_a_float16_archive(name, converted, tmp_path):
    """Its MTP head's 'hidden' output is a cast that changes the type: tract keeps its name, and the export knew
    it from the types (which the archive's text alone does not give ``renamed_outputs``)."""
    agrees_with_tract(converted(name, "float16"), tmp_path, text_alone=False)


def agrees_with_tract(archive: Path, tmp_path: Path, text_alone: bool = True) -> None:
    renamed = unwrapped(archive, tmp_path)
    declared, reported, facts = tract_names(tmp_path)
    assert [d for d, r in zip(declared, reported) if d != r] == renamed  # the export wrapped what tract renames
    assert tract_names(tmp_path, inputs_from_bytes=0) == (declared, reported, facts)
    if text_alone:
        assert renamed_outputs(tmp_path, inputs_from_bytes=0) == renamed
