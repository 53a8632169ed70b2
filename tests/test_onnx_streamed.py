"""A streamed ONNX conversion (weights traced as placeholders, written from the checkpoint into OUT.onnx.data) writes
the in-memory export's files byte for byte; the writer's permutations against numpy; a fold computed from a
placeholder is refused, and the conversion then exports from memory (the same files again)."""

import hashlib
import itertools

import numpy as np
import pytest
import torch

pytest.importorskip("onnxruntime")

import gdn_export  # noqa: E402
from gdn_export.backends.onnx import exporter, streamed  # noqa: E402

from helpers import FIXTURES, by_fixture  # noqa: E402


def _digests(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def _in_memory(tmp_path, monkeypatch, name, dtype="float32"):
    """The in-memory export with its weights in external data (as above 1 GiB), the streamed one's layout."""
    out = tmp_path / "memory" / "m.onnx"
    with monkeypatch.context() as patch:
        patch.setattr(exporter, "EXTERNAL_DATA_BYTES", 0)
        report = gdn_export.convert(FIXTURES / name, out, format="onnx", check=False, streamed=False, dtype=dtype)
    assert report.onnx.weights == ""  # nothing streamed
    return out.parent


def _streamed(tmp_path, monkeypatch, name, dtype="float32", folder="streamed"):
    """Every matrix of the fixture a placeholder (their weights are all under the 1 MiB real checkpoints stream
    from), written in slices of 256 bytes (many slices per weight, runs of a transposed one across them)."""
    import gdn_export.weights.streamed

    monkeypatch.setattr(gdn_export.weights.streamed, "REAL_BYTES", 4096)
    monkeypatch.setattr(streamed, "SLICE_BYTES", 256)
    out = tmp_path / folder / "m.onnx"
    return gdn_export.convert(FIXTURES / name, out, format="onnx", check=False, dtype=dtype), out.parent


@pytest.mark.parametrize("name,dtype", [pytest.param(*p, marks=pytest.mark.xdist_group(p[0]), id=f"{p[0]}-{p[1]}")
                                        for p in [("qwen3_next", "float32"), ("qwen3_5_moe", "float16"),
                                                  ("lara_mini", "float32")]])
@pytest.mark.slow  # converts a fixture
def test_streamed_writes_the_in_memory_files(tmp_path, monkeypatch, name, dtype):
    """Qwen3-Next: re-laid projections (rows of a checkpoint tensor); Qwen3.5-MoE: experts transformers' conversion
    fuses from per-expert tensors, in f16; LARA: a head tied to the table. Transposed Linear weights everywhere."""
    memory = _in_memory(tmp_path, monkeypatch, name, dtype)
    report, folder = _streamed(tmp_path, monkeypatch, name, dtype)
    assert "weights streamed from the checkpoint" in str(report) and report.onnx.external_data is not None
    assert _digests(folder) == _digests(memory)


@pytest.mark.xdist_group("qwen3_5")
@pytest.mark.slow  # converts a fixture
def test_streamed_file_checks(tmp_path, monkeypatch):
    """The streamed file (weights in m.onnx.data) passes the check against transformers in onnxruntime."""
    _, folder = _streamed(tmp_path, monkeypatch, "qwen3_5")
    assert sorted(p.name for p in folder.iterdir()) == ["m.onnx", "m.onnx.data"]
    result = gdn_export.check(folder / "m.onnx", FIXTURES / "qwen3_5", prompt_len=8, decode_steps=2, batch=2)
    assert result.ok, str(result)


@pytest.mark.xdist_group("qwen3_5")
@pytest.mark.slow  # converts a fixture
def test_refused_fold_exports_from_memory(tmp_path, monkeypatch):
    """With Transpose counted as a computing fold, every transposed weight is refused: the conversion says so and
    exports from memory, the same files as an in-memory conversion."""
    monkeypatch.setattr(streamed, "_VIEW_OPS", streamed._VIEW_OPS - {"onnx::Transpose"})
    memory = _in_memory(tmp_path, monkeypatch, "qwen3_5")
    with monkeypatch.context() as patch:
        patch.setattr(exporter, "EXTERNAL_DATA_BYTES", 0)
        report, folder = _streamed(tmp_path, monkeypatch, "qwen3_5")
    assert "weights read into memory: the ONNX exporter computed constants from weight placeholders " \
           "(onnx::Transpose)" in str(report)
    assert _digests(folder) == _digests(memory)


class _Array:
    """A Source over a numpy array (what TensorEntry.rows gives: rows cast to the target, flat)."""

    def __init__(self, value):
        self.value, self.name, self.shape = value, "array", value.shape

    def rows(self, start, stop, target):
        return self.value[start:stop].astype(target).reshape(-1)


@pytest.mark.parametrize("shape", [(7, 5), (6, 1, 4, 3), (5, 4, 3)])
def test_write_weight_permutations(tmp_path, monkeypatch, shape):
    """Every permutation of the non-unit axes, in slices of 40 bytes, against numpy's transpose."""
    monkeypatch.setattr(streamed, "SLICE_BYTES", 40)
    value = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    kept = [d for d in shape if d > 1]
    for perm in itertools.permutations(range(len(kept))):
        expected = value.reshape(kept).transpose(perm).astype(np.float16)
        path = tmp_path / "w.bin"
        with open(path, "wb") as file:
            file.write(b"x" * 3)
            streamed.write_weight(file, 3, streamed.Weight(_Array(value), perm, expected.shape, torch.float16))
        assert path.read_bytes() == b"x" * 3 + expected.tobytes(), perm


class _Doubled(torch.nn.Module):
    def __init__(self, weight):
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)

    def forward(self, x):
        return x @ (self.weight * 2).t()


def test_fold_from_a_placeholder_is_refused(tmp_path):
    """``weight * 2`` is folded into a constant by the exporter: computed from a placeholder, it is refused."""
    placeholder = torch.empty(8, 4)
    module = _Doubled(placeholder)
    sources = {module.weight.untyped_storage().data_ptr(): _Array(np.ones((8, 4), np.float32))}
    with pytest.raises(streamed.StreamingRefused, match="onnx::Mul"):
        exporter.write_onnx(module, (torch.ones(2, 4),), tmp_path, "d.onnx", input_names=["x"], output_names=["y"],
                            dynamic_axes={"x": {0: "B"}}, runtime="any", lowering="auto", sources=sources)


@pytest.mark.parametrize("name", by_fixture("qwen3_5"))
@pytest.mark.slow  # converts a fixture
def test_in_memory_flag(tmp_path, monkeypatch, name):
    """``--in-memory`` reaches the ONNX conversion: one file, no data file, even with placeholders possible."""
    import gdn_export.weights.streamed
    from gdn_export.cli import main

    monkeypatch.setattr(gdn_export.weights.streamed, "REAL_BYTES", 4096)
    out = tmp_path / "m.onnx"
    assert main(["convert", str(FIXTURES / name), "-o", str(out), "--no-check", "--in-memory"]) == 0
    assert [p.name for p in tmp_path.iterdir()] == ["m.onnx"]
