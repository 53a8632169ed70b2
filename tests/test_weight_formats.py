"""The registry of weight formats (gdn_export.weights.formats): every entry complete, and a format added as one folder
and its registry line (tests/toy_weight_format) converts, is checked and runs with no edit anywhere else."""

from __future__ import annotations

import json
import tarfile

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


def test_the_cli_lists_the_registry():
    from gdn_export.cli import parser

    text = parser().parse_args  # noqa: F841  (the parser builds: its choices come from the registry)
    import argparse

    actions = [a for a in parser()._subparsers._group_actions if isinstance(a, argparse._SubParsersAction)]
    quantize = next(a for a in actions[0].choices["convert"]._actions if "--quantize" in a.option_strings)
    assert tuple(quantize.choices) == formats.names()
    assert all(f"{name}:" in quantize.help for name in formats.names())


@pytest.mark.slow
def test_a_format_of_ones_own_converts_checks_and_runs(tmp_path, capsys):
    """tests/toy_weight_format registers 'bf16r' on import: the CLI takes it, convert stores its tensors and checks
    the archive against transformers with the same rounded weights (float32 rule), `check` re-rounds, the run side
    runs it, and the check tells it from the float32 weights."""
    import toy_weight_format.format  # noqa: F401  (its registry line)
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
    session = Session(out)
    logits = session.prefill(np.array([[1, 2, 3]]))
    assert logits.shape[:2] == (1, 3) and np.isfinite(logits).all()
