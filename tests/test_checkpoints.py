"""Checkpoints as they are published: wrappers, shards, bfloat16, transformers' on-load conversions, tokenizers.

Every expectation comes from somewhere else than gdn_export: the safetensors headers and index read here, the
values transformers itself loads, transformers' tokenizer, the fixture's own JSON files.
"""

import functools
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from gdn_export.cli import main as cli
from gdn_export.hf.checkpoint import CheckpointError
from gdn_export.pipeline.convert import check, convert
from gdn_export.run.session import Session
from helpers import FIXTURES, archive_members

SHARDED = "qwen3_next_bf16_sharded"
INDEX = "model.safetensors.index.json"
GENERATION = ["generation_config.json", "tokenizer.json", "tokenizer_config.json"]  # what the fixtures carry


def group(name):
    """A parameter for fixture ``name``, in its pytest-xdist group (helpers.by_fixture): its conversions here are
    made once, by the worker that runs the group."""
    return pytest.mark.xdist_group(name)


# --- conversions made once for this module ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def converted_here(tmp_path_factory):
    """``converted_here(name, dtype="float32", streamed=True) -> ConvertReport``: fixtures/<name> converted with
    ``check=False``, once per module (and worker)."""
    folder = tmp_path_factory.mktemp("checkpoints")
    cache = {}

    def get(name, dtype="float32", streamed=True):
        key = (name, dtype, streamed)
        if key not in cache:
            out = folder / f"{name}-{dtype}-{'streamed' if streamed else 'in-memory'}.nnef.tgz"
            cache[key] = convert(FIXTURES / name, out, dtype=dtype, check=False, streamed=streamed)
            assert cache[key].path == out and out.is_file()
        return cache[key]

    return get


def graph_diff(first: dict[str, bytes], second: dict[str, bytes], lines: int = 6) -> str:
    """The first changed lines of graph.nnef between two archives (for a failure's message)."""
    import difflib

    diff = difflib.unified_diff(first["graph.nnef"].decode().splitlines(), second["graph.nnef"].decode().splitlines(),
                                lineterm="", n=0)
    changed = [line for line in diff if line[:1] in "+-" and line[:3] not in ("+++", "---")]
    return "".join(f"\n  {line.strip()}" for line in changed[:lines])


def nnef_tensor(data: bytes) -> np.ndarray:
    """An NNEF tensor file (the 128-byte header of the NNEF spec, then the items) as an array."""
    header = np.frombuffer(data[:128], np.uint32)
    assert bytes(data[:2]) == b"\x4e\xef", "not an NNEF tensor file"
    rank, bits, code = int(header[2]), int(header[11]), int(header[12])
    assert code == 0, f"item type {code} is not float"
    shape = tuple(int(d) for d in header[3:3 + rank])
    values = np.frombuffer(data[128:], {32: np.float32, 16: np.float16}[bits])
    assert values.size * bits // 8 == int(header[1]) and values.size == int(np.prod(shape, dtype=np.int64))
    return values.reshape(shape)


def header_tensors(folder: Path) -> dict[str, tuple[str, str, list[int]]]:
    """name -> (file, safetensors dtype, shape) for every tensor of every *.safetensors file of ``folder``."""
    tensors = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(path, "pt") as f:
            for key in f.keys():
                piece = f.get_slice(key)
                tensors[key] = (path.name, piece.get_dtype(), list(piece.get_shape()))
    return tensors


@functools.lru_cache(maxsize=None)
def transformers_state(name: str) -> dict[str, torch.Tensor]:
    """The parameters transformers itself loads from fixtures/<name> (its class from config.json), in float32; read
    only (cached)."""
    import transformers

    architecture = json.loads((FIXTURES / name / "config.json").read_text())["architectures"][0]
    model = getattr(transformers, architecture).from_pretrained(FIXTURES / name, dtype=torch.float32)
    return {key: value.detach() for key, value in model.state_dict().items()}


# --- 1. weights streamed from the files make the archive the in-memory model makes ----------------------------

STREAMED = [
    pytest.param("qwen3_5_vl", "float32", marks=group("qwen3_5_vl"), id="qwen3_5_vl-float32"),
    pytest.param(SHARDED, "float32", marks=group(SHARDED), id=f"{SHARDED}-float32"),
    pytest.param("kimi_linear", "float32", marks=group("kimi_linear"), id="kimi_linear-float32"),
    pytest.param("qwen3_5_moe_vl", "float16", marks=group("qwen3_5_moe_vl"), id="qwen3_5_moe_vl-float16"),
]


@pytest.mark.parametrize("name,dtype", STREAMED)
def test_streamed_archive_equals_in_memory_archive(name, dtype, converted_here):
    streamed = archive_members(converted_here(name, dtype, streamed=True).path)
    in_memory = archive_members(converted_here(name, dtype, streamed=False).path)
    assert sorted(streamed) == sorted(in_memory)
    differing = sorted(k for k in streamed if streamed[k] != in_memory[k])
    assert not differing, f"{name} {dtype}: streamed and in-memory archives differ in {differing}" + graph_diff(
        in_memory, streamed)


# parameters whose archive variable must hold transformers' value: the on-load conversions and odd source dtypes
MUST_MATCH = {
    "qwen3_5_vl": ["model.norm.weight", "model.layers.0.linear_attn.in_proj_qkv.weight"],
    SHARDED: ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",  # bf16, bf16, f16 sources
              "model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"],  # experts merged
    "kimi_linear": ["model.layers.0.self_attn.conv1d.weight",  # three convolutions concatenated
                    "model.layers.1.mlp.experts.gate_up_proj"],
    "qwen3_5_moe_vl": ["lm_head.weight", "model.layers.0.mlp.experts.gate_up_proj"],
}


@pytest.mark.parametrize("name,dtype", STREAMED)
def test_streamed_weights_hold_what_transformers_loads(name, dtype, converted_here):
    """Each variable of the streamed archive named after a model parameter (``hf.<name>.dat``) holds transformers'
    loaded value of that parameter, cast to the export dtype: bf16 widened, experts merged, convs concatenated; the
    expert stacks (``expert_stacks.<layer>.*``, hf.blocks.ExpertStacks) hold the gate and up halves of its merged
    ``gate_up_proj`` (and a given routing's stacks that, with zeros appended)."""
    members = archive_members(converted_here(name, dtype).path)
    state = transformers_state(name)
    wrapper = any(key.startswith("model.language_model.") for key in state)
    compared = []
    for member, data in members.items():
        if not (member.startswith("hf.") and member.endswith(".dat")):
            continue
        key = member[3:-4]
        if wrapper and key.startswith("model."):
            key = "model.language_model." + key[len("model."):]
        if key not in state:  # a buffer (rotary inv_freq), recomputed
            continue
        expected = state[key].to(getattr(torch, dtype)).numpy()
        value = nnef_tensor(data)
        assert value.dtype == expected.dtype and value.shape == expected.shape, member
        assert np.array_equal(value, expected), f"{name}: {member} differs from transformers' {key}"
        compared.append(member[3:-4])
    for member, data in members.items():
        match = re.fullmatch(r"expert_stacks\.(\d+)\.(gate_proj|up_proj|widened_down_proj)\.dat", member)
        if not match:
            continue
        layer, part = match.groups()
        merged = "down_proj" if part == "widened_down_proj" else "gate_up_proj"
        source = state[f"model.{'language_model.' if wrapper else ''}layers.{layer}.mlp.experts.{merged}"]
        if merged == "gate_up_proj":
            source = source.chunk(2, dim=1)[part == "up_proj"]
        expected, value = source.to(getattr(torch, dtype)).numpy(), nnef_tensor(data)
        assert value.dtype == expected.dtype, member
        assert np.array_equal(value[tuple(slice(0, n) for n in expected.shape)], expected), member
        assert np.count_nonzero(value) == np.count_nonzero(expected), f"{member}: the widening is not zeros"
        compared.append(f"model.layers.{layer}.mlp.experts.{merged}")
    missing = sorted(set(MUST_MATCH[name]) - set(compared))
    assert not missing, f"{name}: no variable of its own in the archive for {missing} (compared {sorted(compared)})"


@pytest.mark.xdist_group(SHARDED)
def test_derived_projections_are_rows_of_transformers_weights(converted_here):
    """Qwen3-Next's fused in_proj_qkvz / in_proj_ba are exported as rows of them (in_proj_qkv + in_proj_z,
    in_proj_b + in_proj_a, ``gdn_export.models.derived``): the same rows, reordered, in the streamed archive."""
    members = archive_members(converted_here(SHARDED).path)
    state = transformers_state(SHARDED)
    unfused = {"in_proj_qkvz": ("in_proj_qkv", "in_proj_z"), "in_proj_ba": ("in_proj_b", "in_proj_a")}
    for layer in (0, 2):  # the linear-attention layers
        for fused, parts in unfused.items():
            rows = np.concatenate([nnef_tensor(members[f"unfused.{layer}.{part}.weight.dat"]) for part in parts])
            source = state[f"model.layers.{layer}.linear_attn.{fused}.weight"].numpy()
            assert rows.shape == source.shape
            assert not np.array_equal(rows, source), "the rows should be reordered (q, k, v heads grouped)"
            assert np.array_equal(np.unique(rows, axis=0), np.unique(source, axis=0)), f"layer {layer} {fused}"


# --- 2. what the published layouts leave out, and the tied head ------------------------------------------------

@pytest.mark.xdist_group("qwen3_5_vl")
def test_wrapper_report_counts_the_vision_tower(converted_here):
    tensors = header_tensors(FIXTURES / "qwen3_5_vl")
    vision = sum(1 for key in tensors if key.startswith("model.visual."))
    language = sum(1 for key in tensors if key.startswith("model.language_model."))
    assert vision > 0 and language + vision == len(tensors)
    weights = converted_here("qwen3_5_vl").weights
    assert weights.startswith(f"{language} tensors ("), weights
    assert "of the language model of a qwen3_5 checkpoint" in weights
    assert weights.endswith(f"; left out: {vision} vision tower"), weights


@pytest.mark.xdist_group(SHARDED)
def test_sharded_report_counts_mtp_as_left_out(converted_here):
    """The checkpoint's mtp.* tensors, which transformers ignores, are counted as the MTP head's in the weights line:
    left out here (the MTP line says why), carried apart where the head is carried (test_mtp.py)."""
    weight_map = json.loads((FIXTURES / SHARDED / INDEX).read_text())["weight_map"]
    mtp = sum(1 for key in weight_map if key.startswith("mtp."))
    assert mtp > 0 and len(set(weight_map.values())) > 1
    tensors = header_tensors(FIXTURES / SHARDED)
    kept = {key: dtype for key, (_, dtype, _) in tensors.items() if not key.startswith("mtp.")}
    report = converted_here(SHARDED)
    weights = report.weights
    assert weights.endswith(f"; left out: {mtp} multi-token prediction head (mtp.*)"), weights
    assert report.mtp.startswith("MTP head left out: "), report.mtp
    # the tensors no conversion merges keep their dtype: F16 and F32 ones are counted as they are in the headers
    for dtype in ("F16", "F32"):
        count = sum(1 for d in kept.values() if d == dtype)
        assert count > 0 and re.search(rf"(?<!B)\b{dtype} {count}\b", weights), (dtype, count, weights)
    assert "BF16" in weights


def table_copies(members: dict[str, bytes], table: np.ndarray) -> list[str]:
    """The archive's .dat files that hold ``table``."""
    return sorted(m for m, data in members.items() if m.endswith(".dat") and len(data) == 128 + table.nbytes
                  and np.array_equal(nnef_tensor(data), table))


def fixture_tensor(name: str, key: str) -> torch.Tensor:
    file, _, _ = header_tensors(FIXTURES / name)[key]
    with safe_open(FIXTURES / name / file, "pt") as f:
        return f.get_tensor(key)


@pytest.mark.xdist_group("qwen3_5_vl")
def test_tied_wrapper_stores_its_table_once(converted_here):
    """The wrapper ties its head by its top-level tie_word_embeddings (text_config says False, as transformers writes
    it): no lm_head tensor in the checkpoint, and one variable in the archive for both the embedding and the head
    (named after either of them: torch-to-nnef picks the name), not a separate head."""
    config = json.loads((FIXTURES / "qwen3_5_vl" / "config.json").read_text())
    assert config["tie_word_embeddings"] is True and config["text_config"].get("tie_word_embeddings") is False
    assert "lm_head.weight" not in header_tensors(FIXTURES / "qwen3_5_vl")
    members = archive_members(converted_here("qwen3_5_vl").path)
    table = fixture_tensor("qwen3_5_vl", "model.language_model.embed_tokens.weight").numpy()
    copies = table_copies(members, table)
    assert len(copies) == 1 and copies[0] in ("hf.model.embed_tokens.weight.dat", "hf.lm_head.weight.dat"), copies
    tables = [m for m in members if m.endswith(".dat") and ("lm_head" in m or "embed_tokens" in m)]
    assert tables == copies


@pytest.mark.xdist_group("qwen3_5_moe_vl")
def test_untied_wrapper_exports_its_head(converted_here):
    config = json.loads((FIXTURES / "qwen3_5_moe_vl" / "config.json").read_text())
    assert config["tie_word_embeddings"] is False
    members = archive_members(converted_here("qwen3_5_moe_vl", "float16").path)
    head = fixture_tensor("qwen3_5_moe_vl", "lm_head.weight").half().numpy()
    table = fixture_tensor("qwen3_5_moe_vl", "model.language_model.embed_tokens.weight").half().numpy()
    assert table_copies(members, head) == ["hf.lm_head.weight.dat"]
    assert table_copies(members, table) == ["hf.model.embed_tokens.weight.dat"]


@pytest.mark.xdist_group("qwen3_5_vl")
@pytest.mark.slow  # converts a fixture or loads transformers' model
def test_archive_does_not_depend_on_the_hash_seed(tmp_path):
    """Two processes that differ only in PYTHONHASHSEED (Python's order of a set of names) write the same archive:
    e.g. the tied table's one variable is named the same."""
    script = ("import sys, torch; torch.set_num_threads(1); from gdn_export.pipeline.convert import convert; "
              "convert(sys.argv[1], 'm.nnef.tgz', check=False)")
    runs = []
    for seed in ("0", "1"):
        folder = tmp_path / seed
        folder.mkdir()
        env = {**os.environ, "PYTHONHASHSEED": seed, "RUST_BACKTRACE": "0"}
        runs.append(subprocess.Popen([sys.executable, "-c", script, str(FIXTURES / "qwen3_5_vl")], cwd=folder, env=env,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
    for run in runs:
        _, err = run.communicate(timeout=300)
        assert run.returncode == 0, err.decode()[-2000:]
    first, second = (archive_members(tmp_path / seed / "m.nnef.tgz") for seed in ("0", "1"))
    assert sorted(first) == sorted(second), sorted(set(first) ^ set(second))
    differing = sorted(k for k in first if first[k] != second[k])
    assert differing == [], f"{differing}" + graph_diff(first, second)


# --- 3. the layer-by-layer check ----------------------------------------------------------------------------------

def f32_rule(result) -> bool:
    return result.max_abs_error <= 1e-4 * max(1.0, result.max_abs_logit)


@pytest.mark.xdist_group(SHARDED)
@pytest.mark.slow  # converts a fixture or loads transformers' model
def test_layerwise_check_passes_and_agrees_with_the_full_check(tmp_path):
    report = convert(FIXTURES / SHARDED, tmp_path / "f32.nnef.tgz", check="layerwise")
    assert report.check is not None and report.check.ok, str(report)
    assert "layer by layer" in report.check_kind and f32_rule(report.check)
    assert "layer by layer" in str(report)
    assert report.check.positions == 16 + 8

    full = check(report.path, FIXTURES / SHARDED, kind="full")
    assert full.ok and f32_rule(full), str(full)
    assert full.max_abs_logit > 1.0  # logits far from zero: the rule is relative to them

    half = convert(FIXTURES / SHARDED, tmp_path / "f16.nnef.tgz", dtype="float16", check="layerwise")
    assert half.check is not None and half.check.ok and half.check.dtype == "float16", str(half)
    assert "layer by layer" in half.check_kind


@pytest.mark.xdist_group(SHARDED)
@pytest.mark.slow  # converts a fixture or loads transformers' model
def test_layerwise_reference_is_transformers_own_logits():
    """The layer-by-layer reference (one decoder layer's weights in memory at a time) gives the logits of
    transformers' model loaded whole by transformers."""
    import transformers

    from gdn_export.hf.checkpoint import empty_model, open_checkpoint
    from gdn_export.hf.layerwise import layerwise_logits

    tokens = np.random.default_rng(0).integers(0, 128, (2, 12), dtype=np.int64)
    family, layout, _, weights = open_checkpoint(FIXTURES / SHARDED)
    logits = layerwise_logits(empty_model(family, layout), weights, tokens, torch.float32)
    model = transformers.AutoModelForCausalLM.from_pretrained(FIXTURES / SHARDED, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = model(input_ids=torch.from_numpy(tokens), use_cache=False).logits.numpy()
    assert logits.shape == expected.shape
    assert np.abs(logits - expected).max() <= 1e-5 * max(1.0, np.abs(expected).max())


# --- 4. bad checkpoints: a CheckpointError naming the problem, nothing left behind -----------------------------

def copy_fixture(tmp_path, name):
    folder = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / name, folder)
    return folder


def rewrite_shard(folder: Path, shard: str, change) -> None:
    """Load a shard, ``change(tensors)`` in place, save it as transformers does (metadata format pt)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / shard)
    change(tensors)
    save_file(tensors, folder / shard, metadata={"format": "pt"})


def index_of(folder: Path) -> dict:
    return json.loads((folder / INDEX).read_text())


def delete_a_shard(folder):
    shard = sorted(set(index_of(folder)["weight_map"].values()))[1]
    (folder / shard).unlink()
    return [shard, "missing"]


def move_a_tensor_in_the_index(folder):
    index = index_of(folder)
    tensor = "model.embed_tokens.weight"
    actual = index["weight_map"][tensor]
    wrong = next(s for s in sorted(set(index["weight_map"].values())) if s != actual)
    index["weight_map"][tensor] = wrong
    (folder / INDEX).write_text(json.dumps(index))
    return [tensor, wrong, actual]


def drop_text_config(folder):
    config = json.loads((folder / "config.json").read_text())
    del config["text_config"]
    (folder / "config.json").write_text(json.dumps(config))
    return ["text_config"]


def reshape_a_tensor(tensor, shape):
    def change(folder):
        shard, dtype, original = header_tensors(folder)[tensor]
        assert dtype == "BF16" and original != shape
        rewrite_shard(folder, shard, lambda t: t.__setitem__(tensor, torch.zeros(shape, dtype=torch.bfloat16)))
        assert header_tensors(folder)[tensor][2] == shape
        return [tensor, str(shape), str(original)]
    return change


def add_an_unknown_tensor(folder):
    tensor = "model.layers.0.linear_attn.extra_proj.weight"
    index = index_of(folder)
    shard = sorted(set(index["weight_map"].values()))[0]
    rewrite_shard(folder, shard, lambda t: t.__setitem__(tensor, torch.ones(4, 64, dtype=torch.bfloat16)))
    index["weight_map"][tensor] = shard
    (folder / INDEX).write_text(json.dumps(index))
    return [tensor]


BAD = [
    pytest.param(SHARDED, delete_a_shard, id="missing-shard"),
    pytest.param(SHARDED, move_a_tensor_in_the_index, id="tensor-in-wrong-shard"),
    pytest.param("qwen3_5_vl", drop_text_config, id="wrapper-without-text_config"),
    pytest.param(SHARDED, reshape_a_tensor("model.layers.0.mlp.shared_expert.gate_proj.weight", [32, 63]),
                 id="bf16-tensor-of-wrong-shape"),
    pytest.param(SHARDED, add_an_unknown_tensor, id="unknown-tensor"),
]
# a tensor that transformers merges (experts stacked into gate_up_proj) of the wrong shape: still named
def drop_an_expert_tensor(folder):
    tensor = "model.layers.0.mlp.experts.1.up_proj.weight"
    index = index_of(folder)
    shard = index["weight_map"].pop(tensor)
    (folder / INDEX).write_text(json.dumps(index))
    rewrite_shard(folder, shard, lambda t: t.pop(tensor))
    assert tensor not in header_tensors(folder)
    return ["model.layers.0.mlp.experts", "up_proj", "missing"]


BAD_MERGED = [
    pytest.param(SHARDED, reshape_a_tensor("model.layers.0.mlp.experts.1.gate_proj.weight", [32, 63]),
                 id="expert-tensor-of-wrong-shape"),
    pytest.param(SHARDED, drop_an_expert_tensor, id="expert-tensor-missing"),
]


def assert_nothing_left(out: Path):
    assert sorted(p.name for p in out.parent.iterdir()) == [], "the output folder should stay empty"


@pytest.mark.parametrize("name,damage", BAD + BAD_MERGED)
def test_bad_checkpoint_is_refused_by_convert(tmp_path, name, damage):
    folder = copy_fixture(tmp_path, name)
    words = damage(folder)
    out = tmp_path / "out" / "m.nnef.tgz"
    out.parent.mkdir()
    with pytest.raises(CheckpointError) as refused:
        convert(folder, out, check=False)
    message = str(refused.value)
    assert all(word in message for word in words), (words, message)
    assert_nothing_left(out)


@pytest.mark.parametrize("name,damage", BAD + BAD_MERGED)
def test_bad_checkpoint_is_refused_by_the_cli(tmp_path, capsys, name, damage):
    folder = copy_fixture(tmp_path, name)
    words = damage(folder)
    out = tmp_path / "out" / "m.nnef.tgz"
    out.parent.mkdir()
    status = cli(["convert", str(folder), "-o", str(out), "--no-check"])
    err = capsys.readouterr().err
    reasons = [line for line in err.splitlines() if line.startswith("gdn-export: error: ")]
    assert status == 1 and len(reasons) == 1, err
    assert all(word in reasons[0] for word in words), (words, reasons[0])
    assert "unexpected" not in reasons[0]
    assert_nothing_left(out)


# --- 5. ready to generate: the tokenizer, chat template and generation config travel in the archive ------------

@pytest.mark.xdist_group("qwen3_5_vl")
def test_archive_carries_the_tokenizer_and_generation_config(converted_here):
    fixture = FIXTURES / "qwen3_5_vl"
    assert sorted(p.name for p in fixture.iterdir() if p.suffix == ".json" and p.name != "config.json") == GENERATION
    report = converted_here("qwen3_5_vl")
    assert report.generation_files == GENERATION
    members = archive_members(report.path)
    for name in GENERATION:
        assert members[name] == (fixture / name).read_bytes(), name
    for name in GENERATION:
        assert name in str(report)


@pytest.mark.xdist_group("qwen3_5_vl")
def test_session_tokenizes_as_transformers_does(converted_here):
    import transformers

    fixture = FIXTURES / "qwen3_5_vl"
    session = Session(converted_here("qwen3_5_vl").path)
    reference = transformers.AutoTokenizer.from_pretrained(fixture)
    tokenizer = session.tokenizer
    assert tokenizer is not None
    for text in ["Hello world", "The quick brown fox, 42 times!\n\tTabs & symbols: ~{}"]:
        ids = tokenizer.encode(text).ids
        assert ids == reference(text)["input_ids"], text
        assert tokenizer.decode(ids) == text == reference.decode(ids)
    assert tokenizer.get_vocab_size() == len(reference)
    assert max(tokenizer.get_vocab().values()) < session.metadata["vocab_size"]

    tokenizer_config = json.loads((fixture / "tokenizer_config.json").read_text())
    generation_config = json.loads((fixture / "generation_config.json").read_text())
    assert session.chat_template == tokenizer_config["chat_template"]
    assert session.generation_config["eos_token_id"] == generation_config["eos_token_id"]
    assert session.generation_config == generation_config
    # the template renders as transformers renders it, its special tokens known to the archive's tokenizer
    messages = [{"role": "user", "content": "hi"}]
    prompt = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tokenizer.encode(prompt).ids == reference(prompt)["input_ids"]
    assert tokenizer.token_to_id("<|im_end|>") in generation_config["eos_token_id"]


@pytest.mark.xdist_group("qwen3_next")
@pytest.mark.slow  # converts a fixture or loads transformers' model
def test_checkpoint_without_tokenizer_gives_an_archive_of_token_ids(tmp_path):
    fixture = FIXTURES / "qwen3_next"
    assert not [name for name in GENERATION if (fixture / name).exists()]
    report = convert(fixture, tmp_path / "m.nnef.tgz", check=False)
    assert report.generation_files == []
    assert "the archive takes token ids" in str(report)
    assert not [m for m in archive_members(report.path) if m in GENERATION]
    session = Session(report.path)
    assert session.tokenizer is None and session.chat_template is None and session.generation_config is None


@pytest.mark.parametrize("name", ["qwen3_5_moe", "kimi_linear"])
def test_merged_expert_stacks_are_read_a_slice_of_experts_at_a_time(name, monkeypatch):
    """A stack transformers merges from per-expert tensors (``ParameterSource``) reads a run of experts by converting
    only their tensors, and the runs make its whole value; a parameter made otherwise (Kimi's three convolutions
    concatenated) is read whole."""
    from gdn_export.hf.checkpoint import open_checkpoint
    from gdn_export.hf.conversion import ParameterSource
    from gdn_export.hf.tensors import TensorEntry

    _, _, _, weights = open_checkpoint(FIXTURES / name)
    merged = {key: s for key, s in weights.entries.items() if isinstance(s, ParameterSource)}
    stacks = {key: s for key, s in merged.items() if ".experts." in key}
    assert stacks and all(s.row_per_member for s in stacks.values())
    assert all(not s.row_per_member for key, s in merged.items() if key not in stacks)
    reads = []
    original = TensorEntry.read
    monkeypatch.setattr(TensorEntry, "read", lambda self, *a, **k: reads.append(self.name) or original(self, *a, **k))
    for key, source in stacks.items():
        whole = source.read(torch.float32).numpy()
        experts = source.shape[0]
        reads.clear()
        first = source.rows(0, 1, np.dtype(np.float32))
        assert len(reads) == len(source.mapping.collected_tensors)  # one tensor per pattern: expert 0's
        runs = [first] + [source.rows(start, min(experts, start + 2), np.dtype(np.float32))
                          for start in range(1, experts, 2)]
        assert np.array_equal(np.concatenate(runs), whole.reshape(-1)), key
