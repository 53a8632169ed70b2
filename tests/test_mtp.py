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
from helpers import FIXTURES, assert_close

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
