"""Bad inputs to `gdn-export`: each gets its own one-line reason, exit status 1, and no output is left."""

import json
import re
import shutil
from pathlib import Path

import pytest

from gdn_export.cli import main as cli
from helpers import FIXTURES



def convert(capsys, source, out, *extra):
    status = cli(["convert", str(source), "-o", str(out), "--no-check", *extra])
    return status, capsys.readouterr().err


def copy_fixture(tmp_path, name="qwen3_5"):
    folder = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / name, folder)
    return folder


def assert_refused(status, err, message, out):
    assert status == 1
    reasons = [line for line in err.splitlines() if line.startswith("gdn-export: error: ")]
    assert len(reasons) == 1 and message in reasons[0], err
    assert not out.exists() and not [p for p in out.parent.iterdir() if p.name.startswith(".gdn_export_")]


def test_folder_without_config(tmp_path, capsys):
    folder = copy_fixture(tmp_path)
    (folder / "config.json").unlink()
    out = tmp_path / "m.nnef.tgz"
    assert_refused(*convert(capsys, folder, out), "has no config.json", out)


def test_missing_folder(tmp_path, capsys):
    out = tmp_path / "m.nnef.tgz"
    assert_refused(*convert(capsys, tmp_path / "nowhere", out), "is not a directory", out)


def test_unknown_model_type(tmp_path, capsys):
    folder = copy_fixture(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    out = tmp_path / "m.nnef.tgz"
    assert_refused(*convert(capsys, folder, out), "model_type 'llama' is not supported; gdn_export converts:", out)


def test_malformed_config(tmp_path, capsys):
    folder = copy_fixture(tmp_path)
    (folder / "config.json").write_text("{not json")
    out = tmp_path / "m.nnef.tgz"
    assert_refused(*convert(capsys, folder, out), "config.json is not valid JSON", out)


def test_truncated_safetensors(tmp_path, capsys):
    folder = copy_fixture(tmp_path)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    out = tmp_path / "m.nnef.tgz"
    assert_refused(*convert(capsys, folder, out), "model.safetensors is truncated", out)


def test_pickle_weights_are_refused(tmp_path, capsys):
    folder = copy_fixture(tmp_path)
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    out = tmp_path / "m.nnef.tgz"
    assert_refused(*convert(capsys, folder, out), "holds only pickle weights (pytorch_model.bin)", out)


def test_config_sizes_disagree_with_weights(tmp_path, capsys):
    folder = copy_fixture(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    out = tmp_path / "m.nnef.tgz"
    assert_refused(*convert(capsys, folder, out), "disagree with config.json sizes", out)


def test_bad_arguments_are_usage_errors_before_any_work(tmp_path, capsys):
    """A bad option fails at once (exit 2, argparse's one-line reason), even before the checkpoint is looked at."""
    out = tmp_path / "m.nnef.tgz"
    for bad in (["--chunk-size", "24"], ["--chunk-size", "17"], ["--tract-version", "0.23"], ["--dtype", "bf16"]):
        with pytest.raises(SystemExit) as exit_info:
            cli(["convert", str(tmp_path / "nowhere"), "-o", str(out), *bad])
        assert exit_info.value.code == 2, bad
        err = capsys.readouterr().err
        assert "is not a directory" not in err and f"argument {bad[0]}" in err, err
    for bad in (["--batch", "0"], ["--prompt-len", "0"], ["--decode-steps", "-1"]):
        with pytest.raises(SystemExit) as exit_info:
            cli(["check", str(out), str(tmp_path / "nowhere"), *bad])
        assert exit_info.value.code == 2 and f"argument {bad[0]}: must be >=" in capsys.readouterr().err, bad
    assert not out.exists()


def test_output_that_is_a_folder_or_cannot_be_created(tmp_path, capsys):
    folder = tmp_path / "out.nnef.tgz"
    folder.mkdir()
    assert_refused(*convert(capsys, FIXTURES / "qwen3_5", folder), "is a directory", tmp_path / "absent.nnef.tgz")
    assert folder.is_dir() and not any(folder.iterdir())
    status, err = convert(capsys, FIXTURES / "qwen3_5", Path("/proc/gdn_export_test.nnef.tgz"))
    assert status == 1 and "gdn-export: error: cannot write /proc/gdn_export_test.nnef.tgz" in err, err


def test_missing_shard_is_named(tmp_path, capsys):
    folder = copy_fixture(tmp_path)
    (folder / "model.safetensors").rename(folder / "model-00001-of-00002.safetensors")
    index = {"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors",
                                            "b": "model-00002-of-00002.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    out = tmp_path / "m.nnef.tgz"
    assert_refused(*convert(capsys, folder, out), "is missing 1 of the 2 shards named in model.safetensors.index.json: "
                   "model-00002-of-00002.safetensors", out)


@pytest.mark.slow  # converts a fixture
def test_existing_output_needs_force(tmp_path, capsys):
    out = tmp_path / "m.nnef.tgz"
    out.write_bytes(b"keep me")
    status, err = convert(capsys, FIXTURES / "qwen3_5", out)
    assert status == 1 and f"gdn-export: error: {out} exists; pass --force to overwrite it" in err
    assert out.read_bytes() == b"keep me"
    assert cli(["convert", str(FIXTURES / "qwen3_5"), "-o", str(out), "--no-check", "--force"]) == 0
    assert out.read_bytes() != b"keep me"
    assert "not checked (check=False / --no-check)" in capsys.readouterr().out


@pytest.mark.xdist_group("qwen3_5")
def test_info_and_check_commands(tmp_path, capsys, converted):
    out = converted("qwen3_5")
    assert cli(["info", str(out)]) == 0
    text = capsys.readouterr().out
    assert "in_state_0: B,4,16,8,f32" in text and "out_key_1: B,2,S+P,16,f32" in text and "lowerings:" in text
    assert re.search(r"loaded and planned in \d+\.\d s", text), text
    assert cli(["check", str(out), str(FIXTURES / "qwen3_5"), "--prompt-len", "5", "--decode-steps", "2"]) == 0
    text = capsys.readouterr().out
    assert "top-1 agreement" in text and re.search(r"\n  MTP head: max \|logit error\| .* top-1 agreement", text), text
    assert cli(["info", str(tmp_path / "missing.nnef.tgz")]) == 1
    not_an_archive = tmp_path / "text.nnef.tgz"
    not_an_archive.write_text("hello")
    assert cli(["info", str(not_an_archive)]) == 1
    err = capsys.readouterr().err
    assert f"gdn-export: error: no file at {tmp_path / 'missing.nnef.tgz'}" in err
    assert f"gdn-export: error: {not_an_archive} is not a .nnef.tgz archive" in err and "Traceback" not in err


@pytest.mark.xdist_group("qwen3_5")
def test_check_refuses_an_archive_of_another_model(tmp_path, capsys, converted):
    out = converted("qwen3_5")
    assert cli(["check", str(out), str(FIXTURES / "kimi_linear")]) == 1
    assert "holds a Qwen3.5 model (qwen3_5_text); " in capsys.readouterr().err
    folder = copy_fixture(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "vocab_size": config["vocab_size"] + 64}))
    assert cli(["check", str(out), str(folder)]) == 1
    assert f"has a vocabulary of {config['vocab_size']} tokens" in capsys.readouterr().err


@pytest.mark.xdist_group("qwen3_5")
def test_token_ids_outside_the_vocabulary_are_refused(converted):
    import numpy as np

    import gdn_export

    session = gdn_export.Session(converted("qwen3_5"))
    vocab = session.metadata["vocab_size"]
    for bad in (vocab, -1):
        with pytest.raises(gdn_export.GdnExportError, match=f"token id {bad} is outside this model's vocabulary"):
            session.prefill(np.array([[1, bad, 2]]))
    assert session.prefill(np.array([[1, vocab - 1]])).shape[:2] == (1, 2)  # the process and the session go on


@pytest.mark.slow  # converts a fixture
def test_float16_core_on_cuda_converts_and_checks(tmp_path, capsys):
    """An inexact, asked-for f16 core is checked with the float16 rule, passes, and says it rounds."""
    out = tmp_path / "m.nnef.tgz"
    status = cli(["convert", str(FIXTURES / "fla_gated_deltanet"), "-o", str(out), "--runtime", "cuda",
                  "--core-dtype", "float16"])
    captured = capsys.readouterr()
    assert status == 0, captured.err
    assert "rounded to float16" in captured.out and out.is_file()


@pytest.mark.parametrize("signum,stage", [("SIGINT", "checking"), ("SIGTERM", "exporting")])
@pytest.mark.slow  # converts a fixture
def test_interruption_leaves_nothing(tmp_path, signum, stage):
    """Ctrl-C during the check, SIGTERM during the export: exit 130, no output, no temporary file or folder."""
    import signal
    import subprocess
    import sys

    out = tmp_path / "m.nnef.tgz"
    # a check of many decode steps: it lasts long enough for the signal to arrive during it on a loaded machine
    child = subprocess.Popen([sys.executable, "-m", "gdn_export.cli", "convert", str(FIXTURES / "qwen3_5"), "-o",
                              str(out), "--decode-steps", "2000"], stderr=subprocess.PIPE, text=True,
                             # a pytest-xdist worker may ignore SIGINT, and a child inherits that (Python then
                             # installs no Ctrl-C handler): the child starts with the default, as in a terminal
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        for line in child.stderr:
            if stage in line:
                break
        child.send_signal(getattr(signal, signum))
        rest = child.communicate(timeout=60)[1]
    finally:
        child.kill()
    assert child.returncode == 130, rest
    assert "interrupted; no output was left behind" in rest
    assert list(tmp_path.iterdir()) == []


def test_help_imports_no_heavy_library():
    """`gdn-export --help` parses before torch-to-nnef, tract or transformers are imported."""
    import subprocess
    import sys

    code = ("import sys; from gdn_export.cli import parser; parser().format_help(); "
            "print([m for m in ('torch_to_nnef', 'tract', 'transformers', 'nnef_tools') if m in sys.modules])")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "[]"


def test_usage_error_exit_status():
    with pytest.raises(SystemExit) as exit_info:
        cli(["convert"])
    assert exit_info.value.code == 2
