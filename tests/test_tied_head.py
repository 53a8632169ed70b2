"""A head tied to the embedding table (``tie_word_embeddings``) is packed once by tract, and stays exact.

tract 0.23.9 packs a constant matmul operand once at load by constant-folding its packing, except where the
constant (over 4 MiB) has several consumers: a tied table read by the embedding's gather and by the head was packed
again on every call (a decode step 8x slower on Qwen3.5 0.8B's shape: benchmarks/results/cpu_tied_head.md).
``gdn_export.models.decoder.vocab_projection`` reads the table through two ``slice`` ops, which tract folds into
constants of their own. The tied fixtures (fla_delta_net, kimi_linear) are checked against their references by
test_fla.py and test_hf_families.py; no Qwen-family fixture is tied, so this module builds a tiny tied Qwen3.5
whose table is over tract's 4 MiB budget (vocab 20000 x hidden 64, f32).
"""

import json
import math
import re
import tarfile

import numpy as np
import pytest
import torch

import gdn_export
from gdn_export.hf.check import check_against_transformers
from gdn_export.run.session import Session

# one worker builds the checkpoint and its conversions; every test converts it: slow
pytestmark = [pytest.mark.xdist_group("tied_head"), pytest.mark.slow]

VOCAB, HIDDEN = 20000, 64  # 5.1 MB of float32: over tract's 4 MiB const-fold budget (CONST_FOLD_MEM_BUDGET)


@pytest.fixture(scope="module")
def tied_checkpoint(tmp_path_factory):
    import transformers

    config = transformers.Qwen3_5TextConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6,
        layer_types=["linear_attention", "full_attention"], linear_conv_kernel_dim=4, linear_key_head_dim=16,
        linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.Qwen3_5ForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # fixtures/make_fixtures.py's spread: logits far from ties
        for name, param in model.named_parameters():
            if param.dim() >= 2 and "conv" not in name:
                param.copy_(torch.randn(param.shape, generator=gen) / math.sqrt(param.shape[-1]))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    folder = tmp_path_factory.mktemp("tied_qwen3_5")
    model.save_pretrained(folder, safe_serialization=True)
    assert json.loads((folder / "config.json").read_text())["tie_word_embeddings"] is True
    return folder, model


def graph_of(archive):
    with tarfile.open(archive) as tar:
        text = tar.extractfile("graph.nnef").read().decode()
        data = {m.name: m.size for m in tar.getmembers() if m.name.endswith(".dat")}
    return text, data


def assignments(graph: str) -> dict[str, str]:
    """``name -> right-hand side`` of the main graph's single-output assignments."""
    body = graph[graph.index("graph network"):]
    return dict(re.findall(r"^\s*(\w+) = (.*);$", body, re.M))


def readers(nodes: dict[str, str], name: str) -> list[str]:
    return [out for out, rhs in nodes.items() if re.search(rf"\b{name}\b", rhs)]


def head_matmuls(nodes: dict[str, str], table: str) -> list[str]:
    """The products the slices of ``table`` feed (through transposes and unsqueezes only)."""
    found = []
    for piece in readers(nodes, table):
        while not nodes[piece].startswith(("matmul(", "linear(", "tract_core_einsum(")):
            (piece,) = readers(nodes, piece)  # the chain from a slice to its product has one reader per step
        found.append(piece)
    return found


def weight_packs(session: Session, matmuls: list[str]) -> dict[str, list[str]]:
    """Per product, the operand packings tract runs on a decode step (``<node>.pack_a|b`` in its profile)."""
    session.reset()
    session.prefill(np.array([[1, 2, 3]]))
    profile = json.loads(session._runnable(1).profile_json([np.array([[5]], dtype=np.int64)] + session.states))
    ran = [node["node_name"] for node in profile["nodes"]]
    return {m: sorted(n for n in ran if n.startswith(m + ".pack_")) for m in matmuls}


def test_tied_head_reads_its_own_slices_and_is_packed_once(tied_checkpoint, tmp_path):
    folder, hf_model = tied_checkpoint
    out = tmp_path / "tied.nnef.tgz"
    gdn_export.convert(folder, out, check=False)
    graph, data = graph_of(out)
    nodes = assignments(graph)
    # one table on disk, no second copy: the gather and the head read the same variable
    (table,) = [name for name, rhs in nodes.items() if rhs.startswith("variable") and f"[{VOCAB}, {HIDDEN}]" in rhs]
    assert sum(size > VOCAB * HIDDEN * 4 for size in data.values()) == 1
    # the variable is read by the embedding's gather and by slices only, each slice by nothing else than its product
    table_readers = readers(nodes, table)
    kinds = sorted(nodes[r].split("(")[0] for r in table_readers)
    assert kinds == ["slice", "slice", "tract_core_gather"], kinds
    slices = [r for r in table_readers if nodes[r].startswith("slice(")]
    matmuls = [m for s in slices for m in head_matmuls(nodes, s)]
    assert len(matmuls) == 2
    # every weight matrix is read as stored: no unsqueeze or transpose of a variable for tract to copy at load
    # (backends/nnef/float_linears.py): the linear layers and the head's halves are einsums over the variables
    variables = {name for name, rhs in nodes.items() if rhs.startswith("variable") and rhs.count(",") >= 2}
    axis_ops = [out for out, rhs in nodes.items() if rhs.startswith(("unsqueeze(", "transpose("))
                and any(re.search(rf"\b{v}\b", rhs) for v in variables | set(slices))]
    assert not axis_ops, axis_ops
    assert all(nodes[m].startswith("tract_core_einsum(") for m in matmuls)
    # graph inputs and outputs as before
    assert re.search(r"graph network\(input_ids, in_conv_0, in_state_0, in_key_1, in_value_1\) -> "
                     r"\(logits, out_conv_0, out_state_0, out_key_1, out_value_1\)", graph)
    # per call tract packs at most the activations of the head's products (once, shared by both: the weight
    # operands were packed at load), where before it packed the weight too (the test below)
    session = Session(out)
    packs = weight_packs(session, matmuls)
    assert all(len(p) <= 1 for p in packs.values()) and sum(map(len, packs.values())) >= 1, packs
    # and the logits are transformers' (float32 rule: 1e-4 x max(1, max |logit|))
    check = check_against_transformers(session, hf_model, prompt_len=8, decode_steps=4)
    assert check.ok and check.max_abs_error <= 1e-4 * max(1.0, check.max_abs_logit), check


def test_the_unsliced_tied_head_is_packed_on_every_call(tied_checkpoint, tmp_path, monkeypatch):
    """The cause, kept visible: the head reading the shared table directly (the export before vocab_projection)
    makes tract pack the table's operand on every decode step, besides the activations."""
    from gdn_export.hf.families.base import TransformersLM

    folder, _ = tied_checkpoint
    monkeypatch.setattr(TransformersLM, "lm_head", lambda self, x: self.hf.lm_head(x))
    out = tmp_path / "tied_unsliced.nnef.tgz"
    gdn_export.convert(folder, out, check=False)
    nodes = assignments(graph_of(out)[0])
    (table,) = [name for name, rhs in nodes.items() if rhs.startswith("variable") and f"[{VOCAB}, {HIDDEN}]" in rhs]
    (head,) = [r for r in readers(nodes, table) if nodes[r].startswith("tract_core_einsum(")]
    packs = weight_packs(Session(out), [head])
    assert [len(p) for p in packs.values()] == [2], packs
