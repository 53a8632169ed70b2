"""The registry of weight formats (gdn_export.weights.formats): every entry complete, and a format added as one folder
and its registry line (tests/toy_weight_format) converts, is checked and runs with no edit anywhere else."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import FIXTURES
from gdn_export.weights import formats

CODEC_REQUIRED = ("quantizable", "nbytes", "round_trip", "write_nnef")


@pytest.mark.parametrize("fmt", formats.all_formats(), ids=lambda f: f.name or "float")
def test_every_format_is_complete(fmt):
    assert fmt.help and (fmt.name is None or (fmt.label and fmt.reference and fmt.codec and fmt.onnx_refusal))
    if fmt.name is not None:
        codec = fmt.codec_module()
        for name in CODEC_REQUIRED:
            assert callable(getattr(codec, name, None)), f"{fmt.codec} has no {name}()"
        assert formats.weight_format(fmt.name) is fmt and fmt.name in formats.names()
    for option in fmt.options:  # an option a format owns is refused without it, in one line naming both
        assert fmt.needs[0] and fmt.needs[1] and option.flag.startswith("--")
        if option.default is None:
            continue
        other = next(f for f in formats.all_formats() if f is not fmt)
        with pytest.raises(Exception) as err:
            formats.check_owned_options(other.name, {option.name: "x"}, None)
        assert str(err.value) == fmt.needs[0]


def test_the_quantization_report_names_no_format():
    """The report holds a format's own values in ``own``, as its codec's ``report_fields`` makes them, and renders
    with them: no field named for one format's option, and a format's words come from its own values."""
    import dataclasses

    from gdn_export.hf.weight_writers import QuantizationReport

    fields = {f.name for f in dataclasses.fields(QuantizationReport)}
    owned = {option.name for fmt in formats.all_formats() for option in fmt.options}
    assert owned and not fields & owned, fields & owned
    for fmt in formats.all_formats():
        if fmt.name is None:
            continue
        codec = fmt.codec_module()
        own = codec.report_fields() if hasattr(codec, "report_fields") else {}
        report = QuantizationReport(scheme=fmt.name, own=own, describe=getattr(codec, "describe", lambda r: ""),
                                    quantized=["w"], bytes_before=2048, bytes_after=512)
        assert str(report).startswith(f"1 weights in {fmt.label} (2.0 KiB -> 0.5 KiB"), str(report)


def test_every_format_folder_is_registered():
    """The folders on disk (weights/<name>/format.py), not the registry's own list: a folder left out of FORMATS fails;
    and --quantize offers exactly the registered formats, each with its words in the help."""
    import argparse

    from gdn_export.cli import parser

    folders = sorted(p.parent.name for p in Path(formats.__file__).parent.glob("*/format.py"))
    assert sorted([*formats.FORMATS, formats.FLOAT]) == folders
    actions = [a for a in parser()._subparsers._group_actions if isinstance(a, argparse._SubParsersAction)]
    convert_actions = actions[0].choices["convert"]._actions
    quantize = next(a for a in convert_actions if "--quantize" in a.option_strings)
    assert set(quantize.choices) == set(formats.names()) >= set(formats.FORMATS)
    assert all(f"{name}:" in quantize.help for name in formats.FORMATS)
    flags = {flag for a in convert_actions for flag in a.option_strings}
    assert all(option.flag in flags for fmt in formats.all_formats() for option in fmt.options)


def test_a_format_folder_loads_no_codec_until_used():
    """The registry and a probe of a format's package (hasattr, as copy or pickle do) import neither numpy nor torch:
    --help lists the formats on the base install."""
    import subprocess
    import sys

    script = ("import sys, gdn_export.weights.q4_0 as q; from gdn_export.weights import formats; formats.names(); "
              "hasattr(q, '__all__'); hasattr(q, '__path__'); "
              "assert not {'numpy', 'torch'} & set(sys.modules), sorted({'numpy', 'torch'} & set(sys.modules))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


@pytest.fixture
def toy_format():
    """tests/toy_weight_format registered for one test, removed after it (the registry is the process's)."""
    import toy_weight_format.format as toy

    formats.register(toy.FORMAT)
    yield toy.FORMAT
    formats.unregister(toy.FORMAT.name)


@pytest.mark.slow
def test_a_format_of_ones_own_converts_checks_and_runs(tmp_path, capsys, toy_format):
    """tests/toy_weight_format registers 'bf16r' on import: the CLI takes it, convert stores its tensors and checks
    the archive against transformers with the same rounded weights (float32 rule), `check` re-rounds, the run side
    runs it, and the check tells it from the float32 weights."""
    from gdn_export import Session, check, convert
    from gdn_export.cli import main as cli

    out = tmp_path / "toy.nnef.tgz"
    assert cli(["convert", str(FIXTURES / "qwen3_5"), "-o", str(out), "--quantize", "bf16r"]) == 0
    assert "weights in BF16R" in capsys.readouterr().out
    with tarfile.open(out) as tar:
        metadata = json.loads(tar.extractfile("gdn_export.json").read())
        head = tar.extractfile("hf.lm_head.weight.dat").read()[128:]
    values = np.frombuffer(head, np.float32)
    assert metadata["quantize"] == "bf16r" and metadata["quantized"] > 0
    assert np.array_equal(values, torch.from_numpy(values.copy()).bfloat16().float().numpy())  # rounded
    assert check(out, FIXTURES / "qwen3_5").ok
    report = convert(FIXTURES / "qwen3_5", tmp_path / "again.nnef.tgz", quantize="bf16r")
    assert report.check.ok and report.check.dtype == "float32", report.check
    quality = report.check.quality  # the same logits against the unrounded weights: outside the float32 rule
    assert quality is not None and quality.max_abs_error > report.check.tolerance, quality
    # the run side: a Session's logits are transformers' with every linear weight rounded as the format stores it
    from gdn_export.hf.checkpoint import load_model
    from gdn_export.parity import max_abs_error

    model = load_model(FIXTURES / "qwen3_5")
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.copy_(module.weight.bfloat16().float())
        tokens = np.array([[1, 2, 3, 4, 5, 6, 7]])
        expected = model(input_ids=torch.from_numpy(tokens)).logits.numpy()
    actual = Session(out).prefill(tokens)
    assert max_abs_error(actual, expected) <= 1e-4 * max(1.0, float(np.abs(expected).max()))  # the float32 rule
