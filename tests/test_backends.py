"""The table of back-ends (``gdn_export.targets.BACKENDS``): every entry complete, every piece it names there and of
the right kind, and every reader of the table (the CLI, ``open_runner``, ``convert``'s steps) choosing by it. Fast:
it imports the pieces, converts nothing (the conversions of each back-end have their own tests)."""

from __future__ import annotations

import inspect

import pytest

from gdn_export.errors import GdnExportError
from gdn_export.targets import ALL_RUNTIMES, BACKENDS, backend_for, backend_named, load

STEPS = ("validate", "validate_after_check", "output_path", "read", "export", "check_reference", "check_targets")
RUNNER = ("OPTIONS", "reset", "prefill", "decode")
# every keyword of gdn_export.export: each back-end's export takes them all (it refuses those it has no use for)
EXPORT_KEYWORDS = {"lowering", "input_names", "output_names", "dynamic_axes", "check", "metadata", "runtime",
                   "core_dtype", "chunk_size", "tract_version", "weights", "extra_files"}


def test_names_and_suffixes_are_unique():
    assert len({b.name for b in BACKENDS}) == len(BACKENDS)
    suffixes = [b.suffix for b in BACKENDS]
    assert len(set(suffixes)) == len(suffixes)
    # no suffix ends another (".tgz" would take ".nnef.tgz"'s files): the choice by suffix is unambiguous
    assert not [(a, b) for a in suffixes for b in suffixes if a != b and a.endswith(b)]


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
def test_every_entry_is_complete(backend):
    assert backend.name and backend.suffix.startswith(".") and backend.help.startswith(backend.name)
    assert backend.runtimes and set(backend.runtimes) <= set(ALL_RUNTIMES)
    export = load(backend.export)
    assert EXPORT_KEYWORDS <= set(inspect.signature(export).parameters), f"{backend.export} misses a keyword"
    steps = load(backend.steps)
    assert [name for name in STEPS if not callable(getattr(steps, name, None))] == []
    runner = load(backend.runner)
    assert [name for name in RUNNER if not hasattr(runner, name)] == []
    assert set(runner.OPTIONS) <= set(inspect.signature(runner.__init__).parameters)
    assert callable(load(backend.metadata))


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
def test_a_file_reaches_its_backend_by_suffix(backend, tmp_path):
    from gdn_export.run.runner import runner_class

    path = tmp_path / f"model{backend.suffix}"
    assert backend_for(path) is backend and backend_named(backend.name) is backend
    assert runner_class(path) is load(backend.runner)


def test_an_unknown_suffix_is_an_archive_and_an_unknown_format_is_refused(tmp_path):
    assert backend_for(tmp_path / "model.tar.gz") is BACKENDS[0]
    with pytest.raises(GdnExportError, match=r"format 'tflite' is not one of nnef, onnx"):
        backend_named("tflite")


def test_the_cli_offers_every_backend():
    import argparse

    from gdn_export.cli import parser

    commands = next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction))
    fmt = next(a for a in commands.choices["convert"]._actions if "--format" in a.option_strings)
    assert list(fmt.choices) == [b.name for b in BACKENDS]


# a value each owned option may be given with (what only its back-end takes); the test fails for an option added to
# a back-end's owns without one here
GIVEN = {"quantize_embeddings": True, "q4_rule": "search", "calibration": "calibration.txt", "core_dtype": "float16",
         "chunk_size": 64, "tail_chunk": 1, "tract_version": "0.23.9", "weights": object(), "extra_files": {"a.txt": "a.txt"}}


@pytest.mark.parametrize("owner, option", [(b, o) for b in BACKENDS for o in b.owns],
                         ids=lambda x: getattr(x, "name", ""))
def test_every_other_backend_refuses_what_one_owns(owner, option, tmp_path):
    """An option only ``owner`` takes, given to another back-end's convert (and export), is refused in one line that
    names it and, for the command line, its flag; nothing is traced or read first."""
    import torch

    import gdn_export
    from gdn_export.pipeline.convert import plan_conversion

    for other in (b for b in BACKENDS if b is not owner):
        if option.flag is not None:
            with pytest.raises(GdnExportError, match=rf"^{option.name}\b.* not available with format='{other.name}'") \
                    as err:
                plan_conversion(tmp_path, tmp_path / f"out{other.suffix}", format=other.name,
                                **({"calibration": GIVEN[option.name]} if option.name == "calibration" else
                                   {option.name: GIVEN[option.name]}))
            assert err.value.flags.startswith(f"{option.flag} is not available with --format {other.name}")
        if option.export:
            with pytest.raises(GdnExportError, match=rf"^{option.name} is an {owner.name.upper()} option"):
                gdn_export.export(torch.nn.Identity(), (torch.zeros(1),), tmp_path / f"out{other.suffix}",
                                  format=other.name, **{option.name: GIVEN[option.name]})
