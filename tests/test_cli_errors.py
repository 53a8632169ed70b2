"""Bad inputs to `gdn-export`: each gets its own one-line reason, exit status 1, and no output is left."""

import json
import shutil
from pathlib import Path

import pytest

from gdn_export.cli import main as cli

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


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


def test_bad_chunk_size(tmp_path, capsys):
    out = tmp_path / "m.nnef.tgz"
    assert_refused(*convert(capsys, FIXTURES / "qwen3_5", out, "--chunk-size", "24"),
                   "chunk_size: a chunk size must be a positive multiple of 16 tokens, got 24", out)


def test_existing_output_needs_force(tmp_path, capsys):
    out = tmp_path / "m.nnef.tgz"
    out.write_bytes(b"keep me")
    status, err = convert(capsys, FIXTURES / "qwen3_5", out)
    assert status == 1 and "exists; pass force=True (--force) to overwrite it" in err
    assert out.read_bytes() == b"keep me"
    status, _ = convert(capsys, FIXTURES / "qwen3_5", out, "--force")
    assert status == 0 and out.read_bytes() != b"keep me"


def test_info_and_check_commands(tmp_path, capsys):
    out = tmp_path / "m.nnef.tgz"
    assert convert(capsys, FIXTURES / "qwen3_5", out)[0] == 0
    assert cli(["info", str(out)]) == 0
    text = capsys.readouterr().out
    assert "in_state_0: B,4,16,8,f32" in text and "out_key_1: B,2,S+P,16,f32" in text and "lowerings:" in text
    assert cli(["check", str(out), str(FIXTURES / "qwen3_5"), "--prompt-len", "5", "--decode-steps", "2"]) == 0
    assert "top-1 agreement" in capsys.readouterr().out
    assert cli(["info", str(tmp_path / "missing.nnef.tgz")]) == 1


def test_usage_error_exit_status():
    with pytest.raises(SystemExit) as exit_info:
        cli(["convert"])
    assert exit_info.value.code == 2
