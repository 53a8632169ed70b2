"""The registry of checkpoint sources (gdn_export.checkpoints): every entry complete, every bundled fixture folder
recognized by the source that reads it and by no earlier one, every family reachable by its model_type."""

from __future__ import annotations

import pytest

from helpers import FIXTURES
from gdn_export import checkpoints
from gdn_export.hf.checkpoint import CheckpointError

# the fixture folders of each source, by the layout on disk (not by asking the registry)
MEGATRON = sorted(p.name for p in FIXTURES.iterdir() if (p / "latest_checkpointed_iteration.txt").is_file())
HF = sorted(p.name for p in FIXTURES.iterdir() if (p / "config.json").is_file())


def test_every_source_is_complete():
    assert checkpoints.SOURCES, "no checkpoint source registered"
    seen_types: dict[str, str] = {}
    for source in checkpoints.SOURCES:
        module = source.load()
        for name in ("recognizes", "open_folder", "read_config", "families"):
            assert callable(getattr(module, name, None)), f"{source.module} has no {name}()"
        families = module.families()
        assert families, f"{source.name} builds no family"
        for family in families:
            for model_type in family.model_types:
                assert model_type not in seen_types, \
                    f"{model_type} claimed by {seen_types[model_type]} and {source.name}"
                seen_types[model_type] = source.name
                assert checkpoints.family_for(model_type) is family


@pytest.mark.parametrize("name", MEGATRON + HF)
def test_each_fixture_folder_goes_to_its_source(name):
    expected = "gdn_export.megatron.source" if name in MEGATRON else "gdn_export.hf.source"
    assert checkpoints.source_for(FIXTURES / name).module == expected
    config = checkpoints.read_config(FIXTURES / name)
    assert checkpoints.family_for(config["model_type"]) is not None


def test_a_folder_no_source_knows_gets_one_line(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"\0" * 16)
    with pytest.raises(CheckpointError) as err:
        checkpoints.open_checkpoint(tmp_path)
    assert "config.json" in str(err.value) and "\n" not in str(err.value)
