"""float16 weights for a float32 graph (``--quantize f16``): a whole export against transformers computing with the
same rounded weights (and not with the float32 ones), the tables' negated storage, refusals."""

import json
import tarfile

import numpy as np
import pytest
import torch

from gdn_export.errors import GdnExportError
from gdn_export.pipeline.convert import check, convert
from gdn_export.weights import f16
from helpers import FIXTURES, damaged


def test_round_trip_is_round_half_to_even_in_float16():
    values = torch.tensor([1 + 2 ** -11, 1 + 3 * 2 ** -11, 65519.0, 1e-8, -0.1], dtype=torch.float32)
    expected = np.array([1.0, 1 + 2 ** -9, 65504.0, 0.0, np.float16(-0.1)], np.float32)  # ties to the even mantissa
    np.testing.assert_array_equal(f16.round_trip(values).numpy(), expected)


@pytest.mark.slow
def test_f16_export_matches_transformers_with_the_same_weights_and_tells_them_from_float32(tmp_path, capsys):
    """Qwen3.5 with its head tied to the table: every linear layer's weight in float16 (the head a copy of its own),
    the table in float16 stored negated and gathered back; tract against transformers with the same rounded weights
    passes the float32 rule, and the same logits against the float32 weights do not (the check tells them apart)."""
    out = tmp_path / "h.nnef.tgz"
    report = convert(FIXTURES / "qwen3_5_vl", out, quantize="f16")
    assert report.check.ok and report.check.dtype == "float32", report.check
    quality = report.check.quality
    assert quality is not None and quality.max_abs_error > report.check.tolerance, quality
    with tarfile.open(out) as tar:
        header = {m.name: tar.extractfile(m).read(128) for m in tar.getmembers() if m.name.endswith(".dat")}
        bits = {name: int(np.frombuffer(h, np.uint32, 1, 44)[0]) for name, h in header.items()}
        linear = sorted(n for n in bits if n.endswith("_proj.weight.dat") or n.endswith("lm_head.weight.dat")
                        or "_proj_" in n)
        table = np.frombuffer(tar.extractfile("hf.model.embed_tokens.weight.dat").read()[128:], np.float16)
        head = np.frombuffer(tar.extractfile("hf.lm_head.weight.dat").read()[128:], np.float16)
        graph = tar.extractfile("graph.nnef").read().decode()
        metadata = json.loads(tar.extractfile("gdn_export.json").read())
    assert linear and all(bits[n] == 16 for n in linear), {n: bits[n] for n in linear}
    assert bits["hf.model.embed_tokens.weight.dat"] == 16
    assert bits["hf.model.layers.0.linear_attn.conv1d.weight.dat"] == 32  # not a linear layer's: float32
    np.testing.assert_array_equal(table, -head)  # negated: tract would merge equal constants (EQUAL_CONSTANTS)
    assert graph.count("tract_core_gather(") == 1 and "__f16_negated_rows_f32)" in graph
    assert metadata["quantize"] == "f16" and metadata["q4_rule"] is None and metadata["dtype"] == "float32"
    assert f"{len(linear)} weights in F16" in report.quantization and "embedding table in F16" in report.quantization
    recheck = check(out, FIXTURES / "qwen3_5_vl")  # `gdn-export check` rounds the checkpoint again
    assert recheck.ok, recheck
    broken = check(damaged(out, tmp_path / "broken.nnef.tgz", "hf.lm_head.weight.dat"), FIXTURES / "qwen3_5_vl")
    assert not broken.ok, broken  # one head weight's sign flipped
    from gdn_export.cli import main as cli

    capsys.readouterr()
    assert cli(["info", str(out)]) == 0
    assert f"dtype float32, {len(linear)} weights in F16" in capsys.readouterr().out


@pytest.mark.parametrize("options,message", [
    (dict(dtype="float16", check=False), "float16 weights for a float32 graph"),
    (dict(quantize_embeddings=True), "stored in float16 already"),
    (dict(runtime="cuda"), "CPU runtime only"),
    (dict(format="onnx"), "--dtype float16"),
], ids=["dtype-float16", "quantize-embeddings", "cuda", "onnx"])
def test_f16_refusals(tmp_path, options, message):
    out = tmp_path / ("h.onnx" if options.get("format") == "onnx" else "h.nnef.tgz")
    with pytest.raises(GdnExportError, match=message):
        convert(FIXTURES / "qwen3_5", out, quantize="f16", **options)
    assert list(tmp_path.iterdir()) == []


def test_a_weight_beyond_float16_range_is_refused():
    import io

    values = np.array([[1.0, -7e4], [0.5, 2.0]], np.float32)
    with pytest.raises(GdnExportError, match="weight w has a value of magnitude 70000, beyond float16's range"):
        f16.write_nnef(io.BytesIO(), values.shape, lambda a, b: values[a:b], name="weight w")
    broken = np.array([[1.0, np.nan]], np.float32)
    with pytest.raises(GdnExportError, match="weight w holds a non-finite value"):
        f16.write_nnef(io.BytesIO(), broken.shape, lambda a, b: broken[a:b], name="weight w")
    out = io.BytesIO()
    f16.write_nnef(out, values[:, :1].shape, lambda a, b: values[a:b, :1], negated=True)
    np.testing.assert_array_equal(np.frombuffer(out.getvalue()[128:], np.float16), [-1.0, -0.5])
