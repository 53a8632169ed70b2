"""The MTP head's torch reference (``gdn_export/models/mtp.py``) against an independent composition: transformers'
own decoder layer of the family (its full-attention ``*DecoderLayer``, eager attention, no cache, whole sequence) and
``*RMSNorm`` in float64, around the published math written out here (fc over [normed embedding | normed hidden],
mtp.norm, the shared head). The module runs in float32 with its own KV cache (a prefill, then decode steps, batch 2);
the float32 rule: max abs error <= 1e-4 x max |reference|."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from gdn_export.hf.mtp import read_mtp_head
from gdn_export.models.mtp import MTPConfig, MTPError, MTPHead, init_random
from helpers import FIXTURES, assert_close, by_fixture

MTP_FIXTURES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
CLASSES = {  # model_type: transformers module, decoder layer, norm, rotary, config class
    "qwen3_5_text": ("qwen3_5", "Qwen3_5DecoderLayer", "Qwen3_5RMSNorm", "Qwen3_5TextRotaryEmbedding",
                     "Qwen3_5TextConfig"),
    "qwen3_5_moe_text": ("qwen3_5_moe", "Qwen3_5MoeDecoderLayer", "Qwen3_5MoeRMSNorm",
                         "Qwen3_5MoeTextRotaryEmbedding", "Qwen3_5MoeTextConfig"),
    "qwen3_next": ("qwen3_next", "Qwen3NextDecoderLayer", "Qwen3NextRMSNorm", "Qwen3NextRotaryEmbedding",
                   "Qwen3NextConfig"),
}


def fixture_config(name: str) -> dict:
    config = json.loads((FIXTURES / name / "config.json").read_text())
    config["mtp_num_hidden_layers"] = 1
    return config


def random_head(config: dict, seed: int = 0) -> MTPHead:
    generator = torch.Generator().manual_seed(seed)
    mtp_config = MTPConfig.from_config(config)
    vocab, hidden = mtp_config.vocab_size, mtp_config.hidden_size
    embed = torch.randn(vocab, hidden, generator=generator)
    head = MTPHead(mtp_config, embed, None if mtp_config.tie_word_embeddings else
                   torch.randn(vocab, hidden, generator=generator) * 0.1)
    init_random(head, generator, scale=0.1)
    return head


def transformers_reference(config: dict, head: MTPHead, hidden: torch.Tensor, next_ids: torch.Tensor):
    """(logits, mtp hidden) over the whole sequence in float64, from transformers' decoder layer and norms."""
    import importlib

    module_name, layer_class, norm_class, rotary_class, config_class = CLASSES[config["model_type"]]
    module = importlib.import_module(f"transformers.models.{module_name}.modeling_{module_name}")
    configuration = getattr(__import__("transformers"), config_class)(
        **{k: v for k, v in config.items() if k != "mtp_num_hidden_layers"})
    configuration._attn_implementation = "eager"
    full = configuration.layer_types.index("full_attention")
    layer = getattr(module, layer_class)(configuration, full).double().eval()
    published = head.published_state_dict()
    state = {}
    for name, value in published.items():
        if not name.startswith("mtp.layers.0."):
            continue
        state[name[len("mtp.layers.0."):]] = value
    experts = configuration.num_experts if hasattr(configuration, "num_experts") else 0
    if experts:  # transformers' fused expert stacks
        gate = torch.stack([state.pop(f"mlp.experts.{e}.gate_proj.weight") for e in range(experts)])
        up = torch.stack([state.pop(f"mlp.experts.{e}.up_proj.weight") for e in range(experts)])
        state["mlp.experts.gate_up_proj"] = torch.cat([gate, up], dim=1)
        state["mlp.experts.down_proj"] = torch.stack([state.pop(f"mlp.experts.{e}.down_proj.weight")
                                                      for e in range(experts)])
    missing, unexpected = layer.load_state_dict({k: v.double() for k, v in state.items()}, strict=False)
    assert not unexpected and not [m for m in missing if "rotary" not in m], (missing, unexpected)

    def norm(weight):
        n = getattr(module, norm_class)(configuration.hidden_size, eps=configuration.rms_norm_eps).double()
        n.weight.data = weight.double()
        return n

    seq = hidden.shape[1]
    embedded = norm(published["mtp.pre_fc_norm_embedding.weight"])(head.embed_tokens.weight.double()[next_ids])
    x = torch.cat([embedded, norm(published["mtp.pre_fc_norm_hidden.weight"])(hidden.double())], -1)
    x = x @ published["mtp.fc.weight"].double().T
    rotary = getattr(module, rotary_class)(configuration).double()
    positions = torch.arange(seq)[None]
    mask = torch.full((seq, seq), float("-inf"), dtype=torch.float64).triu(1)[None, None]
    with torch.no_grad():
        out = layer(x, position_embeddings=rotary(x, positions), attention_mask=mask, position_ids=positions)
        out = out[0] if isinstance(out, tuple) else out
        out = norm(published["mtp.norm.weight"])(out)
    return out @ head.lm_head.weight.double().T, out


@pytest.mark.parametrize("name", MTP_FIXTURES)
def test_head_matches_transformers_layer(name):
    """Prefill of 5 positions then 3 one-position steps through the head's own cache, batch 2, against
    transformers' layer over all 8 positions at once."""
    config = fixture_config(name)
    head = random_head(config)
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 8, config["hidden_size"], generator=generator)
    next_ids = torch.randint(0, config["vocab_size"], (2, 8), generator=generator)
    expected_logits, expected_hidden = transformers_reference(config, head, hidden, next_ids)
    key, value = head.empty_cache(2)
    logits, states = [], []
    with torch.no_grad():
        for start, stop in ((0, 5), (5, 6), (6, 7), (7, 8)):
            out, mtp_hidden, key, value = head(hidden[:, start:stop], next_ids[:, start:stop], key, value)
            logits.append(out)
            states.append(mtp_hidden)
    assert key.shape[2] == 8
    assert_close(torch.cat(logits, 1).numpy(), expected_logits.numpy(), 1e-4, f"{name} logits")
    assert_close(torch.cat(states, 1).numpy(), expected_hidden.numpy(), 1e-4, f"{name} mtp hidden")


@pytest.mark.parametrize("name", MTP_FIXTURES)
def test_published_names_round_trip(name):
    config = fixture_config(name)
    head = random_head(config, seed=3)
    published = head.published_state_dict()
    assert all(k.startswith("mtp.") for k in published) and "mtp.fc.weight" in published
    assert published["mtp.fc.weight"].shape == (config["hidden_size"], 2 * config["hidden_size"])
    other = MTPHead(head.config, head.embed_tokens.weight, head.lm_head.weight)
    # the vocabulary-sized tables given are used, not copied (a conversion would hold them twice)
    assert other.embed_tokens.weight.data_ptr() == head.embed_tokens.weight.data_ptr()
    assert other.lm_head.weight.data_ptr() == head.lm_head.weight.data_ptr()
    other.load_published(published)
    for (n, a), (_, b) in zip(head.named_parameters(), other.named_parameters()):
        assert torch.equal(a, b), n


def test_load_errors_name_the_tensor():
    config = fixture_config("qwen3_5")
    head = random_head(config)
    published = head.published_state_dict()
    missing = {k: v for k, v in published.items() if k != "mtp.norm.weight"}
    with pytest.raises(MTPError, match="mtp.norm.weight"):
        head.load_published(missing)
    with pytest.raises(MTPError, match=r"mtp.fc.weight has shape \[64, 64\], expected \[64, 128\]"):
        head.load_published({**published, "mtp.fc.weight": torch.zeros(64, 64)})
    with pytest.raises(MTPError, match="mtp.layers.1.norm.weight"):
        head.load_published({**published, "mtp.layers.1.norm.weight": torch.zeros(64)})
    with pytest.raises(MTPError, match="mtp_num_hidden_layers is 2"):
        MTPConfig.from_config({**config, "mtp_num_hidden_layers": 2})


def test_oversized_mtp_tensors_are_refused_before_they_are_read(tmp_path, monkeypatch):
    """A checkpoint whose ``mtp.*`` tensors hold more values than a head of its config (here an ``mtp.fc`` 32 times
    too wide) is a one-line error from the headers alone: no ``mtp.*`` tensor is read."""
    import shutil

    from safetensors.torch import load_file, save_file

    from gdn_export.hf.tensors import CheckpointError, TensorEntry

    folder = tmp_path / "qwen3_5"
    shutil.copytree(FIXTURES / "qwen3_5", folder)
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["mtp.fc.weight"] = torch.zeros(tensors["mtp.fc.weight"].shape[0], 64 * tensors["mtp.fc.weight"].shape[1])
    save_file(tensors, str(folder / "model.safetensors"))
    read, original = [], TensorEntry.read
    monkeypatch.setattr(TensorEntry, "read", lambda self, *a, **k: read.append(self.name) or original(self, *a, **k))
    with pytest.raises(CheckpointError, match=r"mtp\.\* tensors hold \d+ values where an MTP head of this config "
                                              r"holds \d+: extra or oversized tensors$"):
        read_mtp_head(folder)
    assert not [name for name in read if name.startswith("mtp.")]


@pytest.mark.parametrize("name", MTP_FIXTURES)
def test_fixture_head_is_read(name):
    """The bundled fixtures carry an MTP head under the published names; ``read_mtp_head`` reads it with the model's
    embedding and head."""
    head = read_mtp_head(FIXTURES / name)
    assert head is not None and head.config.num_layers == 1
    from safetensors.torch import load_file

    tensors = load_file(str(FIXTURES / name / "model.safetensors"))
    assert torch.equal(head.embed_tokens.weight, tensors["model.embed_tokens.weight"])
    for key, value in head.published_state_dict().items():
        assert torch.equal(value, tensors[key]), key
    assert np.isfinite(head(torch.zeros(1, 2, head.config.hidden_size), torch.zeros(1, 2, dtype=torch.long),
                            *head.empty_cache(1))[0].detach().numpy()).all()


# --- in the archive and in tract (slow: each converts a fixture) -----------------------------------------------

def mtp_member_plan(path, batch: int):
    """The archive's MTP member planned in tract for ``batch`` rows (copied out of the archive)."""
    import tarfile
    import tempfile
    from pathlib import Path

    from gdn_export.run.runtime import load_tract_model

    with tempfile.TemporaryDirectory() as folder, tarfile.open(path) as tar:
        copy = Path(folder) / "mtp.nnef.tgz"
        copy.write_bytes(tar.extractfile("mtp.nnef.tgz").read())
        return load_tract_model(copy, {"B": batch})


def member_against_head(plan, head: MTPHead, batch: int, seed: int):
    """Yields (first position, the member's outputs in tract, the torch head's: logits and mtp_hidden of the last
    position, the caches) over a prefill of 5 positions then 3 one-position steps, each through the caches the
    member returned, on seeded random states and tokens of ``batch`` rows."""
    from gdn_export.run.runtime import run_tract

    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch, 8, head.config.hidden_size, generator=generator)
    next_ids = torch.randint(0, head.config.vocab_size, (batch, 8), generator=generator)
    key, value = head.empty_cache(batch)
    tract_key, tract_value = key.numpy(), value.numpy()
    for start, stop in ((0, 5), (5, 6), (6, 7), (7, 8)):
        with torch.no_grad():
            logits, mtp_hidden, key, value = head(hidden[:, start:stop], next_ids[:, start:stop], key, value)
        out = run_tract(plan, [hidden[:, start:stop].numpy(), next_ids[:, start:stop].numpy(), tract_key, tract_value])
        yield start, out, (logits[:, -1:], mtp_hidden[:, -1:], key, value)
        tract_key, tract_value = out[2], out[3]


@pytest.mark.slow
@pytest.mark.parametrize("name", by_fixture(*MTP_FIXTURES))
def test_mtp_graph_in_tract_matches_the_torch_head(name, converted):
    """The archive's MTP graph in tract, a prefill of 5 positions then 3 one-position steps through its cache outputs,
    batch 2, against the torch head (models/mtp.py) over the same inputs: the float32 rule on every output (the
    member's logits and mtp_hidden are the last position's, what a drafter reads; its caches every position's)."""
    for start, out, expected in member_against_head(mtp_member_plan(converted(name), 2), read_mtp_head(FIXTURES / name),
                                                    2, seed=2):
        assert out[0].shape[1] == out[1].shape[1] == 1
        for actual, reference, what in zip(out, expected, ("logits", "mtp_hidden", "key", "value")):
            assert_close(actual, reference.numpy(), 1e-4, f"{name} {what} at {start}")


@pytest.mark.slow
@pytest.mark.parametrize("name", by_fixture(*MTP_FIXTURES))
def test_hidden_output_is_the_state_after_the_final_norm(name, converted, reference_model):
    """The main graph's last output of an MTP archive is transformers' ``last_hidden_state`` (after ``model.norm``),
    at every position of a prefill and a decode step; the archive records the MTP member and what it reads, and
    its digests cover the member."""
    import tarfile

    from gdn_export.run.session import Session

    path = converted(name)
    session = Session(path)
    assert session.metadata["outputs"][-1] == "hidden" and session.mtp["member"] == "mtp.nnef.tgz"
    assert session.mtp["reads"] == "final_norm" and "mtp.nnef.tgz" in session.metadata["digests"]
    with tarfile.open(path) as tar:
        assert "mtp.nnef.tgz" in tar.getnames()
    seen = {}
    session.reset()
    session.on_hidden = lambda start, rows: seen.update({start + i: row for i, row in enumerate(rows[0])})
    ids = np.random.default_rng(0).integers(0, session.metadata["vocab_size"], 10)
    session.prefill(ids[None, :9])
    session.decode(ids[None, 9:])
    with torch.no_grad():
        expected = reference_model(name).model(torch.as_tensor(ids[None])).last_hidden_state[0].double().numpy()
    assert_close(np.stack([seen[t] for t in range(10)]), expected, 1e-4, f"{name} hidden")


@pytest.mark.slow
@pytest.mark.parametrize("name", by_fixture(*MTP_FIXTURES))
def test_mtp_drafts_are_the_reference_heads(name, converted, reference_model, monkeypatch):
    """Every draft ``--speculative mtp`` proposes (K = 3 chained) is the argmax of the torch head fed transformers'
    hidden states of the text so far, chained on its own ``mtp_hidden`` (where the reference's top two logits are
    1e-3 apart or more: a closer tie may fall either way within float32 rounding); and greedy output is plain
    decoding's."""
    from gdn_export.run.generation import SpeculativeConfig, generate
    from gdn_export.run.generation.speculative import MTPDrafter
    from gdn_export.run.session import Session

    proposed = []
    original = MTPDrafter.propose

    def recording(self, history, count):
        drafts, probabilities = original(self, history, count)
        proposed.append((list(history), drafts))
        # the rows kept for later steps are copies: a view would keep its call's whole hidden output alive
        assert all(row.base is None for row in self.rows.values())
        return drafts, probabilities

    monkeypatch.setattr(MTPDrafter, "propose", recording)
    session = Session(converted(name))
    prompt = [int(t) for t in np.random.default_rng(1).integers(0, session.metadata["vocab_size"], 11)]
    plain = [t.token_id for t in generate(session, prompt, 16, temperature=0, stop_token_ids=[],
                                          speculative=None)]
    tokens = generate(session, prompt, 16, temperature=0, stop_token_ids=[], speculative=SpeculativeConfig("mtp", 3))
    assert [t.token_id for t in tokens] == plain
    assert session.on_hidden is None  # the drafter (its head's cache, its rows) went with the request
    assert tokens.generation.drafted == sum(len(d) for _, d in proposed) > 0
    head, model = read_mtp_head(FIXTURES / name), reference_model(name)
    compared = 0
    for history, drafts in proposed:
        with torch.no_grad():
            hidden = model.model(torch.as_tensor([history[:-1]])).last_hidden_state
            logits, mtp_hidden, key, value = head(hidden, torch.as_tensor([history[1:]]), *head.empty_cache(1))
            for draft in drafts:
                top = torch.topk(logits[0, -1].double(), 2).values
                if float(top[0] - top[1]) >= 1e-3:
                    assert draft == int(logits[0, -1].argmax()), (history, drafts)
                    compared += 1
                logits, mtp_hidden, key, value = head(mtp_hidden[:, -1:], torch.as_tensor([[draft]]), key, value)
    assert compared >= len(proposed)


@pytest.mark.slow
def test_mtp_needs_an_archive_with_a_head(converted, capsys):
    """An archive without an MTP head: a one-line error naming the archive and what to use instead, through generate,
    the CLI (usage error) and an Engine."""
    from gdn_export.cli import main as cli
    from gdn_export.errors import GdnExportError
    from gdn_export.run.generation import SpeculativeConfig, TokenRequest, generate
    from gdn_export.run.serving import Engine
    from gdn_export.run.session import Session

    path = converted("lara_mini")
    with pytest.raises(GdnExportError, match="carries no MTP head") as err:
        list(generate(Session(path), [1, 2, 3], 4, speculative=SpeculativeConfig("mtp", 2)))
    assert "\n" not in str(err.value) and path.name in str(err.value)
    assert cli(["generate", str(path), "--prompt-ids", "1,2,3", "--speculative", "mtp"]) == 2
    # more chained drafts than an MTP head is allowed (MAX_MTP_DRAFT): the flag named, before the archive is read
    assert cli(["generate", str(path), "--prompt-ids", "1,2,3", "--speculative", "mtp", "--draft-max", "9"]) == 2
    assert "--draft-max: num_speculative_tokens must be an integer in [1, 8] for method mtp" in capsys.readouterr().err
    with Engine(converted("lara_mini", serving=True), slots=1) as engine:
        with pytest.raises(GdnExportError, match="carries no MTP head"):
            engine.submit(TokenRequest((1, 2, 3), 4, speculative=SpeculativeConfig("mtp", 2)))


def with_member_changed(source, target, change: dict):
    """A copy of archive ``source`` whose MTP member's weight files are changed (label: the float32 values -> new
    ones) and both archives' digests recorded anew (``helpers.resealed``): an archive as a conversion that wrote other
    weights would have written it, which the digests do not tell from the true one."""
    import io
    import tarfile

    from helpers import resealed

    def rebuilt(members, path, replace):
        with tarfile.open(path, "w:gz", compresslevel=1) as out:
            for info, data in members:
                data = replace.get(info.name, lambda d: d)(data)
                info.size = len(data)
                out.addfile(info, io.BytesIO(data))
        return resealed(path)

    def read(fileobj):
        with tarfile.open(fileobj=fileobj) as tar:
            return [(m, tar.extractfile(m).read()) for m in tar.getmembers()]

    def weights(label, how):
        return lambda data: data[:128] + how(np.frombuffer(data[128:], np.float32)).astype(np.float32).tobytes()

    inner = target.with_name("inner.nnef.tgz")
    with open(source, "rb") as raw:
        outer = read(raw)
    member = dict((m.name, d) for m, d in outer)["mtp.nnef.tgz"]
    rebuilt(read(io.BytesIO(member)), inner, {f"{label}.dat": weights(label, how) for label, how in change.items()})
    return rebuilt(outer, target, {"mtp.nnef.tgz": lambda _: inner.read_bytes()})


@pytest.mark.slow
@pytest.mark.xdist_group("qwen3_5")
def test_check_rechecks_the_mtp_head_and_a_malformed_one_is_planned_once(converted, tmp_path, monkeypatch):
    """``gdn-export check`` checks an archive's MTP head against the checkpoint's: a member whose weights differ
    (digests recorded anew) fails it while the main graph passes. A member tract cannot plan is refused in one line,
    the second request gets the same error without planning again, and a file replaced at that path is planned."""
    import shutil

    from gdn_export.errors import GdnExportError
    from gdn_export.pipeline.convert import check
    from gdn_export.run import mtp
    from gdn_export.run.reading import read_metadata

    good = converted("qwen3_5")
    other = with_member_changed(good, tmp_path / "other.nnef.tgz", {"fc.hidden.weight": lambda w: -w})
    result = check(other, FIXTURES / "qwen3_5", prompt_len=5, decode_steps=2)
    assert result.mtp is not None and not result.mtp.ok and not result.ok, result.mtp
    assert result.error <= result.tolerance  # the main graph is the one converted: only its head fails

    planned = []
    original = mtp._plan_member
    monkeypatch.setattr(mtp, "_plan_member", lambda *a: planned.append(a) or original(*a))
    bad = with_member_changed(good, tmp_path / "bad.nnef.tgz", {"norm.weight": lambda w: w[:-1]})
    metadata = read_metadata(bad)
    errors = []
    for _ in range(2):
        with pytest.raises(GdnExportError) as err:
            mtp.mtp_plan(bad, metadata)
        errors.append(str(err.value))
    assert len(planned) == 1 and errors[0] == errors[1] and "\n" not in errors[0], errors
    assert errors[0].startswith(f"{bad}: its MTP head (mtp.nnef.tgz) cannot be planned: weight norm.weight.dat")
    shutil.copyfile(good, bad)  # another file at the same path: planned
    assert mtp.mtp_plan(bad, read_metadata(bad)) is not None and len(planned) == 2


@pytest.mark.slow
@pytest.mark.parametrize("name", by_fixture(*MTP_FIXTURES))
def test_engine_mtp_requests_get_what_they_get_alone(name, converted, monkeypatch):
    """MTP, prompt-lookup and plain requests batched in an Engine (serving archive): every request's greedy tokens
    are those of the request alone through a batch-1 Session, and the MTP ones drafted what ``generate`` drafts for
    the same request (the same hidden states reach the head at the same positions)."""
    from helpers import alone, engine_greedy_events

    from gdn_export.run.generation import SpeculativeConfig, generate
    from gdn_export.run.generation.speculative import MTPDrafter
    from gdn_export.run.serving import Engine
    from gdn_export.run.session import Session

    proposed: dict[tuple, list] = {}
    original = MTPDrafter.propose

    def recording(self, history, count):
        drafts, probabilities = original(self, history, count)
        proposed.setdefault((tuple(history), count), []).append(drafts)
        return drafts, probabilities

    monkeypatch.setattr(MTPDrafter, "propose", recording)

    path = converted(name, serving=True)
    rng = np.random.default_rng(3)
    prompts = [tuple(int(t) for t in rng.integers(0, 128, n)) for n in (7, 70, 3, 12)]
    options = [SpeculativeConfig("mtp", 3), None, SpeculativeConfig("qwen3_next_mtp", 1),
               SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_min=1)]
    with Engine(path, slots=3, buckets=(1, 2, 4), prefix_cache_mib=0, prefill_piece=64) as engine:
        events = engine_greedy_events(engine, prompts, options, 20)
    for i, prompt in enumerate(prompts):
        tokens, _ = alone(path, prompt, 20)
        assert [e.token_id for e in events[i]] == tokens, f"request {i}"
    assert events[0][-1].drafted > 0 and events[2][-1].drafted > 0
    session = Session(path)
    for i in (0, 2):  # each proposal again through a Session: the same drafts
        list(generate(session, prompts[i], 20, temperature=0, stop_token_ids=[], speculative=options[i]))
    assert proposed and all(len(d) == 2 and d[0] == d[1] for d in proposed.values()), proposed


@pytest.mark.slow
def test_server_mtp_requests(converted):
    """The openai client against a real server on 127.0.0.1 (qwen3_5: an MTP head and a tokenizer), a worker pool
    and an Engine: ``speculative_config`` ``{"method": "mtp"}`` (and vLLM's ``qwen3_next_mtp``) gives the greedy
    tokens of the request without it, and usage counts the drafted tokens kept and rejected."""
    import openai

    from helpers import serving

    from gdn_export.run.generation.executor import WorkerPool
    from gdn_export.run.serving import Engine
    from gdn_export.run.session import Session

    for batched in (False, True):
        path = converted("qwen3_5", serving=batched)
        executor = Engine(path, slots=2) if batched else WorkerPool(Session(path), workers=2)
        with serving(executor, "m") as base:
            client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
            ask = dict(model="m", prompt="Hello world, the quick brown fox", max_tokens=24, temperature=0)
            plain = client.completions.create(**ask, extra_body={"ignore_eos": True})
            for method in ("mtp", "qwen3_next_mtp"):
                answer = client.completions.create(**ask, extra_body={
                    "ignore_eos": True, "speculative_config": {"method": method, "num_speculative_tokens": 2}})
                assert answer.choices[0].token_ids == plain.choices[0].token_ids
                details = answer.usage.completion_tokens_details
                assert details.accepted_prediction_tokens + details.rejected_prediction_tokens > 0


@pytest.mark.slow
def test_mtp_head_left_out_is_reported(tmp_path):
    """Where the archive cannot carry the head (``--logits last`` here), the report says so and the archive is the
    one it was before MTP heads were carried: no member, no ``hidden`` output, no ``mtp`` metadata."""
    import tarfile

    import gdn_export
    from gdn_export.run.reading import read_metadata

    path = tmp_path / "last.nnef.tgz"
    report = gdn_export.convert(FIXTURES / "qwen3_5", path, logits="last", check=False)
    assert report.mtp.startswith("MTP head left out: --logits last") and report.mtp in str(report)
    metadata = read_metadata(path)
    assert "mtp" not in metadata and "hidden" not in metadata["outputs"]
    with tarfile.open(path) as tar:
        assert "mtp.nnef.tgz" not in tar.getnames()


# --- a quantized archive's head (slow: converts a fixture per weight format) -------------------------------------

@pytest.fixture(scope="module")
def quantized_mtp(tmp_path_factory):
    """``quantized_mtp(quantize) -> ConvertReport``: fixtures/qwen3_5 converted with ``--quantize``, once per module;
    int8 with the conversion's check (its MTP head's check included), q4_0 without."""
    import gdn_export

    folder = tmp_path_factory.mktemp("quantized_mtp")
    cache = {}

    def get(quantize: str):
        if quantize not in cache:
            out = folder / f"qwen3_5-{quantize}.nnef.tgz"
            cache[quantize] = gdn_export.convert(FIXTURES / "qwen3_5", out, quantize=quantize,
                                                 check=quantize == "int8")
        return cache[quantize]

    return get


def stored_head(path) -> tuple[MTPHead, dict]:
    """The torch head of fixtures/qwen3_5 in the member's form (``split_fc``), every weight the member stores in a
    weight format replaced by its values read back from the member's own bytes: Q4_0 blocks (``q4_0.dequantize``)
    and int8 codes times their scales, told apart by their sizes; and {label: format} of those."""
    import io
    import tarfile

    from gdn_export.weights.q4_0 import codec as q4_0

    header = 128
    head = read_mtp_head(FIXTURES / "qwen3_5").split_fc()
    with tarfile.open(path) as outer, tarfile.open(fileobj=io.BytesIO(outer.extractfile("mtp.nnef.tgz").read())) as tar:
        files = {m.name[:-4]: tar.extractfile(m).read()[header:] for m in tar if m.name.endswith(".dat")}
    formats = {}
    with torch.no_grad():
        for label, param in head.named_parameters():
            data, numel = files[label], param.numel()
            if len(data) == numel // 32 * 18:
                value, formats[label] = q4_0.dequantize(np.frombuffer(data, np.uint8).reshape(-1, 18), param.shape), "q4_0"
            elif len(data) == numel:
                scales = np.frombuffer(files[label + ".int8_scale"], np.float32).reshape(-1, 1)
                codes = np.frombuffer(data, np.int8).reshape(param.shape[0], -1).astype(np.float32)
                value, formats[label] = codes * scales, "int8"
            else:
                assert len(data) == 4 * numel, label
                continue
            param.copy_(torch.from_numpy(np.asarray(value, np.float32)).reshape(param.shape))
    return head, formats


@pytest.mark.slow
@pytest.mark.parametrize("quantize", ["int8", "q4_0"])
def test_quantized_archive_carries_its_head_in_its_weight_format(quantize, quantized_mtp):
    """Under ``--quantize`` the MTP head comes along in the archive's weight format: the report's MTP line says what
    it stored (int8: and its check in tract against the torch head on the same stored weights, judged by the main
    graph's int8 rule, passed), the weights line counts ``mtp.*`` as carried, not left out; greedy ``--speculative
    mtp`` is plain decoding token for token; and (Q4_0: no input rounding, so the float32 rule) the member in tract,
    a prefill of 5 positions then 3 one-position steps, matches the torch head (models/mtp.py) on the weights read
    back from the member's own bytes (``stored_head``): every linear layer's weight in Q4_0, the table in int8."""
    from gdn_export.run.generation import SpeculativeConfig, generate
    from gdn_export.run.session import Session

    report = quantized_mtp(quantize)
    label = quantize.upper()
    assert report.mtp.startswith("MTP head: carried (mtp.nnef.tgz") and f"weights in {label}" in report.mtp, report.mtp
    assert "carried apart: 15 mtp.* as the MTP head" in report.weights and "left out" not in report.weights
    if quantize == "int8":
        assert "checked in tract against torch on the same stored weights: typical |logit error|" in report.mtp
    session = Session(report.path)
    assert session.mtp["quantize"] == quantize and session.mtp["logits"] == "last"
    prompt = [int(t) for t in np.random.default_rng(3).integers(0, session.metadata["vocab_size"], 9)]
    plain = [t.token_id for t in generate(session, prompt, 12, temperature=0, stop_token_ids=[],
                                          speculative=None)]
    tokens = generate(session, prompt, 12, temperature=0, stop_token_ids=[], speculative=SpeculativeConfig("mtp", 2))
    assert [t.token_id for t in tokens] == plain and tokens.generation.drafted > 0
    if quantize != "q4_0":
        return
    head, formats = stored_head(report.path)
    linears = {f"{name}.weight" for name, m in head.named_modules() if isinstance(m, torch.nn.Linear)}
    assert {k for k, v in formats.items() if v == "q4_0"} == linears and formats["embed_tokens.weight"] == "int8"
    for start, out, expected in member_against_head(mtp_member_plan(report.path, 1), head, 1, seed=4):
        assert_close(out[0], expected[0].numpy(), 1e-4, f"Q4_0 head logits at {start}")
