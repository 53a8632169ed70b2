"""Sparse MoE: tract's ``tract_moe_ffn`` against a float64 reference, and where the export uses it (ops/moe_ffn.py).

1. The fused op, hand-written in the exact form the export writes (w1/w3/w2 variables of their own, the linear
   layout), matches float64 numpy for both gate modes the families use, f32, f16 and Q4_0 stacks, [N, D] with a
   symbolic N, 64 experts top-8; on exactly tied logits it takes the lowest expert indices (tract_quirks).
2. ``t2n_extra::moe_ffn`` exports sparse where ``decide`` allows it and dense elsewhere, the decision and its reason
   recorded; both forms pass the export's parity check against the op's torch kernel.
3. The MoE fixtures: the converted graphs hold ``tract_moe_ffn`` where the family's routing is softmax top-k and the
   dense form for Kimi Linear, with the reason in the report; a Qwen3-Next checkpoint without ``norm_topk_prob``
   exports ``gate = 'softmax_all'`` and still matches transformers; the streamed archive of the 64-expert fixture is
   the in-memory one. (Logits of every fixture, f32 and f16, batch 1 and 2: tests/test_hf_families.py.)
"""

from __future__ import annotations

import io
import json
import re
import shutil
import tarfile
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import tract

import gdn_export
from helpers import FIXTURES, archive_members, by_fixture, resealed
from gdn_export import tract_quirks as tq
from gdn_export.pipeline.convert import convert
from gdn_export.hf.tensors import write_nnef_array
from gdn_export.ops.options import NnefOptions
from gdn_export.models import blocks
from gdn_export.ops.moe_ffn.nnef import decide
from gdn_export.ops.moe_ffn import op as moe_ffn
from gdn_export.weights import q4_0

HEADER = ("version 1.0;\nextension tract_registry tract_core;\nextension tract_registry tract_transformers;\n"
          "extension tract_symbol N;\n\n")


# --- 1. the fused op against float64 --------------------------------------------------------------------------
def fused_graph(folder: Path, weights: dict[str, np.ndarray], top_k: int, gate: str, dtype: str,
                q4_0_stacks: bool = False) -> Path:
    """``tract_moe_ffn`` over x [N, D] as gdn_export writes it: w1 = gate [E, I, D], w3 = up, w2 = down [E, D, I]
    (with ``q4_0_stacks``, the three in tract's Q4_0)."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, value in weights.items():
        with (folder / f"{name}.dat").open("wb") as file:
            if q4_0_stacks and name != "wg":
                q4_0.write_nnef(file, value.shape, lambda start, stop, value=value: value[start:stop])
            else:
                write_nnef_array(file, value)
    width = weights["gate"].shape[2]
    declare = "\n".join(f"  {n} = variable<scalar>(label = '{n}', shape = {list(weights[n].shape)});"
                        for n in ("wg", "gate", "up", "down"))
    graph = f"""
        graph net(x) -> (y) {{
          x = tract_core_external(shape = [N, {width}], datum_type = '{dtype}');
        {declare}
          y = tract_moe_ffn(x, wg, gate, down, up, k = {top_k}, activation = 'silu', gate = '{gate}',
                            expert_layout = 'linear');
        }}
        """
    (folder / "graph.nnef").write_text(HEADER + textwrap.dedent(graph))
    return folder


def run_graph(folder: Path, x: np.ndarray):
    runnable = tract.nnef().with_tract_transformers().load(str(folder)).into_runnable()
    ops = [n["op_name"] for n in json.loads(runnable.profile_json(None))["nodes"]]
    return runnable.run([x])[0].to_numpy(), ops


def reference64(x, wg, gate_proj, up_proj, down, top_k, normalize) -> np.ndarray:
    """The family's math in float64, token by token: softmax, the top k (stable order), renormalized if asked."""
    x, wg, gate_proj, up_proj, down = (np.asarray(a, np.float64) for a in (x, wg, gate_proj, up_proj, down))
    out = np.zeros_like(x)
    for n, token in enumerate(x):
        logits = wg @ token
        probs = np.exp(logits - logits.max())
        probs /= probs.sum()
        chosen = np.argsort(-probs, kind="stable")[:top_k]
        weights = probs[chosen] / probs[chosen].sum() if normalize else probs[chosen]
        for e, weight in zip(chosen, weights):
            gate, up = gate_proj[e] @ token, up_proj[e] @ token
            out[n] += weight * (down[e] @ (gate / (1 + np.exp(-gate)) * up))
    return out


def moe_weights(experts=64, width=32, inner=16, dtype=np.float32, seed=0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"wg": rng.standard_normal((experts, width)).astype(dtype),
            "gate": (rng.standard_normal((experts, inner, width)) / np.sqrt(width)).astype(dtype),
            "up": (rng.standard_normal((experts, inner, width)) / np.sqrt(width)).astype(dtype),
            "down": (rng.standard_normal((experts, width, inner)) / np.sqrt(inner)).astype(dtype)}


def stacks_of(weights: dict[str, np.ndarray]) -> tuple:
    return weights["wg"], weights["gate"], weights["up"], weights["down"]


@pytest.mark.parametrize("gate", ["softmax_topk", "softmax_all"])
@pytest.mark.parametrize("dtype", ["f32", "f16"])
@pytest.mark.parametrize("tokens", [1, 7])
def test_fused_op_matches_float64(tmp_path, gate, dtype, tokens):
    """64 experts, top-8: the family's routing (softmax top-k, renormalized for softmax_topk) to float rounding;
    the output keeps x's dtype, and tract runs its optimized kernel (OptMoeFfn), the slices folded."""
    np_dtype = np.float32 if dtype == "f32" else np.float16
    weights = moe_weights(dtype=np_dtype)
    x = np.random.default_rng(1).standard_normal((tokens, 32)).astype(np_dtype)
    y, ops = run_graph(fused_graph(tmp_path, weights, 8, gate, dtype), x)
    expected = reference64(x, *stacks_of(weights), 8, gate == "softmax_topk")
    error = np.abs(y.astype(np.float64) - expected).max() / np.abs(expected).max()
    assert y.dtype == np_dtype and y.shape == x.shape
    assert error < (4e-6 if dtype == "f32" else 2e-3), f"{gate} {dtype} N={tokens}: relative error {error:.2e}"
    assert "OptMoeFfn" in ops, ops


@pytest.mark.parametrize("tokens", [1, 7])
def test_fused_op_with_q4_0_stacks_matches_float64(tmp_path, tokens):
    """The three stacks in tract's Q4_0 (what ``--quantize q4_0`` writes): tract plans its optimized op and computes
    with the dequantized weights, to f32 rounding against float64 on those weights (the f32 rule)."""
    weights = moe_weights(width=64, inner=32, seed=4)
    x = np.random.default_rng(5).standard_normal((tokens, 64)).astype(np.float32)
    y, ops = run_graph(fused_graph(tmp_path, weights, 8, "softmax_topk", "f32", q4_0_stacks=True), x)
    seen = {n: q4_0.dequantize(q4_0.quantize(v), v.shape) if n != "wg" else v for n, v in weights.items()}
    expected = reference64(x, *stacks_of(seen), 8, True)
    assert np.abs(expected - reference64(x, *stacks_of(weights), 8, True)).max() > 1e-3  # Q4_0 is not a no-op
    error = np.abs(y.astype(np.float64) - expected).max() / np.abs(expected).max()
    assert error < 4e-6, f"Q4_0 stacks N={tokens}: relative error {error:.2e}"
    assert "OptMoeFfn" in ops, ops


@pytest.mark.parametrize("normalize", [True, False])
def test_fused_op_computes_the_op_reference(tmp_path, normalize):
    """The same graph against ``t2n_extra::moe_ffn``'s torch kernel fed with ``top_k_routing`` (the code the
    families run), in float64: the op's contract for ``softmax_topk``/``softmax_all`` is what tract computes."""
    weights = moe_weights(seed=2)
    x = np.random.default_rng(3).standard_normal((5, 32)).astype(np.float32)
    y, _ = run_graph(fused_graph(tmp_path, weights, 8, blocks.softmax_gate(normalize), "f32"), x)
    wg, gate, up, down = (torch.from_numpy(w).double() for w in stacks_of(weights))
    xt = torch.from_numpy(x).double()
    routing = blocks.top_k_routing(xt @ wg.T, 8, normalize)
    expected = moe_ffn.moe_ffn(xt, routing, wg, gate, up, down, 8, blocks.softmax_gate(normalize)).numpy()
    np.testing.assert_allclose(y, expected, rtol=0, atol=4e-6 * np.abs(expected).max())


def test_tied_logits_take_the_lowest_experts(tmp_path):
    """Canary of tract_quirks.MOE_TIES_LOWEST_INDEX: every logit equal, expert e writing channel e; tract takes
    experts 0..k-1, where torch.topk (CPU) takes others."""
    experts, width, inner = 8, 16, 4
    gate = np.zeros((experts, inner, width), np.float32)
    down = np.zeros((experts, width, inner), np.float32)
    for e in range(experts):
        gate[e, :, 0] = 1.0
        down[e, e, 0] = 1.0
    folder = fused_graph(tmp_path, {"wg": np.zeros((experts, width), np.float32), "gate": gate, "up": gate.copy(),
                                    "down": down}, 3, "softmax_topk", "f32")
    x = np.zeros((1, width), np.float32)
    x[0, 0] = 1.0
    y, _ = run_graph(folder, x)
    assert list(np.nonzero(y[0, :experts])[0]) == [0, 1, 2], (
        f"{tq.MOE_TIES_LOWEST_INDEX.name} no longer holds: {tq.MOE_TIES_LOWEST_INDEX.when_fixed}")


# --- 2. the export's decision ---------------------------------------------------------------------------------
class MoeLayer(torch.nn.Module):
    """A Qwen-style routed MoE (no shared expert) through ``routed_moe``, or a routing tract has no mode for."""

    def __init__(self, experts=16, width=32, inner=8, top_k=4, gate="softmax_topk"):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.router = torch.nn.Parameter(torch.randn(experts, width, generator=gen))
        gate_up = torch.randn(experts, 2 * inner, width, generator=gen) / width ** 0.5
        down = torch.randn(experts, width, inner, generator=gen) / inner ** 0.5
        extra = moe_ffn.widening(gate, experts)  # a given routing's stacks come widened by E zeros (the contract)
        gate_up, down = F.pad(gate_up, (0, extra)), F.pad(down, (0, 0, 0, extra))
        self.gate_proj, self.up_proj = (torch.nn.Parameter(half.contiguous()) for half in gate_up.chunk(2, dim=1))
        self.down = torch.nn.Parameter(down)
        self.register_buffer("score_bias", torch.linspace(-0.5, 0.5, experts))
        self.top_k, self.gate = top_k, gate

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        logits = flat @ self.router.T
        if self.gate.startswith("grouped_sigmoid"):  # DeepSeek-V3's: 4 groups, the best 2, a score bias
            scaling = 2.5 if self.gate == "grouped_sigmoid" else -2.5
            routing = blocks.grouped_sigmoid_routing(logits, self.score_bias, top_k=self.top_k, groups=4, top_groups=2,
                                                     normalize=True, scaling=scaling)
        else:
            routing = blocks.top_k_routing(logits, self.top_k, self.gate == "softmax_topk")
        out = blocks.routed_moe(flat, routing, self.router, self.gate_proj, self.up_proj, self.down, self.top_k,
                                self.gate)
        return out.view_as(x)


def export_layer(tmp_path, runtime, gate="softmax_topk", dtype=torch.float32, **shape):
    module = MoeLayer(gate=gate, **shape).to(dtype)
    x = torch.randn(2, 5, shape.get("width", 32)).to(dtype)
    path = tmp_path / f"moe_{runtime}_{gate}.nnef.tgz"
    report = gdn_export.export(module, (x,), path, input_names=["x"], output_names=["y"],
                               dynamic_axes={"x": {0: "B", 1: "S"}}, runtime=runtime)
    with tarfile.open(path) as tar:
        graph = tar.extractfile("graph.nnef").read().decode()
    moe = [d for d in report.decisions if d.entry == moe_ffn.QUALNAME]
    assert len(moe) == 1
    return report, moe[0], graph


@pytest.mark.parametrize("gate", ["softmax_topk", "softmax_all"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_cpu_export_is_sparse_and_exact(tmp_path, gate, dtype):
    """runtime cpu: one tract_moe_ffn with the family's gate mode, no expert matmul left; the export's own check
    (every output against the torch kernel, symbolic B and S) passed."""
    report, decision, graph = export_layer(tmp_path, "cpu", gate, dtype)
    assert decision.lowering == "tract_moe_ffn" and f"gate={gate}" in decision.reason
    assert len(re.findall(rf"tract_moe_ffn\(.*gate = '{gate}', expert_layout = 'linear'\)", graph)) == 1
    assert "matmul(" not in graph.split("tract_moe_ffn(")[1]
    assert report.parity is not None and report.parity.ok
    # the unused dense routing (softmax, topk, scatter) is gone from the optimized model (MOE_UNUSED_ROUTING_DROPPED)
    runnable = tract.nnef().with_tract_transformers().load(str(report.path)).into_runnable()
    ops = [n["op_name"] for n in json.loads(runnable.profile_json(None))["nodes"]]
    assert "OptMoeFfn" in ops and not [op for op in ops if "TopK" in op or "Scatter" in op], ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_given_routing_export_is_sparse_and_exact(tmp_path, dtype):
    """DeepSeek-V3 routing (no tract gate mode): tract_moe_ffn gate 'raw' over [x | routing] with the widened
    stacks as given (nothing padded or sliced in the graph), no expert matmul left, and the export's check against
    the op's dense torch kernel passed; the routing ops stay (they feed the op)."""
    report, decision, graph = export_layer(tmp_path, "cpu", "grouped_sigmoid", dtype)
    assert decision.lowering == "tract_moe_ffn" and "gate=raw over [x | routing]" in decision.reason
    assert len(re.findall(r"tract_moe_ffn\(.*gate = 'raw', expert_layout = 'linear'\)", graph)) == 1
    assert "matmul(" not in graph.split("tract_moe_ffn(")[1]
    assert report.parity is not None and report.parity.ok
    runnable = tract.nnef().with_tract_transformers().load(str(report.path)).into_runnable()
    ops = [n["op_name"] for n in json.loads(runnable.profile_json(None))["nodes"]]
    assert "OptMoeFfn" in ops and "MoeFfn" not in ops and not [op for op in ops if op == "Pad"], ops
    assert "pad(" not in graph


@pytest.mark.parametrize("runtime,gate,why", [
    ("cuda", "softmax_topk", "verified on tract's CPU runtime only"),
    ("any", "softmax_topk", "no runtime given"),
    ("cuda", "grouped_sigmoid", "verified on tract's CPU runtime only"),
    ("cpu", "grouped_sigmoid_signed", "routed scaling factor <= 0"),
])
def test_refused_exports_are_dense_with_a_reason(tmp_path, runtime, gate, why):
    """Elsewhere the node is every expert on every token, exact (the parity check passed), and says why."""
    report, decision, graph = export_layer(tmp_path, runtime, gate)
    assert decision.lowering == "dense" and why in decision.reason
    assert "tract_moe_ffn" not in graph
    assert report.parity is not None and report.parity.ok
    assert "dense - " in str(report)


def test_older_tract_is_dense():
    decision = decide(moe_ffn.MoeNode("y", "softmax_topk"), NnefOptions(tract_version=(0, 23, 8), runtime="cpu"))
    assert decision.lowering == "dense" and "0.23.9" in decision.reason


def test_expert_biases_keep_the_node_dense():
    """tract_moe_ffn has no bias input and a bias inside SwiGLU cannot leave the op: dense, whatever the gate
    (the Megatron fixture megatron_moe_bias checks the dense form against Megatron's logits)."""
    for gate in ("softmax_topk", "grouped_softmax"):
        decision = decide(moe_ffn.MoeNode("y", gate, biased=True), NnefOptions(tract_version=(0, 23, 9), runtime="cpu"))
        assert decision.lowering == "dense" and "expert biases" in decision.reason


def test_operands_are_validated():
    x, router = torch.zeros(3, 8), torch.zeros(4, 8)
    stack = torch.zeros(4, 3, 8)
    with pytest.raises(gdn_export.OperandError, match="down_proj"):
        moe_ffn.moe_ffn(x, torch.zeros(3, 4), router, stack, stack, torch.zeros(4, 8, 2), 2, "softmax_topk")
    with pytest.raises(gdn_export.OperandError, match="up_proj"):
        moe_ffn.moe_ffn(x, torch.zeros(3, 4), router, stack, torch.zeros(4, 2, 8), torch.zeros(4, 8, 3), 2,
                        "softmax_topk")
    with pytest.raises(gdn_export.OperandError, match="top_k"):
        moe_ffn.moe_ffn(x, torch.zeros(3, 4), router, stack, stack, torch.zeros(4, 8, 3), 5, "softmax_topk")
    with pytest.raises(gdn_export.OperandError, match="D \\+ W = 12"):  # a given routing's stacks come widened
        moe_ffn.moe_ffn(x, torch.zeros(3, 4), router, stack, stack, torch.zeros(4, 8, 3), 2, "grouped_sigmoid")
    down, bias = torch.zeros(4, 8, 3), torch.zeros(4, 3)
    with pytest.raises(gdn_export.OperandError, match="all three or none"):
        torch.ops.t2n_extra.moe_ffn(x, torch.zeros(3, 4), router, stack, stack, down, 2, "softmax_topk", bias, bias)
    with pytest.raises(gdn_export.OperandError, match="down_bias"):  # [E, D], not [E, I]
        moe_ffn.moe_ffn(x, torch.zeros(3, 4), router, stack, stack, down, 2, "softmax_topk", (bias, bias, bias))


# --- 3. the fixtures ------------------------------------------------------------------------------------------
def graph_of(path: Path) -> str:
    with tarfile.open(path) as tar:
        return tar.extractfile("graph.nnef").read().decode()


def decisions_of(path: Path) -> list[dict]:
    with tarfile.open(path) as tar:
        metadata = json.loads(tar.extractfile("gdn_export.json").read())
    return [d for d in metadata["decisions"] if d["entry"] == moe_ffn.QUALNAME]


# fixture -> (MoE feed-forwards, top k, lowering)
MOE_FIXTURES = {"qwen3_5_moe_64x8": (2, 8, "tract_moe_ffn"), "qwen3_next": (3, 2, "tract_moe_ffn"),
                "qwen3_5_moe": (3, 2, "tract_moe_ffn"), "qwen4_exp": (3, 2, "tract_moe_ffn"),
                "lara_mini": (4, 2, "tract_moe_ffn"), "kimi_linear": (1, 2, "tract_moe_ffn"),
                "kimi_linear_64x8": (1, 8, "tract_moe_ffn")}


@pytest.mark.parametrize("name", by_fixture(*MOE_FIXTURES))
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_fixture_graphs_are_sparse_where_exact(name, dtype, converted):
    count, top_k, lowering = MOE_FIXTURES[name]
    path = converted(name, dtype)
    decisions, graph = decisions_of(path), graph_of(path)
    assert [d["lowering"] for d in decisions] == [lowering] * count
    fused = re.findall(r"tract_moe_ffn\(.*k = (\d+), activation = 'silu', gate = '(\w+)'", graph)
    gate = "raw" if name.startswith("kimi_linear") else "softmax_topk"  # DeepSeek-V3 routing: the given weights
    assert lowering == "tract_moe_ffn" and fused == [(str(top_k), gate)] * count


@pytest.mark.slow  # converts a fixture
def test_report_names_each_moe_choice(tmp_path):
    report = convert(FIXTURES / "kimi_linear", tmp_path / "k.nnef.tgz", check=False)
    assert "moe (1 feed-forward): tract_moe_ffn - DeepSeek-V3 routing" in str(report)


@pytest.mark.slow  # converts a fixture
def test_softmax_all_checkpoint_matches_transformers(tmp_path):
    """Qwen3-Next with ``norm_topk_prob`` false (the fixture's weights, its config changed): gate 'softmax_all',
    and convert's check against transformers passes (f32: 1e-4 x max |logit|)."""
    folder = tmp_path / "qwen3_next_no_norm"
    shutil.copytree(FIXTURES / "qwen3_next", folder)
    config = json.loads((folder / "config.json").read_text())
    config["norm_topk_prob"] = False
    (folder / "config.json").write_text(json.dumps(config))
    report = convert(folder, tmp_path / "n.nnef.tgz")
    assert report.check is not None and report.check.ok
    assert len(re.findall(r"gate = 'softmax_all'", graph_of(tmp_path / "n.nnef.tgz"))) == 3
    assert "gate=softmax_all" in str(report)


@pytest.mark.slow  # converts a fixture
def test_streamed_64_expert_archive_is_the_in_memory_one(tmp_path, monkeypatch):
    """Every expert stack traced as a placeholder (threshold 4 KiB): the fused op references the stacks without
    reading them, and the archive is byte for byte the in-memory one."""
    import gdn_export.weights.streamed

    convert(FIXTURES / "qwen3_5_moe_64x8", tmp_path / "m.nnef.tgz", check=False, streamed=False)
    monkeypatch.setattr(gdn_export.weights.streamed, "REAL_BYTES", 4096)
    convert(FIXTURES / "qwen3_5_moe_64x8", tmp_path / "s.nnef.tgz", check=False)
    a, b = archive_members(tmp_path / "s.nnef.tgz"), archive_members(tmp_path / "m.nnef.tgz")
    assert sorted(a) == sorted(b) and [k for k in a if a[k] != b[k]] == []
    assert "tract_moe_ffn" in a["graph.nnef"].decode()


@pytest.mark.xdist_group("qwen3_5_moe_64x8")
def test_a_wrong_gate_mode_fails_the_check(converted, reference_model, tmp_path):
    """The check tells the routings apart: the 64-expert archive with tract_moe_ffn's gate switched to softmax_all
    (no renormalization: every routed output scaled by the top-8 mass) fails the float32 rule."""
    from gdn_export.hf.check import check_against_transformers

    good = converted("qwen3_5_moe_64x8")
    bad = tmp_path / "wrong-gate.nnef.tgz"
    with tarfile.open(good) as src, tarfile.open(bad, "w:gz", compresslevel=0) as dst:
        for member in src.getmembers():
            data = src.extractfile(member).read() if member.isfile() else None
            if member.name == "graph.nnef":
                data = data.replace(b"gate = 'softmax_topk'", b"gate = 'softmax_all'")
                member.size = len(data)
            dst.addfile(member, io.BytesIO(data) if data is not None else None)
    resealed(bad)  # a conversion that wrote the wrong gate, not a damaged archive
    assert graph_of(bad).count("gate = 'softmax_all'") == 2
    assert check_against_transformers(good, reference_model("qwen3_5_moe_64x8")).ok
    assert not check_against_transformers(bad, reference_model("qwen3_5_moe_64x8")).ok
