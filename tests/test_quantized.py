"""Q4_0 weights (tract's block format), and the float16 archives' weights that tract would cast at run time."""

import json
import re
import tarfile
from pathlib import Path

import numpy as np
import pytest

from helpers import CHECKPOINTS, FIXTURES, by_fixture
from gdn_export.errors import GdnExportError
from gdn_export.pipeline.convert import convert
from gdn_export.weights import q4_0

# a .dat header's item type (bytes 48-51): tract's Q4_0 is 0x4030 from vendor "RT" (torch-to-nnef's DatBinHeader)
Q40_ITEM_TYPE = bytes.fromhex("4030") + b"RT"


def reference_q4_0(x: np.ndarray) -> np.ndarray:
    """llama.cpp's quantize_row_q4_0_ref then dequantize_row_q4_0, one block at a time (an independent loop)."""
    out = np.empty_like(x, dtype=np.float32)
    for i, block in enumerate(x.reshape(-1, 32)):
        amax, mx = 0.0, 0.0
        for v in block:
            if abs(v) > amax:
                amax, mx = abs(v), v
        d = np.float32(mx / -8)
        d16 = np.float32(np.float16(d))
        inv = np.float32(1.0 / d16) if d16 else np.float32(0.0)
        codes = [min(15, int(np.float32(v) * inv + np.float32(8.5))) for v in block]
        out.reshape(-1, 32)[i] = [(c - 8) * d16 for c in codes]
    return out.reshape(x.shape)


def test_nearest_rule_matches_the_reference_rounding():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((8, 64)) * rng.uniform(0.01, 3, (8, 1))).astype(np.float32)
    x[3, :32] = 0.0  # an all-zero block
    got = q4_0.dequantize(q4_0.quantize(x, "nearest"), x.shape)
    np.testing.assert_array_equal(got, reference_q4_0(x))
    blocks = x.reshape(-1, 32)
    extremes = blocks[np.arange(len(blocks)), np.abs(blocks).argmax(1)]
    # the extreme of each block is kept up to the f16 rounding of its scale
    np.testing.assert_allclose(got.reshape(-1, 32)[np.arange(len(blocks)), np.abs(blocks).argmax(1)], extremes,
                               rtol=2 ** -10)
    assert q4_0.quantize(x, "nearest").shape == q4_0.quantize(x).shape == (x.size // 32, 18)


def dat_item_types(archive: Path) -> dict[str, bytes]:
    with tarfile.open(archive) as tar:
        return {m.name: tar.extractfile(m).read(128)[48:52] for m in tar.getmembers() if m.name.endswith(".dat")}


@pytest.mark.parametrize("name,dtype,embeddings", [("qwen3_5", "float32", False), ("qwen3_5_moe_vl", "float16", True)])
@pytest.mark.slow  # converts a fixture
def test_quantized_export_matches_the_reference_with_the_same_weights(tmp_path, name, dtype, embeddings):
    out = tmp_path / "q.nnef.tgz"
    report = convert(FIXTURES / name, out, dtype=dtype, quantize="q4_0", quantize_embeddings=embeddings)
    assert report.check.ok, report.check  # tract against transformers computing with the same Q4_0 weights
    assert report.quality is not None and np.isfinite(report.quality.mean_kl)
    types = dat_item_types(out)
    quantized = {n for n, t in types.items() if t == Q40_ITEM_TYPE}
    # every linear layer's weight is Q4_0 (all inner sizes of these fixtures are multiples of 32), nothing else
    linear = {n for n in types if re.search(r"_proj\.weight\.dat$|lm_head\.weight\.dat$|_proj_\w+\.weight\.dat$", n)
              and "experts" not in n}
    assert linear <= quantized
    assert ("hf.model.embed_tokens.weight.dat" in quantized) == embeddings
    assert not any("norm" in n or "A_log" in n or "conv1d" in n for n in quantized)
    assert len(report.quantization) and f"{len(quantized)} weights in Q4_0" in report.quantization


def test_tied_table_is_not_quantized_with_its_slices(tmp_path):
    with pytest.raises(GdnExportError, match="tied to the embedding table"):
        convert(FIXTURES / "qwen3_5_vl", tmp_path / "q.nnef.tgz", check=False, quantize="q4_0",
                quantize_embeddings=True)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow  # converts a fixture
def test_tied_head_gets_a_q4_0_copy_of_its_own(tmp_path):
    """A head tied to the table is quantized as any linear layer, through a copy of its own; the gather keeps the
    table in the export dtype, and the check's reference (the same Q4_0 head, the table as published) agrees."""
    out = tmp_path / "q.nnef.tgz"
    report = convert(FIXTURES / "qwen3_5_vl", out, quantize="q4_0")
    assert report.check.ok, report.check
    types = dat_item_types(out)
    config = json.loads((FIXTURES / "qwen3_5_vl" / "config.json").read_text())
    assert config["tie_word_embeddings"] is True
    assert types["hf.model.embed_tokens.weight.dat"] != Q40_ITEM_TYPE
    assert types["hf.lm_head.weight.dat"] == Q40_ITEM_TYPE
    with tarfile.open(out) as tar:
        graph = tar.extractfile("graph.nnef").read().decode()
    # the head reads its own variable whole: no slice of a Q4_0 table (tract 0.23.9 cannot slice one)
    head = re.search(r"^\s*(\w+)\s*=\s*variable<scalar>\(label\s*=\s*'hf.lm_head.weight'", graph, re.M).group(1)
    assert not re.search(rf"slice\({head}\b", graph)




@pytest.mark.parametrize("name", by_fixture(*CHECKPOINTS))
def test_no_float16_weight_is_cast_at_run_time(name, converted):
    """tract neither folds a cast of a constant nor packs the result for its matmuls (20-40x slower): no weight
    matrix of a float16 archive may be stored in float16 and cast to float32 in the graph."""
    archive = converted(name, "float16")
    with tarfile.open(archive) as tar:
        graph = tar.extractfile("graph.nnef").read().decode()
        headers = {m.name: tar.extractfile(m).read(128) for m in tar.getmembers() if m.name.endswith(".dat")}
    variables = {m.group(1): m.group(2) for m in re.finditer(
        r"^\s*(\w+)\s*=\s*variable<scalar>\(label\s*=\s*'([^']+)',\s*shape\s*=\s*\[[^\],]*,[^\]]*\]", graph, re.M)}
    cast = {v for v in re.findall(r"tract_core_cast\((\w+),\s*to\s*=\s*'f32'\)", graph) if v in variables}
    half = [variables[v] for v in cast
            if tuple(np.frombuffer(headers[variables[v] + ".dat"], np.uint32, 2, 44)) == (16, 0)]
    assert half == [], f"float16 weights cast to float32 at run time: {half}"
    assert json.loads(tarfile.open(archive).extractfile("gdn_export.json").read())["dtype"] == "float16"


def moe_fixture_with_block_sized_experts(folder: Path) -> Path:
    """``kimi_linear_64x8`` (DeepSeek-V3 routing, 64 experts, top-8) with an expert width of 32: every inner size
    of its widened stacks is whole Q4_0 blocks (D + E = 128, I = 32), as in the published models; made here with
    fixtures/make_fixtures.py's recipe."""
    import sys

    import torch
    import transformers

    sys.path.insert(0, str(FIXTURES))  # make_fixtures imports its sibling fixture_cli
    try:
        import make_fixtures
    finally:
        sys.path.remove(str(FIXTURES))
    config_name, model_name, fields = make_fixtures.FIXTURES["kimi_linear_64x8"]
    config = getattr(transformers, config_name)(**{**fields, "moe_intermediate_size": 32})
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).eval()
    make_fixtures.spread_weights(model, 0)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.mark.parametrize("name", ["qwen3_5_moe", "kimi_linear_wide_experts"])
@pytest.mark.slow  # converts a fixture
def test_expert_stacks_of_the_fused_moe_are_q4_0(tmp_path, name):
    """``--quantize q4_0`` writes each routed MoE's three expert stacks in Q4_0 (softmax routing: the checkpoint's
    halves as they are; DeepSeek-V3's given routing: widened by zeros as they are written), tract_moe_ffn reads them
    as variables (no slice or pad of a Q4_0 constant), and the check against transformers computing with the same
    Q4_0 weights passes (the f32 rule)."""
    folder = FIXTURES / name if name != "kimi_linear_wide_experts" else \
        moe_fixture_with_block_sized_experts(tmp_path / name)
    out = tmp_path / "q.nnef.tgz"
    report = convert(folder, out, quantize="q4_0")
    assert report.check.ok, report.check
    assert "expert stacks" not in report.quantization  # none kept
    types = dat_item_types(out)
    stacks = {n for n in types if re.search(r"expert_stacks\.\d+\.(gate_proj|up_proj|widened_down_proj)\.dat$|"
                                            r"experts\.down_proj\.dat$", n)}
    layers = 3 if name == "qwen3_5_moe" else 1
    assert len(stacks) == 3 * layers and all(types[n] == Q40_ITEM_TYPE for n in stacks), stacks
    with tarfile.open(out) as tar:
        graph = tar.extractfile("graph.nnef").read().decode()
    fused = re.findall(r"tract_moe_ffn\((\w+), (\w+), (\w+), (\w+), (\w+),", graph)
    assert len(fused) == layers
    operands = {v for call in fused for v in call[2:]}
    declared = dict(re.findall(r"^\s*(\w+)\s*=\s*variable<scalar>\(label\s*=\s*'([^']+)'", graph, re.M))
    assert {declared[v] + ".dat" for v in operands} == stacks  # the op reads the Q4_0 variables themselves


@pytest.mark.slow  # converts a fixture
def test_expert_stacks_of_a_dense_moe_stay_float(tmp_path):
    """With ``runtime="any"`` the MoE runs dense (reshapes and slices of the stacks, which a Q4_0 constant cannot
    take): its stacks stay in the export dtype, the report says why, the linear layers are still Q4_0."""
    out = tmp_path / "q.nnef.tgz"
    report = convert(FIXTURES / "qwen3_5_moe", out, quantize="q4_0", runtime="any")
    assert report.check.ok, report.check
    assert "9 expert stacks of a MoE that runs dense" in report.quantization
    types = dat_item_types(out)
    assert not [n for n, t in types.items() if "expert_stacks" in n and t == Q40_ITEM_TYPE]
    assert types["hf.model.layers.0.linear_attn.out_proj.weight.dat"] == Q40_ITEM_TYPE
