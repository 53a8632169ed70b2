"""Megatron-core hybrid checkpoints (fixtures/megatron_<name>, made and run by Megatron's own code, on a GPU or on
a CPU under gloo: fixtures/make_megatron_fixtures.py; tp2 / pp2 saved by tensor- / pipeline-parallel ranks, in
torch_dist and, as ``*_legacy``, the legacy mp_rank_XX[_YYY] layout): converted through the CLI, run in tract,
against Megatron's own logits; and bad checkpoints refused in one line with nothing written."""

from __future__ import annotations

import argparse
import os
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import FIXTURES, by_fixture
from gdn_export.cli import main as cli
from gdn_export.hf.check import compare_logits, session_logits
from gdn_export.hf.checkpoint import model_in_memory
from gdn_export.megatron.checkpoint import MegatronCheckpointError
from gdn_export.megatron.family import open_megatron

MIXERS = ("gdn", "gdn2", "gdp", "tp2", "tp2_legacy", "pp2", "pp2_legacy", "moe", "moe_legacy", "moe_sigmoid", "moe_tp2", "moe_tp2_legacy", "moe_mtp", "moe_sqrtsoftplus", "moe_softmax_groups", "moe_softmax_pre_groups", "gpt", "gpt_interleaved", "gpt_mtp", "layernorm", "layernorm_1p", "mamba2", "moe_bias", "ep2", "ep2_legacy", "bridge_qwen3_next", "bridge_qwen3_next_tp2",
          "bridge_qwen3_5", "pp2_vpp", "bridge_qwen3_next_mtp", "bridge_qwen3_5_mtp")
# fixtures whose layers are those of a fixture above (what they change is the read: layouts, ranks, routing constants);
# converted and run in tract like the others, kept apart from MIXERS for the tests that need one of each graph.
# pipeline and rank layouts that only the reading tells apart (the gpt fixture's layers over uneven stages, its
# GroupedMLP experts at TP = 2):
SAME_LAYERS = ("pp2_vpp_legacy", "pp2_uneven_legacy", "gpt_pp2_vpp_legacy", "moe_etp1_legacy", "bridge_qwen3_next_mtp_pp2",
             "moe_etp1_tppdp_legacy", "moe_cp2_etp1_legacy", "tp2_cp2_legacy", "gpt_pp2_uneven_legacy",
             "gpt_grouped_tp2_legacy",
             # the models of megatron_layernorm and megatron_mamba2 saved by 2 tensor-parallel ranks (biases merged as
             # their linears, Mamba2's packed in_proj, conv weight and bias per part, its legacy conv1d_weight /
             # conv1d_bias names)
             "layernorm_tp2", "layernorm_tp2_legacy", "mamba2_tp2", "mamba2_tp2_legacy",
             # routings whose graph megatron_moe_sigmoid's (top-k constants aside) and the dense MoE lowering of
             # megatron_moe_bias already run in tract: groups scored by their top-3 sum, softmax weights times -1.5
             "moe_sigmoid_top3", "moe_softmax_negative", "moe_mtp_repeated", "moe_mtp_2depths",
             # megatron_moe_bias in the legacy layout: the experts' biases per expert (local_experts.<e>.linear_fc1.bias)
             "moe_bias_legacy")
BRIDGE = ("bridge_qwen3_next", "bridge_qwen3_5", "bridge_qwen3_next_tp2", "bridge_qwen3_next_mtp",
          "bridge_qwen3_5_mtp")
PROMPT = 16


def golden(mixer: str) -> tuple[np.ndarray, np.ndarray]:
    data = np.load(FIXTURES / f"megatron_{mixer}" / "golden.npz")
    assert data["input_ids"].dtype == np.int64 and data["logits"].dtype == np.float32
    return data["input_ids"], data["logits"]


def judge(mixer: str, actual: np.ndarray, expected: np.ndarray) -> None:
    """Every golden is a float32 forward of Megatron's: the float32 rule."""
    result = compare_logits(actual, expected, "float32")
    assert result.ok, f"{mixer}: {result}"


# MTP layers other than Qwen3-Next's, built by the decoder's own layer code: LayerNorm with biases, no output gate,
# a dense MLP ('/*-'); sigmoid routing with an expert bias, groups and a scaling; MoE biases without a shared expert
MTP_OTHER = ("layernorm_mtp", "moe_sigmoid_mtp", "moe_bias_mtp")


@pytest.mark.parametrize("mixer", MIXERS + SAME_LAYERS + MTP_OTHER)
def test_eager_model_matches_megatron(mixer):
    """gdn_export's eager model of the checkpoint (the conversion's reference) against Megatron's forward."""
    family, layout, _, weights = open_megatron(FIXTURES / f"megatron_{mixer}")
    model = model_in_memory(family, layout, weights)
    tokens, expected = golden(mixer)
    with torch.no_grad():
        judge(mixer, model(torch.from_numpy(tokens)).logits.numpy(), expected)


def _eager_final_hidden(mixer: str) -> torch.Tensor:
    """The eager model's hidden state after its final norm (``model.norm``) over the golden tokens."""
    family, layout, _, weights = open_megatron(FIXTURES / f"megatron_{mixer}")
    model = model_in_memory(family, layout, weights)
    seen = {}
    model.model.norm.register_forward_hook(lambda module, args, out: seen.update(hidden=out))
    with torch.no_grad():
        model(torch.from_numpy(golden(mixer)[0]))
    return seen["hidden"]


# a HybridModel's MTP pattern '/*E'; a GPTModel's MTP layer (its last: attention + MoE); the same made by
# Megatron-Bridge from a Hugging Face mtp.* head
MTP = ("moe_mtp", "gpt_mtp", "bridge_qwen3_next_mtp", "bridge_qwen3_5_mtp")
# '/*E/*E' with mtp_use_repeated_layer: one stored layer that Megatron runs at 2 depths; without: 2 depths with weights
# of their own, depth 1 the head (read by the torch test: the converted head is moe_mtp's graph)
MTP_DEEP = ("moe_mtp_repeated", "moe_mtp_2depths")


@pytest.mark.parametrize("mixer", MTP + MTP_OTHER + MTP_DEEP)
def test_mtp_head_matches_megatrons_multi_token_prediction(mixer):
    """The Megatron MTP block mapped onto the published mtp.* head (``models.mtp.MTPHead``), fed what Megatron's
    ``MultiTokenPredictionBlock`` reads (the decoder's output after its final norm, the next token at each
    position: the ids rolled left, 0 last), against the MTP logits of Megatron's own forward (``output_layer`` of
    depth 1's output): over the whole sequence, and as a drafter runs it (16 positions, then one at a time on its
    KV cache); fed the eager model's hidden state and Megatron's own."""
    from gdn_export.megatron.mtp import read_megatron_mtp_head

    data = np.load(FIXTURES / f"megatron_{mixer}" / "golden.npz")
    tokens, expected = data["input_ids"], data["mtp_logits"]
    next_ids = torch.from_numpy(data["mtp_next_ids"])
    assert torch.equal(next_ids[:, :-1], torch.from_numpy(tokens[:, 1:])) and not next_ids[:, -1].any()
    head = read_megatron_mtp_head(FIXTURES / f"megatron_{mixer}")
    for hidden in (_eager_final_hidden(mixer), torch.from_numpy(data["mtp_input_hidden"])):
        with torch.no_grad():
            whole = head(hidden, next_ids, *head.empty_cache(2))[0]
            key, value = head.empty_cache(2)
            steps = []
            for start, stop in [(0, PROMPT)] + [(t, t + 1) for t in range(PROMPT, tokens.shape[1])]:
                logits, _, key, value = head(hidden[:, start:stop], next_ids[:, start:stop], key, value)
                steps.append(logits)
        judge(f"{mixer} (MTP head)", whole.numpy(), expected)
        judge(f"{mixer} (MTP head, cached steps)", torch.cat(steps, dim=1).numpy(), expected)
    if mixer in MTP_DEEP:  # depth 2 on depth 1's output, the ids rolled once more: the same layer
        # (mtp_use_repeated_layer) or depth 2's own weights (mtp.layers.1.*), read as a head of its own
        second = head if mixer == "moe_mtp_repeated" else read_megatron_mtp_head(FIXTURES / f"megatron_{mixer}",
                                                                                 depth=2)
        next2 = torch.from_numpy(data["mtp2_next_ids"])
        assert torch.equal(next2[:, :-1], next_ids[:, 1:]) and not next2[:, -1].any()
        with torch.no_grad():
            own = head(torch.from_numpy(data["mtp_input_hidden"]), next_ids, *head.empty_cache(2))[1]
            for hidden in (own, torch.from_numpy(data["mtp2_input_hidden"])):
                judge(f"{mixer} (MTP head, depth 2)", second(hidden, next2, *second.empty_cache(2))[0].numpy(),
                      data["mtp2_logits"])


@pytest.mark.slow
@pytest.mark.parametrize("name", by_fixture(*(f"megatron_{m}" for m in MTP + MTP_OTHER)))
def test_converted_mtp_head_in_tract_matches_megatron(name, shared_session):
    """``gdn-export convert fixtures/megatron_moe_mtp``: the archive carries the Megatron MTP block as its MTP head
    (``mtp.nnef.tgz``); the main graph's ``hidden`` (prefill 16, then one token at a time, batch 2) fed to the head
    in tract (``MTPRunner``: each prefix of 16 positions, then one at a time on its cache, per row) against the MTP logits of
    Megatron's own forward."""
    from gdn_export.run.mtp import MTPRunner

    data = np.load(FIXTURES / name / "golden.npz")
    tokens, expected, next_ids = data["input_ids"], data["mtp_logits"], data["mtp_next_ids"]
    session = shared_session(name, "float32", tokens.shape[0])
    session.reset()
    hidden = {}
    session.on_hidden = lambda first, states: hidden.__setitem__(first, states)
    logits = [session.prefill(tokens[:, :PROMPT])] + [session.decode(tokens[:, t:t + 1])
                                                      for t in range(PROMPT, tokens.shape[1])]
    session.reset()
    judge(name, np.concatenate(logits, axis=1), data["logits"])
    states = np.concatenate([hidden[first] for first in sorted(hidden)], axis=1)
    assert states.shape == (*tokens.shape, 64)
    runner = MTPRunner(session.path, session.metadata)
    rows = []
    for row in range(tokens.shape[0]):
        steps = []
        for t in range(PROMPT):  # the member gives the last position's logits: each prefix of the prompt, from empty
            runner.reset()
            steps.append(runner.run(states[row, :t + 1], next_ids[row, :t + 1])[0])
        steps += [runner.run(states[row, t:t + 1], next_ids[row, t:t + 1])[0] for t in range(PROMPT, tokens.shape[1])]
        rows.append(np.concatenate(steps))
    judge(f"{name} (MTP head in tract)", np.stack(rows), expected)


def test_mtp_block_is_read_and_reported(monkeypatch):
    """The MTP block is mapped when the checkpoint is opened; the conversion's MTP decision then asks that opened
    checkpoint (``has_mtp``, ``read_mtp_head`` given the weights): no second open, the same head as one read alone."""
    from gdn_export.megatron import source
    from gdn_export.megatron.checkpoint import MegatronCheckpoint
    from gdn_export.megatron.mtp import read_megatron_mtp_head

    folder = FIXTURES / "megatron_moe_mtp"
    _, _, _, weights = open_megatron(folder)
    assert "an MTP head of 1 depth (attention + MoE; the decoder's layers)" in weights.summary(), weights.summary()
    assert weights.mtp.config.num_experts == 4
    assert weights.mtp.sources["fc.weight"].pieces == [("mtp.layers.0.eh_proj.weight", None)]
    assert open_megatron(FIXTURES / "megatron_moe")[3].mtp is None
    repeated = open_megatron(FIXTURES / "megatron_moe_mtp_repeated")[3]
    assert "an MTP head of 1 layer that Megatron runs at 2 depths (mtp_use_repeated_layer)" in repeated.summary()
    own = open_megatron(FIXTURES / "megatron_moe_mtp_2depths")[3]
    assert "an MTP head of depth 1 of 2 (depth 2, with weights of its own, left out" in own.summary()
    assert all(piece.startswith("mtp.layers.0.") for source in own.mtp.sources.values() for piece, _ in source.pieces)
    alone = read_megatron_mtp_head(folder).state_dict()
    opened, init = [], MegatronCheckpoint.__init__
    monkeypatch.setattr(MegatronCheckpoint, "__init__", lambda self, *a, **k: opened.append(a) or init(self, *a, **k))
    assert source.has_mtp(folder, weights)
    head = source.read_mtp_head(folder, torch.float32, weights)
    assert opened == [] and head.state_dict().keys() == alone.keys()
    assert all(torch.equal(value, alone[name]) for name, value in head.state_dict().items())


@pytest.mark.slow
@pytest.mark.parametrize("change, message", [
    ({"hybrid_layer_pattern": "GE*EGE/*E/*E"}, "the checkpoint has no mtp.layers.1.*"),
    ({"hybrid_layer_pattern": "GE*EGE/G-"}, "multi-token prediction pattern '/G-' has a delta-rule mixer ('G')"),
    ({"hybrid_layer_pattern": "GE*EGE/*E*E"}, "multi-token prediction pattern '/*E*E' has not one attention layer"),
], ids=["two-depths", "gdn-layer", "two-attention-layers"])
def test_mtp_blocks_the_head_does_not_compute_are_left_out_with_the_reason(tmp_path, capsys, change, message):
    """An MTP block the head does not compute: the model converts as before, without an MTP head, and the report
    (its weights line and its MTP line) says why, as for a Hugging Face checkpoint's unreadable mtp.* layout."""
    from gdn_export.run.reading import read_metadata

    out = tmp_path / "m.nnef.tgz"
    assert cli(["convert", str(_with_args(tmp_path, "moe_mtp", **change)), "-o", str(out), "--no-check"]) == 0
    report = capsys.readouterr().out
    assert "its MTP block left out: " in report and message in report, report
    assert "MTP head left out: " in report, report
    metadata = read_metadata(out)
    assert "mtp" not in metadata and "hidden" not in metadata["outputs"]


def test_perplexity_reference_reads_a_megatron_folder():
    """`gdn-export perplexity --reference` opens a folder of any source: a Megatron one's window logits are
    Megatron's own forward of that window (the golden's first row, from an empty cache)."""
    from gdn_export.checkpoints.reference import eager_window_logits

    tokens, expected = golden("gdn")
    judge("gdn", eager_window_logits(FIXTURES / "megatron_gdn")(tokens[0])[None], expected[:1])


@pytest.mark.slow
@pytest.mark.parametrize("name", by_fixture(*(f"megatron_{m}" for m in MIXERS + SAME_LAYERS)))
def test_converted_checkpoint_in_tract_matches_megatron(name, shared_session):
    """``gdn-export convert fixtures/megatron_<mixer>``, run in tract (batch 2: a prefill of 16 tokens then one
    token at a time) against Megatron's own logits over the same tokens."""
    tokens, expected = golden(name.removeprefix("megatron_"))
    actual = session_logits(shared_session(name, "float32", tokens.shape[0]), tokens, PROMPT)
    judge(name.removeprefix("megatron_"), actual, expected)


@pytest.mark.slow
@pytest.mark.parametrize("mixer", ["mamba2", "moe_bias"])
def test_biased_checkpoint_in_onnxruntime_matches_megatron(tmp_path, mixer):
    """Biases through the ONNX back-end: the Mamba2 fixture's conv bias (onnxruntime's contrib conv, its bias
    input), the MoE experts' biases (the dense MoE lowering's adds); the converted file in onnxruntime (prefill 16,
    then one token at a time, batch 2) against Megatron's logits."""
    from gdn_export.run.runner import open_runner

    out = tmp_path / f"{mixer}.onnx"
    assert cli(["convert", str(FIXTURES / f"megatron_{mixer}"), "-o", str(out), "--no-check"]) == 0
    tokens, expected = golden(mixer)
    judge(f"{mixer} (onnxruntime)", session_logits(open_runner(out), tokens, PROMPT), expected)


@pytest.mark.slow
@pytest.mark.parametrize("name", by_fixture(*(f"megatron_{m}" for m in BRIDGE)))
def test_bridge_made_checkpoint_in_tract_matches_the_hugging_face_model(name, shared_session):
    """The Megatron-Bridge conversions of fixtures/qwen3_next and fixtures/qwen3_5, in tract, against the logits of
    the Hugging Face model they came from (transformers' forward, stored beside Megatron's)."""
    tokens = golden(name.removeprefix("megatron_"))[0]
    expected = np.load(FIXTURES / name / "golden.npz")["hf_logits"]
    actual = session_logits(shared_session(name, "float32", tokens.shape[0]), tokens, PROMPT)
    judge(name, actual, expected)


def test_bridge_checkpoint_reads_its_run_config():
    _, _, model, weights = open_megatron(FIXTURES / "megatron_bridge_qwen3_next")
    assert "saved by Megatron-Bridge" in weights.summary() and "GPTModel layers GE*EGE" in weights.summary()
    assert model.config.num_experts == 4 and model.config.moe_shared_expert_gate


def test_bridge_run_config_with_python_tags_refused(tmp_path, capsys):
    folder = _copy(tmp_path, "bridge_qwen3_5")
    config = folder / "iter_0000000" / "run_config.yaml"
    config.write_text("model: !!python/object/apply:os.system ['touch ran']\n" + config.read_text())
    refused(capsys, folder, tmp_path / "m.nnef.tgz", "is not a readable run_config.yaml")


@pytest.mark.parametrize("text, message", [
    ("model: " + "[" * 20_000 + "]" * 20_000 + "\n", "run_config.yaml"),  # libyaml: its depth limit; PyYAML: recursion
    ("model:\n" + "".join(f"  key{i}: {i}\n" for i in range(30_000)), "a Megatron-Bridge run_config.yaml is at most"),
], ids=["nested", "oversized"])
def test_bridge_run_config_too_deep_or_too_large_refused(tmp_path, capsys, text, message):
    """A run_config.yaml nested past the parser's recursion or larger than any Bridge writes: one line, read in
    bounded time (the size checked before parsing)."""
    folder = _copy(tmp_path, "bridge_qwen3_5")
    (folder / "iter_0000000" / "run_config.yaml").write_text(text)
    refused(capsys, folder, tmp_path / "m.nnef.tgz", message)


def test_report_names_megatron_layers():
    _, _, _, weights = open_megatron(FIXTURES / "megatron_gdp")
    assert "GatedDeltaProductMixer (n=2)" in weights.summary() and "torch_dist" in weights.summary()
    _, _, model, weights = open_megatron(FIXTURES / "megatron_gdn2")
    assert "GatedDeltaNet2" in weights.summary()
    assert model.config.layer_types == ["linear_attention", "full_attention", "linear_attention"]
    for name, what in (("tp2", "tensor-parallel size 2"), ("pp2_legacy", "pipeline-parallel size 2"),
                       ("gpt_pp2_vpp_legacy", "pipeline-parallel size 2, expert-parallel size 1 (2 virtual pipeline "
                                              "stages a rank)"),
                       ("ep2", "expert-parallel size 2"), ("ep2_legacy", "legacy checkpoint saved with tensor-parallel "
                                                                        "size 1, pipeline-parallel size 1, expert-parallel size 2")):
        _, _, _, weights = open_megatron(FIXTURES / f"megatron_{name}")
        assert what in weights.summary(), weights.summary()


def _legacy_copy(tmp_path: Path, mixer: str) -> Path:
    """The fixture rewritten in the legacy layout (iter_*/mp_rank_00/model_optim_rng.pt): every tensor of
    Megatron's model state dict under its module's own name, the split checkpoint parts fused back in the order
    of Megatron's ``in_proj_split_names`` / ``_get_in_proj_checkpoint_split_layout``."""
    from gdn_export.megatron.checkpoint import MegatronCheckpoint

    source = MegatronCheckpoint(FIXTURES / f"megatron_{mixer}")
    orders = {"gdn": ["query", "key", "value", "z", "beta", "alpha"], "gdn2": ["query", "key", "value", "z", "f", "b", "w"],
              "gdp": ["z", "V0", "V1", "K0", "K1", "Q", "b0", "b1", "a"]}[mixer]
    conv = ["V0", "V1", "K0", "K1", "Q"] if mixer == "gdp" else ["query", "key", "value"]
    model: dict[str, torch.Tensor] = {}
    for name in source.names():
        base, _, part = name.rpartition(".")
        if part in orders and base.endswith("in_proj.weight") or part in conv and base.endswith("conv1d.weight"):
            if base not in model:
                parts = orders if base.endswith("in_proj.weight") else conv
                model[base] = torch.cat([source.read(f"{base}.{p}") for p in parts])
        else:
            model[name] = source.read(name)
    folder = tmp_path / "legacy"
    (folder / "iter_0000001" / "mp_rank_00").mkdir(parents=True)
    torch.save({"args": argparse.Namespace(**source.args), "checkpoint_version": 3.0, "iteration": 1, "model": model},
               folder / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt")
    (folder / "latest_checkpointed_iteration.txt").write_text("1")
    return folder


@pytest.mark.parametrize("mixer", ["gdn", "gdp"])
def test_legacy_layout_reads_the_same_model(tmp_path, mixer):
    family, layout, _, weights = open_megatron(_legacy_copy(tmp_path, mixer))
    assert "legacy" in weights.summary()
    model = model_in_memory(family, layout, weights)
    tokens, expected = golden(mixer)
    with torch.no_grad():
        judge(mixer, model(torch.from_numpy(tokens)).logits.numpy(), expected)


# --- bad checkpoints: one line, exit status 1, nothing written ------------------------------------------------------

def refused(capsys, folder: Path, out: Path, message: str) -> None:
    status = cli(["convert", str(folder), "-o", str(out), "--no-check"])
    err = capsys.readouterr().err
    reasons = [line for line in err.splitlines() if line.startswith("gdn-export: error: ")]
    assert status == 1 and len(reasons) == 1 and message in reasons[0], err
    assert not out.exists() and not [p for p in out.parent.iterdir() if p.name.startswith(".gdn_export_")]


def _copy(tmp_path: Path, mixer: str = "gdn") -> Path:
    folder = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / f"megatron_{mixer}", folder)
    return folder


def test_missing_shard(tmp_path, capsys):
    folder = _copy(tmp_path)
    (folder / "iter_0000001" / "__0_0.distcp").unlink()
    refused(capsys, folder, tmp_path / "m.nnef.tgz", "lacks __0_0.distcp")


def test_missing_tensor_parallel_rank(tmp_path, capsys):
    folder = _copy(tmp_path, "tp2_legacy")
    shutil.rmtree(folder / "iter_0000001" / "mp_rank_01")
    refused(capsys, folder, tmp_path / "m.nnef.tgz", "lacks mp_rank_01")


def test_missing_pipeline_stage(tmp_path, capsys):
    folder = _copy(tmp_path, "pp2_legacy")
    shutil.rmtree(folder / "iter_0000001" / "mp_rank_00_001")
    refused(capsys, folder, tmp_path / "m.nnef.tgz", "lacks mp_rank_00_001")


def _edit_chunks(folder: Path, name: str, edit) -> None:
    """``.metadata`` rewritten (by the test's own trusted pickler) with ``edit(size, chunks) -> (size, chunks)``
    applied to tensor ``name``'s global shape and chunks (lists of (offsets, sizes))."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata

    path = folder / "iter_0000001" / ".metadata"
    metadata = pickle.loads(path.read_bytes())
    meta = metadata.state_dict_metadata[name]
    size, chunks = edit(list(meta.size), [(list(c.offsets), list(c.sizes)) for c in meta.chunks])
    metadata.state_dict_metadata[name] = TensorStorageMetadata(
        meta.properties, torch.Size(size), [ChunkStorageMetadata(torch.Size(o), torch.Size(n)) for o, n in chunks])
    path.write_bytes(pickle.dumps(metadata))


@pytest.mark.parametrize("edit, message", [
    (lambda size, chunks: (size, [chunks[0], ([60, 0], chunks[1][1])]), "the chunks at [0, 0] and [60, 0] overlap"),
    (lambda size, chunks: ([size[0] + 8, size[1]], chunks), "cover 8192 of the 8704 elements"),
    (lambda size, chunks: (size, [chunks[0], ([72, 0], chunks[1][1])]), "the chunk at [72, 0] of shape [64, 64] exceeds"),
], ids=["overlap", "gap", "outside"])
def test_torch_dist_chunks_that_do_not_tile_the_tensor_are_refused(tmp_path, capsys, edit, message):
    """A torch_dist tensor's chunks (the TP = 2 embedding's two halves) moved to overlap, leaving a gap, or reaching
    past the global shape: one line when the checkpoint is opened, nothing written."""
    folder = _copy(tmp_path, "tp2")
    _edit_chunks(folder, "embedding.word_embeddings.weight", edit)
    refused(capsys, folder, tmp_path / "m.nnef.tgz", message)


def test_missing_expert_parallel_rank(tmp_path, capsys):
    folder = _copy(tmp_path, "ep2_legacy")
    shutil.rmtree(folder / "iter_0000001" / "mp_rank_00_001")
    refused(capsys, folder, tmp_path / "m.nnef.tgz", "lacks mp_rank_00_001")


def test_expert_parallel_replicas_that_differ_are_refused(tmp_path, capsys):
    """Every expert-parallel rank of a legacy save holds the whole non-expert model: copies that differ are one
    line, as are local expert indices outside a rank's share."""
    folder = _copy(tmp_path, "ep2_legacy")
    name = "decoder.layers.1.mlp.router.weight"
    _edit_rank(folder, "mp_rank_00_001", lambda model: model.__setitem__(name, model[name] + 1))
    refused(capsys, folder, tmp_path / "m.nnef.tgz", "differs between the pipeline stages or expert-parallel ranks")
    folder = _copy(tmp_path / "second", "ep2_legacy")
    expert = "decoder.layers.1.mlp.experts.local_experts.1.linear_fc2.weight"
    _edit_rank(folder, "mp_rank_00_001", lambda model: model.__setitem__(expert.replace(".1.linear", ".2.linear"),
                                                                            model[expert]))
    refused(capsys, folder, tmp_path / "m.nnef.tgz", "outside the 2 experts of an expert-parallel rank")


def test_missing_torch_dist_rank_file(tmp_path, capsys):
    folder = _copy(tmp_path, "tp2")
    (folder / "iter_0000001" / "__1_0.distcp").unlink()
    refused(capsys, folder, tmp_path / "m.nnef.tgz", "lacks __1_0.distcp")


def _edit_rank(folder: Path, rank: str, edit) -> None:
    path = folder / "iter_0000001" / rank / "model_optim_rng.pt"
    state = torch.load(path, weights_only=False)
    edit(state["model"])
    torch.save(state, path)


def test_inconsistent_tensor_parallel_split(tmp_path, capsys):
    """Shards whose rows cannot be the ranks' slices of every part of the packed in_proj the args describe."""
    folder = _copy(tmp_path, "tp2_legacy")
    name = "decoder.layers.0.self_attention.in_proj.weight"
    for rank in ("mp_rank_00", "mp_rank_01"):
        _edit_rank(folder, rank, lambda model: model.__setitem__(name, model[name][:-2]))
    refused(capsys, folder, tmp_path / "m.nnef.tgz", "the model's arguments give 136")


def test_unequal_tensor_parallel_shards(tmp_path, capsys):
    folder = _copy(tmp_path, "tp2_legacy")
    name = "decoder.layers.2.self_attention.linear_qkv.weight"
    _edit_rank(folder, "mp_rank_01", lambda model: model.__setitem__(name, model[name][:-16]))
    refused(capsys, folder, tmp_path / "m.nnef.tgz", "tensor-parallel shards of unequal shapes")


def test_replicated_norm_differs_between_ranks(tmp_path, capsys):
    folder = _copy(tmp_path, "tp2_legacy")
    name = "decoder.final_norm.weight"
    _edit_rank(folder, "mp_rank_01", lambda model: model.__setitem__(name, model[name] + 1))
    refused(capsys, folder, tmp_path / "m.nnef.tgz", "its copies differ")


def test_merge_tensor_parallel_regroups_parts_and_refuses_uneven_ones():
    """Each TP rank holds its slice of every part of a fused projection: the merge regroups them part by part, and
    parts that cannot be split evenly over the ranks are refused."""
    from gdn_export.megatron.checkpoint import MegatronCheckpointError, merge_tensor_parallel

    global_parts = [torch.arange(4.0), 10 + torch.arange(2.0)]  # parts of 4 and 2 rows
    shards = [torch.cat([part.chunk(2)[rank] for part in global_parts]) for rank in range(2)]
    merged = merge_tensor_parallel("decoder.layers.0.self_attention.in_proj.weight", shards, [4, 2])
    assert torch.equal(merged, torch.cat(global_parts))
    with pytest.raises(MegatronCheckpointError, match="split evenly over 2 tensor-parallel ranks"):
        merge_tensor_parallel("decoder.layers.0.self_attention.in_proj.weight", shards, [3, 3])
    with pytest.raises(MegatronCheckpointError, match="without a known part layout"):
        merge_tensor_parallel("decoder.layers.0.self_attention.in_proj.weight", shards, None)


def test_pipeline_chunks_match_megatrons_layer_offsets():
    """Which layers each pipeline stage and virtual stage holds (``checkpoint.pipeline_chunks``, what a legacy rank
    file's stage-local layer numbers are renumbered by) against Megatron's own ``get_transformer_layer_offset`` /
    ``get_num_layers_to_build`` (GPTModel: even, virtual, uneven first / last stages, the embedding and the loss
    counted as layers, a ``pipeline_model_parallel_layout``) and ``select_pipeline_segment`` (HybridModel: '|'
    segments with virtual stages, uneven stages without '|'), as ``fixtures/make_megatron_fixtures.py
    pipeline_offsets`` recorded them from Megatron-LM (a chunk of no layers: its offset unused)."""
    import json

    from gdn_export.megatron.checkpoint import pipeline_chunks

    reference = json.loads((FIXTURES / "megatron_pipeline_offsets.json").read_text())
    assert len(reference["splits"]) >= 20
    for split in reference["splits"]:
        args = split["args"]
        chunks = pipeline_chunks(args, args["pipeline_model_parallel_size"],
                                 args.get("virtual_pipeline_model_parallel_size") or 1)
        got = [[[start if count else expected[0], count] for (start, count), expected in zip(stage, stage_ref)]
               for stage, stage_ref in zip(chunks, split["chunks"])]
        assert got == split["chunks"], args
    # both the first and the last stage's sizes with no middle stage and virtual stages: Megatron's
    # get_transformer_layer_offset divides by the 0 middle stages; one stage given both: its TransformerConfig refuses
    for stages, virtual in ((2, 2), (1, 2)):
        with pytest.raises(MegatronCheckpointError, match="no middle stage"):
            pipeline_chunks(dict(num_layers=8, decoder_first_pipeline_num_layers=4,
                                 decoder_last_pipeline_num_layers=4), stages, virtual)


@pytest.mark.parametrize("first, second", [("pp2_vpp", "pp2_vpp_legacy"),
                                           ("bridge_qwen3_next_mtp", "bridge_qwen3_next_mtp_pp2")])
def test_one_model_saved_two_ways_reads_alike(first, second):
    """One model saved two ways reads to the same values, every parameter and every MTP head tensor:
    ``megatron_pp2_vpp``'s ranks saved their model chunks in torch_dist (global layer numbers: the chunks' sharded
    state dicts need no renumbering) and legacy (``model0`` / ``model1`` per rank, each chunk's layers from 0);
    Megatron-Bridge converted the same Hugging Face checkpoint at PP = 1 and PP = 2 (the MTP block and a copy of
    the embedding on the last stage)."""
    import numpy as np

    _, _, _, one = open_megatron(FIXTURES / f"megatron_{first}")
    _, _, _, two = open_megatron(FIXTURES / f"megatron_{second}")
    assert one.entries.keys() == two.entries.keys() and len(one.entries) > 30
    for name, entry in one.entries.items():
        np.testing.assert_array_equal(entry.read().numpy(), two.entries[name].read().numpy(), err_msg=name)
    assert (one.mtp is None) == (two.mtp is None)
    for name, entry in (one.mtp.sources if one.mtp else {}).items():
        np.testing.assert_array_equal(entry.read().numpy(), two.mtp.sources[name].read().numpy(), err_msg=name)


@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_5"])
def test_bridge_made_mtp_head_is_the_hugging_face_head_it_came_from(name):
    """``megatron_bridge_qwen3_next_mtp`` / ``_qwen3_5_mtp``: the bundled fixture (its first 2 layers) through
    Megatron-Bridge's HF -> Megatron conversion with its ``mtp.*`` head (MoE / dense) (Bridge's MTP mappings:
    ``eh_proj``, ``enorm``, ``hnorm``, ``mtp_model_layer.*`` ...): the head gdn_export builds from the Megatron
    checkpoint (the decoder's layers) computes what the Hugging Face head computes (the published layout, read by
    ``hf.mtp.read_mtp_head`` from ``fixtures/<name>``), on the same random states and ids, in every position and
    on a cache."""
    from gdn_export.hf.mtp import read_mtp_head
    from gdn_export.megatron.mtp import read_megatron_mtp_head

    megatron = read_megatron_mtp_head(FIXTURES / f"megatron_bridge_{name}_mtp")
    hugging_face = read_mtp_head(FIXTURES / name)
    assert megatron.parts is not None and hugging_face.parts is None
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 12, hugging_face.config.hidden_size, generator=gen)
    ids = torch.randint(0, hugging_face.config.vocab_size, (2, 12), generator=gen)
    outputs = []
    with torch.no_grad():
        for head in (megatron, hugging_face):  # 8 positions from an empty cache, then 4 on it
            first = head(hidden[:, :8], ids[:, :8], *head.empty_cache(2))
            outputs.append((first, head(hidden[:, 8:], ids[:, 8:], *first[2:])))
    for got, want in zip(*outputs):
        judge(f"{name} (logits)", got[0].numpy(), want[0].numpy())
        judge(f"{name} (hidden)", got[1].numpy(), want[1].numpy())


def _legacy_rank_args(folder: Path, **changes) -> Path:
    """Every rank file of the legacy fixture ``folder`` with its args changed; ``folder`` returned."""
    for path in (folder / "iter_0000001").glob("mp_rank_*/model_optim_rng.pt"):
        state = torch.load(path, weights_only=False)
        vars(state["args"]).update(changes)
        torch.save(state, path)
    return folder


@pytest.mark.parametrize("mixer, change, message", [
    ("pp2_vpp_legacy", {"virtual_pipeline_model_parallel_size": None},
     "holds 2 model chunk(s) but the args say virtual_pipeline_model_parallel_size 1"),
    ("pp2_uneven_legacy", {"decoder_first_pipeline_num_layers": 4}, "model holds 2 layers, the args give pipeline "
                                                                    "stage 0 4 (layers 0..3)"),
    ("gpt_pp2_uneven_legacy", {"decoder_first_pipeline_num_layers": None}, "model holds 1 layers, the args give "
                                                                           "pipeline stage 0 2 (layers 0..1)"),
    ("gpt_pp2_vpp_legacy", {"num_layers": 6}, "cannot tell which of the 6 layers"),
    ("gpt_pp2_vpp_legacy", {"pipeline_model_parallel_layout": "Et|tt|tL"}, "layout 'Et|tt|tL' has 3 stages"),
    ("gpt_pp2_vpp_legacy", {"pipeline_model_parallel_layout": "(t*9999999)*9999999"}, "over a million layers"),
], ids=["virtual-size", "first-stage", "even-split", "layers", "layout", "layout-bomb"])
def test_pipeline_split_that_disagrees_with_the_rank_files_is_one_line(tmp_path, capsys, mixer, change, message):
    """A legacy checkpoint whose args place the layers otherwise than its rank files hold them (model chunks,
    uneven stage sizes, layer count): one line naming the stage and what the args give, nothing written."""
    folder = _legacy_rank_args(_copy(tmp_path, mixer), **change)
    refused(capsys, folder, tmp_path / "m.nnef.tgz", message)


def test_grouped_mlp_weight_that_holds_no_whole_experts_is_one_line(tmp_path, capsys):
    """A legacy ``GroupedMLP`` ``weight1`` whose size is no multiple of its rank's experts times the hidden size
    cannot be cut into experts: one line naming it, nothing written."""
    folder = _copy(tmp_path, "gpt_grouped_tp2_legacy")
    path = folder / "iter_0000001" / "mp_rank_01" / "model_optim_rng.pt"
    state = torch.load(path, weights_only=False)
    name = "decoder.layers.1.mlp.experts.weight1"
    state["model"][name] = state["model"][name][:, :-1].contiguous()
    torch.save(state, path)
    refused(capsys, folder, tmp_path / "m.nnef.tgz", f"{name} [64, 127] is no GroupedMLP weight of 4 local experts")


def test_legacy_moe_with_its_own_expert_tensor_parallel_size_reads_the_files_the_saving_ranks_write(tmp_path,
                                                                                                  capsys):
    """``megatron_moe_etp1_legacy`` (TP 2, experts unsplit over 2 expert-parallel ranks) holds only the two files
    its two ranks write, mp_rank_00_000 and mp_rank_01_001 (read against Megatron's logits in
    ``test_eager_model_matches_megatron``); one of them missing is named in one line; an expert tensor-parallel size
    above TP, where two ranks write one file with different expert shards, is refused."""
    from gdn_export.megatron.checkpoint import MegatronCheckpointError, _legacy_writers

    _, _, _, weights = open_megatron(FIXTURES / "megatron_moe_etp1_legacy")
    assert "tensor-parallel size 2, pipeline-parallel size 1, expert-parallel size 2 (experts: tensor-parallel " \
           "size 1)" in weights.summary()
    folder = _copy(tmp_path, "moe_etp1_legacy")
    shutil.rmtree(folder / "iter_0000001" / "mp_rank_01_001")
    refused(capsys, folder, tmp_path / "m.nnef.tgz", "lacks mp_rank_01_001")
    with pytest.raises(MegatronCheckpointError, match="kept only one of their expert shards"):
        _legacy_writers({"data_parallel_size": 2}, 1, 1, 2, folder)
    # two CP ranks of one TP rank write one file: with other expert shards, the same error
    with pytest.raises(MegatronCheckpointError, match="kept only one of their expert shards"):
        _legacy_writers({"data_parallel_size": 1, "context_parallel_size": 2}, 1, 1, 2, folder)


def test_legacy_saved_with_context_parallelism_or_the_tp_pp_dp_order(tmp_path, capsys):
    """The files the saving ranks write with context parallelism (``megatron_tp2_cp2_legacy``: TP 2 x CP 2 writes
    mp_rank_00 and mp_rank_01, each by both CP ranks; ``megatron_moe_cp2_etp1_legacy``: TP 2 x CP 2, the 4 experts
    one a rank; TP rank 0 of CP rank 1 writes mp_rank_00_002) and with the ranks numbered tp-pp-dp
    (``megatron_moe_etp1_tppdp_legacy``: TP 2, PP 2, EP 2, DP 2, 8 ranks) are the ones expected (both read against
    Megatron's logits in ``test_eager_model_matches_megatron``); the CP rank's file missing is named; args the
    tp-pp-dp order cannot have run with are refused."""
    from gdn_export.megatron.checkpoint import MegatronCheckpointError, _legacy_writers

    for mixer, saved in (("tp2_cp2_legacy", "expert-parallel size 1, context-parallel size 2, pattern"),
                         ("moe_cp2_etp1_legacy", "expert-parallel size 4, context-parallel size 2 (experts: "),
                         ("moe_etp1_tppdp_legacy", "expert-parallel size 2 (ranks numbered tp-pp-dp) (experts: ")):
        assert saved in open_megatron(FIXTURES / f"megatron_{mixer}")[3].summary()
    # moe_cp2_etp1 has no attention layer (its args' attention_output_gate, rotary_percent stay unnamed)
    summary = open_megatron(FIXTURES / "megatron_moe_cp2_etp1_legacy")[3].summary()
    assert "rotary" not in summary and "attention" not in summary and "MoE (4 experts" in summary, summary
    folder = _copy(tmp_path, "moe_cp2_etp1_legacy")
    shutil.rmtree(folder / "iter_0000001" / "mp_rank_00_002")
    refused(capsys, folder, tmp_path / "m.nnef.tgz", "lacks mp_rank_00_002")
    with pytest.raises(MegatronCheckpointError, match="as Megatron asserts"):
        _legacy_writers({"data_parallel_size": 2, "pipeline_model_parallel_size": 2, "use_tp_pp_dp_mapping": True},
                        4, 2, 1, folder)


def test_legacy_with_weights_sharded_over_data_parallel_ranks_is_one_line(tmp_path, capsys):
    """Generalized tensor parallelism (Transformer Engine's weight shards over data-parallel ranks) in a legacy
    checkpoint: refused in one line, nothing written."""
    folder = _copy(tmp_path, "tp2_legacy")
    for path in (folder / "iter_0000001").glob("mp_rank_*/model_optim_rng.pt"):
        state = torch.load(path, weights_only=False)
        state["args"].gtp_weight_remat_size = 2
        torch.save(state, path)
    refused(capsys, folder, tmp_path / "m.nnef.tgz", "gtp_weight_remat_size 2")


def test_legacy_grid_disagrees_with_args(tmp_path, capsys):
    """Stage folders of a TP-only save (args: PP 1) are not read as pipeline stages."""
    folder = _copy(tmp_path, "pp2_legacy")
    common = folder / "iter_0000001" / "mp_rank_00_000" / "model_optim_rng.pt"
    state = torch.load(common, weights_only=False)
    state["args"].pipeline_model_parallel_size = 1
    torch.save(state, common)
    refused(capsys, folder, tmp_path / "m.nnef.tgz", "lacks mp_rank_00")


def _with_args(tmp_path: Path, mixer: str = "gdn", **changes) -> Path:
    """The fixture with ``common.pt`` (the older torch_dist layout of the common state, read first) holding changed args."""
    from gdn_export.megatron.checkpoint import MegatronCheckpoint

    folder = _copy(tmp_path, mixer)
    args = {**MegatronCheckpoint(folder).args, **changes}
    torch.save({"args": argparse.Namespace(**args), "checkpoint_version": 3.0},
               folder / "iter_0000001" / "common.pt")
    return folder


def test_unknown_layer_symbol(tmp_path, capsys):
    refused(capsys, _with_args(tmp_path, hybrid_layer_pattern="G-*-GX"), tmp_path / "m.nnef.tgz",
            "layer symbol(s) 'X'")


def test_sqrtsoftplus_scores_hold_float32_over_the_whole_range():
    """The softplus of sqrtsoftplus routing (``ops.moe_ffn.naive.softplus``, spelled in ops that export as they
    compute) against float64 over every float32 logit whose softplus is a normal number: within 4 ulp, finite where
    NNEF's own ``log(exp(x) + 1)`` overflows (x > 88) or rounds to 0 (x < -17)."""
    from gdn_export.ops.moe_ffn.naive import softplus

    x = torch.cat([torch.linspace(-87.0, 120.0, 100_001), torch.tensor([-17.0, 0.0, 1e-8, -1e-8, 88.8, 1e4])])
    exact = torch.nn.functional.softplus(x.double())
    got = softplus(x).double()
    assert torch.isfinite(got).all()
    assert ((got - exact).abs() / exact).max() <= 4 * torch.finfo(torch.float32).eps


@pytest.mark.parametrize("mixer, change, message", [
    ("moe", {"moe_router_score_function": "entmax"}, "moe_router_score_function 'entmax'"),
    ("moe", {"moe_router_enable_expert_bias": True}, "moe_router_enable_expert_bias and softmax scores"),
    ("moe", {"moe_router_num_groups": 3}, "moe_router_num_groups 3"),
    ("moe_sigmoid", {"moe_router_topk": 3}, "moe_router_group_topk 1 and moe_router_topk 3 (a group scored by its "
                                            "top-3 sum)"),
    ("moe_sigmoid", {"moe_router_group_topk": 2, "moe_router_topk": 1}, "(a group scored by its top-0 sum)"),
])
def test_moe_routing_gdn_export_does_not_compute_is_refused(tmp_path, capsys, mixer, change, message):
    refused(capsys, _with_args(tmp_path, mixer, **change), tmp_path / "m.nnef.tgz", message)


@pytest.mark.parametrize("mixer, change, message", [
    ("gdn", {"softmax_scale": 0.5}, "softmax_scale 0.5"),
    ("gdn", {"use_rope_scaling": True}, "rope scaling"),
    ("gdn", {"rotary_seq_len_interpolation_factor": 4.0}, "rotary_seq_len_interpolation_factor 4.0"),
    ("gdn", {"mrope_section": [8, 12, 12]}, "mrope_section"),
    ("moe", {"swiglu": False, "squared_relu": True}, "MoE experts without swiglu"),
], ids=["softmax-scale", "rope-scaling", "interpolation", "mrope", "moe-activation"])
def test_attention_and_expert_settings_gdn_export_does_not_compute_are_refused(tmp_path, capsys, mixer, change,
                                                                               message):
    """Settings that would change the attention's scale or rotary, or the experts' activation: refused in one line
    rather than converted to another model."""
    refused(capsys, _with_args(tmp_path, mixer, **change), tmp_path / "m.nnef.tgz", message)


@pytest.mark.parametrize("mixer, change, message", [
    ("moe", {"add_bias_linear": True}, "a shared expert with add_bias_linear is not supported: Megatron's "
                                       "SharedExpertMLP asserts"),
    ("moe_bias", {"add_bias_linear": False}, "decoder.layers.1.mlp.router.bias, which the model's arguments do not"),
    ("gdn", {"normalization": "L2Norm"}, "normalization 'L2Norm' (RMSNorm or LayerNorm)"),
    ("gdn", {"hybrid_layer_pattern": "--"}, "has no mixer layer"),
    ("gdn", {"normalization": "LayerNorm"}, "decoder.final_norm.bias"),
    ("gdn", {"add_bias_linear": True}, "decoder.layers.2.self_attention.linear_proj.bias"),
    ("gdn", {"add_qkv_bias": True}, "weights missing from the checkpoint: decoder.layers.2.self_attention.linear_qkv.bias"),
    ("layernorm", {"add_bias_linear": False}, "the checkpoint has decoder.layers.0.mlp.linear_fc1.bias, which the "
                                              "model's arguments do not describe"),
], ids=["moe-shared-expert-bias", "moe-biases-undescribed", "l2norm", "no-mixer", "layernorm-without-biases", "biases-missing", "qkv-bias-missing",
                               "biases-undescribed"])
def test_norms_and_biases_the_args_and_tensors_disagree_on_are_refused(tmp_path, capsys, mixer, change, message):
    """What gdn_export does not compute (MoE with biases, another normalization, no mixer) and args that disagree
    with the tensors (LayerNorm or add_bias_linear without the biases, biases the args do not describe): one line,
    nothing written, never a model with a bias dropped or invented."""
    refused(capsys, _with_args(tmp_path, mixer, **change), tmp_path / "m.nnef.tgz", message)


@pytest.mark.parametrize("mixer, change, message", [
    ("gdn", {"hybrid_layer_pattern": "G-" * 10_000}, "at most 4096 layers are read"),
    ("gpt", {"num_layers": 10 ** 9}, "num_layers 1000000000 in the args"),
    ("moe", {"num_experts": 10 ** 8}, "num_experts 100000000 in the args"),
    ("gdn", {"hidden_size": "abc"}, "the checkpoint's args do not describe a model"),
], ids=["long-pattern", "num-layers", "num-experts", "not-a-number"])
def test_args_asking_for_too_much_or_nonsense_are_one_line(tmp_path, capsys, mixer, change, message):
    """What the (untrusted) args ask to build is bounded before anything is built, and a number that is not one
    is the args' fault in one line: no traceback, no allocation sized by the args."""
    refused(capsys, _with_args(tmp_path, mixer, **change), tmp_path / "m.nnef.tgz", message)


@pytest.mark.parametrize("mixer", ["moe_legacy", "moe_bias_legacy"])
def test_grouped_gemm_legacy_experts_read_the_same_model(tmp_path, mixer):
    """The MoE fixtures' legacy saves with their experts renamed as ``TEGroupedMLP`` stores them
    (``experts.linear_fc1.weight<e>`` / ``bias<e>``, Megatron's grouped-GEMM experts; ``SequentialMLP`` writes
    ``experts.local_experts.<e>.linear_fc1.weight``, as the fixtures were saved) read to the same model."""
    import re

    folder = _copy(tmp_path, mixer)

    def regroup(model):
        for name in [n for n in model if ".local_experts." in n]:
            new = re.sub(r"local_experts\.(\d+)\.(linear_fc[12])\.(weight|bias)", r"\2.\3\1", name)
            model[new] = model.pop(name)

    _edit_rank(folder, "mp_rank_00", regroup)
    family, layout, _, weights = open_megatron(folder)
    pieces = [piece for source in weights.entries.values() for piece, _ in source.pieces]
    assert any(piece.endswith(".linear_fc1.weight3") for piece in pieces)
    assert ("bias" in mixer) == any(piece.endswith(".linear_fc2.bias3") for piece in pieces)
    model = model_in_memory(family, layout, weights)
    tokens, expected = golden(mixer)
    with torch.no_grad():
        judge(mixer, model(torch.from_numpy(tokens)).logits.numpy(), expected)


def test_grouped_gemm_legacy_experts_over_expert_parallel_ranks_read_the_same_model(tmp_path, capsys):
    """``moe_bias_legacy`` rewritten as 2 expert-parallel ranks would save it with ``TEGroupedMLP`` experts
    (``mp_rank_00_000`` / ``_001``, each with its 2 local experts' ``linear_fc1.weight<i>`` / ``bias<i>``, i from
    0; the other tensors on both): every expert's weight and bias renumbered to its global index, the same model
    (one rank file in torch's pre-1.6 format, loaded whole: torch maps only its zip format); ``num_experts`` not a
    multiple of the expert-parallel size is a one-line error."""
    import re

    folder = _copy(tmp_path, "moe_bias_legacy")
    iteration = folder / "iter_0000001"
    state = torch.load(iteration / "mp_rank_00" / "model_optim_rng.pt", weights_only=False)
    shutil.rmtree(iteration / "mp_rank_00")
    vars(state["args"]).update(expert_model_parallel_size=2)
    model = state["model"]
    for rank in range(2):
        local = {}
        for name, value in model.items():
            match = re.fullmatch(r"(.*experts\.)local_experts\.(\d+)\.(linear_fc[12])\.(weight|bias)", name)
            if match is None:
                local[name] = value
            elif int(match[2]) // 2 == rank:
                local[f"{match[1]}{match[3]}.{match[4]}{int(match[2]) % 2}"] = value
        (iteration / f"mp_rank_00_{rank:03d}").mkdir()
        # rank 1 in torch's pre-1.6 format, which torch cannot map: loaded whole (a typed check of the format)
        torch.save(dict(state, model=local), iteration / f"mp_rank_00_{rank:03d}" / "model_optim_rng.pt",
                   _use_new_zipfile_serialization=rank == 0)
    family, layout, _, weights = open_megatron(folder)
    pieces = [piece for source in weights.entries.values() for piece, _ in source.pieces]
    assert any(piece.endswith(".linear_fc1.bias3") for piece in pieces)
    tokens, expected = golden("moe_bias_legacy")
    with torch.no_grad():
        judge("moe_bias over 2 expert-parallel ranks", model_in_memory(family, layout, weights)(
            torch.from_numpy(tokens)).logits.numpy(), expected)
    _legacy_rank_args(folder, num_experts=5)
    refused(capsys, folder, tmp_path / "m.nnef.tgz", "num_experts 5 is not a multiple of the expert-parallel size 2")


def test_gpt_model_layers_are_read_per_transformer_layer():
    """A GPTModel with GDN layers (Megatron-Bridge's Qwen3-Next layout): linear_attention_freq / moe_layer_freq
    give each layer's mixer and MLP."""
    _, _, model, weights = open_megatron(FIXTURES / "megatron_gpt")
    assert "GPTModel layers GE*EG-*E" in weights.summary(), weights.summary()
    assert model.config.layer_types == ["linear_attention", "full_attention"] * 2


def test_interleaved_rotary_is_read_in_a_gpt_model_and_refused_in_a_hybrid_model(tmp_path, capsys):
    """A GPTModel's interleaved rotary (fixture gpt_interleaved, matched against Megatron's logits above) is read as
    NeoX halves over reordered q/k channels; a HybridModel's is refused: it rotates adjacent pairs by a table built in
    halves (not a rotation)."""
    _, _, model, weights = open_megatron(FIXTURES / "megatron_gpt_interleaved")
    assert model.config.rotary_interleaved and "interleaved rotary" in weights.summary()
    refused(capsys, _with_args(tmp_path, "moe", rotary_interleaved=True), tmp_path / "m.nnef.tgz",
            "rotary_interleaved in a HybridModel")


def test_gpt_model_without_linear_attention_freq_refused(tmp_path, capsys):
    refused(capsys, _with_args(tmp_path, "gpt", linear_attention_freq=[1, 0]), tmp_path / "m.nnef.tgz",
            "linear_attention_freq [1, 0] is neither a positive int nor a list of 4 0/1 flags")


def test_moe_report_names_the_qwen_next_pieces():
    _, _, _, weights = open_megatron(FIXTURES / "megatron_moe")
    for what in ("MoE (4 experts, top-2 softmax, gated shared expert)", "gated attention output",
                 "rotary on 4 of 16 channels", "zero-centred (1 + w) norms"):
        assert what in weights.summary(), weights.summary()


class _Payload:
    """Unpickled, it would run a shell command that leaves a marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_pickled_code_in_metadata_is_not_run(tmp_path, capsys):
    folder = _copy(tmp_path)
    marker = tmp_path / "ran"
    (folder / "iter_0000001" / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    refused(capsys, folder, tmp_path / "m.nnef.tgz", "refusing to unpickle")
    assert not marker.exists()


def test_pickled_code_in_common_state_is_not_run(tmp_path, capsys):
    folder = _copy(tmp_path)
    marker = tmp_path / "ran"
    torch.save({"args": _Payload(marker)}, folder / "iter_0000001" / "common.pt")
    refused(capsys, folder, tmp_path / "m.nnef.tgz", "cannot be read safely (weights_only)")
    assert not marker.exists()



def test_megatron_enums_in_args_are_read_inert(tmp_path, monkeypatch):
    """Megatron-LM's args hold its own enums (``attention_backend=AttnBackend.auto``): read as inert stand-ins,
    without importing Megatron."""
    import enum
    import sys
    import types

    from gdn_export.megatron.checkpoint import MegatronCheckpoint, MegatronObject

    enums = types.ModuleType("megatron.core.transformer.enums")

    class AttnBackend(enum.Enum):
        auto = 5

    AttnBackend.__module__, AttnBackend.__qualname__ = enums.__name__, "AttnBackend"
    enums.AttnBackend = AttnBackend
    for parent in ("megatron", "megatron.core", "megatron.core.transformer"):
        monkeypatch.setitem(sys.modules, parent, types.ModuleType(parent))
    monkeypatch.setitem(sys.modules, enums.__name__, enums)
    folder = _with_args(tmp_path, attention_backend=AttnBackend.auto)
    monkeypatch.undo()  # Megatron is not importable while the checkpoint is read
    args = MegatronCheckpoint(folder).args
    assert isinstance(args["attention_backend"], MegatronObject) and args["attention_backend"].args == (5,)
