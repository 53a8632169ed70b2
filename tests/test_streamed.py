"""Real checkpoints: a streamed conversion writes the same archive as an in-memory one; bad checkpoints are
one-line errors that leave nothing behind; the layer-by-layer check; tokenizer files carried."""

import json
import re
import shutil
import tarfile
from pathlib import Path

import pytest
from safetensors import safe_open

from gdn_export.hf.checkpoint import CheckpointError
from gdn_export.hf.convert import check, convert
from gdn_export.session import Session

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def members(path: Path) -> dict[str, bytes]:
    with tarfile.open(path) as tar:
        out = {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}
    out["graph.nnef"] = re.sub(rb'\("export_date".*', b"", out["graph.nnef"])
    return out


@pytest.mark.parametrize("name,dtype", [("qwen3_5_vl", "float32"), ("qwen3_next_bf16_sharded", "float32"),
                                        pytest.param("kimi_linear", "float32", marks=pytest.mark.xfail(
                                            strict=False, reason="graph.nnef op order differed once in a fresh run "
                                            "(tensors equal): nondeterministic naming, open")),
                                        ("qwen3_5_moe_vl", "float16")])
def test_streamed_archive_equals_in_memory(tmp_path, name, dtype):
    streamed = convert(FIXTURES / name, tmp_path / "s.nnef.tgz", dtype=dtype, check=False)
    convert(FIXTURES / name, tmp_path / "m.nnef.tgz", dtype=dtype, check=False, streamed=False)
    a, b = members(tmp_path / "s.nnef.tgz"), members(tmp_path / "m.nnef.tgz")
    assert sorted(a) == sorted(b)
    assert [k for k in a if a[k] != b[k]] == []
    assert {"read", "trace", "write", "pack"} <= set(streamed.seconds)


def header_names(folder: Path) -> list[str]:
    names = []
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), "pt") as handle:
            names += list(handle.keys())
    return names


def test_wrapper_and_sharded_reports_count_what_was_left_out(tmp_path):
    vision = sum(n.startswith("model.visual.") for n in header_names(FIXTURES / "qwen3_5_vl"))
    report = convert(FIXTURES / "qwen3_5_vl", tmp_path / "vl.nnef.tgz", check=False)
    assert f"left out: {vision} vision tower" in report.weights and vision > 0
    assert not any("lm_head" in n for n in members(tmp_path / "vl.nnef.tgz"))  # tied by the top-level flag
    index = json.loads((FIXTURES / "qwen3_next_bf16_sharded" / "model.safetensors.index.json").read_text())
    mtp = sum(n.startswith("mtp.") for n in index["weight_map"])
    report = convert(FIXTURES / "qwen3_next_bf16_sharded", tmp_path / "n.nnef.tgz", check=False)
    assert f"{mtp} ignored by transformers on load" in report.weights and mtp > 0


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_layerwise_check(tmp_path, dtype):
    out = tmp_path / "n.nnef.tgz"
    report = convert(FIXTURES / "qwen3_next_bf16_sharded", out, dtype=dtype, check="layerwise")
    assert report.check.ok and "layer by layer" in report.check_kind
    if dtype == "float32":
        full = check(out, FIXTURES / "qwen3_next_bf16_sharded", kind="full")
        assert full.ok and full.max_abs_error <= 1e-4 * max(1.0, full.max_abs_logit)


def copy(tmp_path: Path, name: str) -> Path:
    return Path(shutil.copytree(FIXTURES / name, tmp_path / name))


def refused(tmp_path: Path, folder: Path, pattern: str) -> None:
    out_dir = tmp_path / "out"
    with pytest.raises(CheckpointError, match=pattern) as err:
        convert(folder, out_dir / "x.nnef.tgz", check=False)
    assert "\n" not in str(err.value)
    assert not out_dir.exists() or list(out_dir.iterdir()) == []


def test_missing_shard(tmp_path):
    folder = copy(tmp_path, "qwen3_next_bf16_sharded")
    (folder / "model-00002-of-00004.safetensors").unlink()
    refused(tmp_path, folder, "missing 1 of the 4 shards.*model-00002-of-00004")


def test_index_disagreeing_with_a_shard(tmp_path):
    folder = copy(tmp_path, "qwen3_next_bf16_sharded")
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    name = "model.norm.weight"
    index["weight_map"][name] = "model-00001-of-00004.safetensors" if index["weight_map"][name] != \
        "model-00001-of-00004.safetensors" else "model-00002-of-00004.safetensors"
    index_path.write_text(json.dumps(index))
    refused(tmp_path, folder, re.escape(name))


def test_wrapper_without_text_config(tmp_path):
    folder = copy(tmp_path, "qwen3_5_vl")
    config = json.loads((folder / "config.json").read_text())
    del config["text_config"]
    (folder / "config.json").write_text(json.dumps(config))
    refused(tmp_path, folder, "text_config")


def rewrite_shard(path: Path, change) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_bf16_tensor_of_the_wrong_shape(tmp_path):
    folder = copy(tmp_path, "qwen3_next_bf16_sharded")
    shard = folder / "model-00001-of-00004.safetensors"
    name = next(n for n in header_names_of(shard) if n.endswith("proj.weight"))
    shape = []

    def change(tensors):
        shape.extend(tensors[name].shape)
        tensors[name] = tensors[name][:-1].contiguous()

    rewrite_shard(shard, change)
    refused(tmp_path, folder, re.escape(name) + r".*\[" + str(shape[0] - 1))


def header_names_of(path: Path) -> list[str]:
    with safe_open(str(path), "pt") as handle:
        return list(handle.keys())


def test_unknown_tensor(tmp_path):
    import torch

    folder = copy(tmp_path, "qwen3_next_bf16_sharded")
    shard = folder / "model-00004-of-00004.safetensors"
    rewrite_shard(shard, lambda tensors: tensors.update({"model.extra.weight": torch.zeros(2, dtype=torch.bfloat16)}))
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["model.extra.weight"] = shard.name
    index_path.write_text(json.dumps(index))
    refused(tmp_path, folder, "does not describe: model.extra.weight")


def test_tokenizer_and_generation_files_are_carried(tmp_path):
    from transformers import AutoTokenizer

    out = tmp_path / "vl.nnef.tgz"
    report = convert(FIXTURES / "qwen3_5_vl", out, check=False)
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= set(report.generation_files)
    session = Session(out)
    reference = AutoTokenizer.from_pretrained(str(FIXTURES / "qwen3_5_vl"))
    ids = session.tokenizer.encode("Hello world").ids
    assert ids == reference("Hello world")["input_ids"]
    assert session.tokenizer.decode(ids) == "Hello world"
    fixture_config = json.loads((FIXTURES / "qwen3_5_vl" / "tokenizer_config.json").read_text())
    assert session.chat_template == fixture_config["chat_template"]
    generation = json.loads((FIXTURES / "qwen3_5_vl" / "generation_config.json").read_text())
    assert session.generation_config["eos_token_id"] == generation["eos_token_id"]
    bare = convert(FIXTURES / "qwen3_next", tmp_path / "n.nnef.tgz", check=False)
    assert bare.generation_files == [] and "takes token ids" in str(bare)
    assert Session(tmp_path / "n.nnef.tgz").tokenizer is None
