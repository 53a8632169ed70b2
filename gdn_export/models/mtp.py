"""The multi-token-prediction (MTP) head of Qwen3.5, Qwen3.5-MoE and Qwen3-Next: plain torch, the one reference of its
math (the export, the drafter's tests and the training of a head all run this module).

What the published checkpoints carry under ``mtp.*`` (``mtp_num_hidden_layers: 1``) and what it computes for
position t, given the main model's hidden state ``h_t`` and the token at t+1 (the one sampled or accepted there)::

    x      = mtp.fc( cat[ pre_fc_norm_embedding(embed(token_{t+1})), pre_fc_norm_hidden(h_t) ] )   # embedding FIRST
    x      = mtp.layers.0(x)            # one full-attention decoder layer of the family, its own KV cache
    hidden = mtp.norm(x)                # what a chained draft feeds back as the next h
    logits = lm_head(hidden)            # the model's own head (tied or not as the model): predicts token t+2

``fc`` is ``[H, 2H]`` without bias; the norms are the family's zero-centred RMSNorm (``x̂ · (1 + w)``, f32 math);
the decoder layer is the family's full-attention layer: pre-norm, gated attention (``q_proj`` yields ``[q | gate]``
per head, per-head q/k norms, partial rotary), then the family's MLP (Qwen3.5: dense SwiGLU) or sparse MoE with a
shared expert (Qwen3.5-MoE, Qwen3-Next). The layer's KV cache holds one entry per position t it has seen, at rotary
position t (the position of ``h_t``), so the first call after a prompt of n tokens covers positions 0..n-1 (tokens
1..n as ``next_ids``, the sampled token n last).

Which ``h_t``: the main model's hidden state AFTER its final norm ``model.norm``. vLLM (``vllm/model_executor/
models/qwen3_next_mtp.py``, ``qwen3_5_mtp.py``; the drafter gets the target model's ``forward`` output, and
``Qwen3NextModel.forward`` ends in ``hidden_states, _ = self.norm(hidden_states, residual)``) passes that state
(read at vLLM's main branch, files qwen3_next_mtp.py and qwen3_next.py; SGLang's was not read here); a chained draft
passes the MTP's own output after ``mtp.norm`` (``Qwen3NextMultiTokenPredictor.forward`` returns
``self.norm(hidden_states, residual)``). Megatron-LM's ``MultiTokenPredictionBlock`` reads the same state:
``HybridModel.forward`` / ``GPTModel.forward`` hand it the decoder's output, which ends in the decoder's final norm
(checked by the fixtures ``megatron_moe_mtp`` / ``megatron_gpt_mtp``), so a Megatron head is mapped onto this module
(``megatron/mtp.py``: ``eh_proj`` = ``fc``, ``enorm`` / ``hnorm`` = the two pre-fc norms) and reads it too.

API (stable: the trained fixture's head and Megatron's MTP block build on it)::

    head = MTPHead(MTPConfig.from_config(config), embed_weight, head_weight)   # config.json's (text) fields
    head.load_published(tensors)          # {published name: tensor}: mtp.fc.weight, mtp.pre_fc_norm_*.weight,
                                          # mtp.layers.0.*, mtp.norm.weight (experts per expert or fused)
    key, value = head.empty_cache(batch)  # [B, Hkv, 0, D] each
    logits, hidden, key, value = head(h, next_ids, key, value)   # h [B, S, H], next_ids [B, S] -> [B, S, V], [B, S, H]
    head.last_only = True                 # then logits [B, 1, V] and hidden [B, 1, H] of the last position (the cache
                                          # still of all S): what the archive's member computes

``head.published_state_dict()`` gives the tensors back under the published names (per-expert MoE names), which is
how a trained head is saved.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

import torch
from torch import nn

from gdn_export.models import blocks
from gdn_export.models.blocks import rms_normalize, rotate_half
from gdn_export.models.decoder import vocab_projection

PREFIX = "mtp."
LAYER = "mtp.layers.0."
SKIPPED = "multi-token prediction head (mtp.*)"  # how a checkpoint's summary counts these tensors left out
CARRIED = "mtp.* as the MTP head (mtp.nnef.tgz)"  # ... and carried (CheckpointWeights.carry_apart)


class MTPError(ValueError):
    """An MTP head's config or tensors are not what the published layout says."""


@dataclass(frozen=True)
class MTPConfig:
    """The sizes an MTP head takes from the model's config.json (the text config of a published wrapper)."""

    hidden_size: int
    vocab_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    partial_rotary_factor: float
    intermediate_size: int | None  # the dense MLP's (Qwen3.5)
    num_experts: int = 0  # > 0: a sparse MoE feed-forward (Qwen3.5-MoE, Qwen3-Next)
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    tie_word_embeddings: bool = False
    num_layers: int = 1  # mtp_num_hidden_layers

    @classmethod
    def from_config(cls, config: Mapping) -> MTPConfig:
        """From config.json's fields (the language model's: a wrapper's ``text_config``); rope from
        ``rope_parameters`` or the older top-level ``rope_theta`` / ``partial_rotary_factor``."""
        def field(name, default=None):
            value = config.get(name, default)
            if value is None:
                raise MTPError(f"config.json has no {name!r} (an MTP head needs it)")
            return value

        rope = config.get("rope_parameters") or {}
        hidden, heads = int(field("hidden_size")), int(field("num_attention_heads"))
        layers = int(field("mtp_num_hidden_layers", 0))
        if layers != 1:
            raise MTPError(f"mtp_num_hidden_layers is {layers}; an MTP head of exactly 1 layer is supported")
        experts = int(config.get("num_experts") or 0)
        return cls(
            hidden_size=hidden, vocab_size=int(field("vocab_size")), num_attention_heads=heads,
            num_key_value_heads=int(field("num_key_value_heads")),
            head_dim=int(config.get("head_dim") or hidden // heads), rms_norm_eps=float(field("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
            partial_rotary_factor=float(rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))),
            intermediate_size=None if experts else int(field("intermediate_size")),
            num_experts=experts, num_experts_per_tok=int(config.get("num_experts_per_tok") or 0),
            moe_intermediate_size=int(config.get("moe_intermediate_size") or 0),
            shared_expert_intermediate_size=int(config.get("shared_expert_intermediate_size") or 0),
            norm_topk_prob=bool(config.get("norm_topk_prob", True)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)), num_layers=layers)


class ZeroCentredRMSNorm(nn.Module):
    """Qwen's RMSNorm: ``rmsnorm(x) · (1 + w)`` in f32, one cast back (``w`` initialized to zeros)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (rms_normalize(x, self.eps) * (1.0 + self.weight.float())).to(x.dtype)


def partial_rotary(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Rotary over the first ``cos.shape[-1]`` channels of q, k ``[B, H, S, D]`` (cos/sin ``[1 or B, S, R]``), the
    rest passed through (transformers' Qwen3.5 ``apply_rotary_pos_emb``)."""
    cos, sin = cos[:, None], sin[:, None]
    width = cos.shape[-1]

    def rotate(x):
        turned, kept = x[..., :width], x[..., width:]
        return torch.cat([turned * cos + rotate_half(turned) * sin, kept], dim=-1)

    return rotate(query), rotate(key)


class GatedAttention(nn.Module):
    """The family's full attention's weights under transformers' names (computed by ``blocks.gated_attention``)."""

    def __init__(self, config: MTPConfig) -> None:
        super().__init__()
        hidden, heads, kv_heads, width = (config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
                                          config.head_dim)
        self.head_dim, self.scaling = width, width ** -0.5
        self.q_proj = nn.Linear(hidden, heads * width * 2, bias=False)  # [q | gate] per head
        self.k_proj = nn.Linear(hidden, kv_heads * width, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * width, bias=False)
        self.o_proj = nn.Linear(heads * width, hidden, bias=False)
        self.q_norm = ZeroCentredRMSNorm(width, config.rms_norm_eps)
        self.k_norm = ZeroCentredRMSNorm(width, config.rms_norm_eps)
        rotary = int(width * config.partial_rotary_factor)
        # computed, not a buffer: a float16 copy of the head must not round the frequencies
        self.inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, rotary, 2, dtype=torch.float32) / rotary))


class SwiGLU(nn.Module):
    """A dense SwiGLU MLP under transformers' names (``gate_proj``, ``up_proj``, ``down_proj``, no biases)."""

    def __init__(self, hidden: int, width: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, width, bias=False)
        self.up_proj = nn.Linear(hidden, width, bias=False)
        self.down_proj = nn.Linear(width, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return blocks.swiglu(x, self.gate_proj, self.up_proj, self.down_proj)


class Router(nn.Module):
    def __init__(self, config: MTPConfig) -> None:
        super().__init__()
        self.top_k, self.hidden_dim = config.num_experts_per_tok, config.hidden_size
        self.weight = nn.Parameter(torch.zeros(config.num_experts, config.hidden_size))


class Experts(nn.Module):
    """The routed experts as ``moe_ffn`` takes them: ``gate_proj``, ``up_proj`` ``[E, I, H]``, ``down_proj`` ``[E, H, I]``
    (the published checkpoints store them per expert, ``experts.<e>.gate_proj.weight``, or fused as transformers'
    ``gate_up_proj``; ``MTPHead.load_published`` stacks either)."""

    def __init__(self, config: MTPConfig) -> None:
        super().__init__()
        count, width, hidden = config.num_experts, config.moe_intermediate_size, config.hidden_size
        self.gate = blocks.softmax_gate(config.norm_topk_prob)
        self.gate_proj = nn.Parameter(torch.zeros(count, width, hidden))
        self.up_proj = nn.Parameter(torch.zeros(count, width, hidden))
        self.down_proj = nn.Parameter(torch.zeros(count, hidden, width))


class SparseMoE(nn.Module):
    """Qwen's sparse MoE block under transformers' names (computed by ``blocks.sparse_moe``): top-k softmax routing,
    SwiGLU experts, a shared expert scaled by ``sigmoid(shared_expert_gate(x))``."""

    def __init__(self, config: MTPConfig) -> None:
        super().__init__()
        self.normalize_topk = config.norm_topk_prob
        self.gate = Router(config)
        self.experts = Experts(config)
        self.shared_expert = SwiGLU(config.hidden_size, config.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return blocks.sparse_moe(self, self.experts, x, self.normalize_topk)


class DecoderLayer(nn.Module):
    """``mtp.layers.0``: the family's full-attention decoder layer (pre-norm, gated attention, MLP or sparse MoE)."""

    def __init__(self, config: MTPConfig) -> None:
        super().__init__()
        self.input_layernorm = ZeroCentredRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = GatedAttention(config)
        self.post_attention_layernorm = ZeroCentredRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SparseMoE(config) if config.num_experts else SwiGLU(config.hidden_size, config.intermediate_size)

    def forward(self, x: torch.Tensor, past_key: torch.Tensor, past_value: torch.Tensor,
                positions: torch.Tensor, last_only: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``last_only``: the MLP (per position) and the output on the last position only (the cache on all)."""
        attn = self.self_attn
        cos, sin = blocks.rope_cos_sin(attn.inv_freq, positions, 1.0, x.dtype)

        def mask(keys, dtype):
            return blocks.causal_mask(positions, keys, dtype)

        out, key, value = blocks.gated_attention(attn, self.input_layernorm(x), cos, sin, partial_rotary, past_key,
                                                 past_value, mask)
        x = x + out
        if last_only:
            x = x[:, -1:]
        return x + self.mlp(self.post_attention_layernorm(x)), key, value


class SplitFC(nn.Module):
    """``fc`` as two products, one per half of its input: ``W[:, :H] e + W[:, H:] h`` = ``W cat[e, h]`` (each half
    its own ``nn.Linear``, ``embedding`` and ``hidden``). How the archive's member computes it
    (``MTPHead.split_fc``): tract 0.23.9 rewrites a matmul over a concatenation into matmuls over slices of its
    weight, which a Q4_0 weight cannot take (``tract_quirks.MATMUL_OF_CONCAT_SPLIT``); with two
    weights of their own nothing is sliced, in every weight format."""

    def __init__(self, fc: nn.Linear) -> None:
        super().__init__()
        width = fc.out_features
        self.embedding = nn.Linear(width, width, bias=False).to(fc.weight.dtype)
        self.hidden = nn.Linear(width, width, bias=False).to(fc.weight.dtype)
        with torch.no_grad():
            self.embedding.weight.copy_(fc.weight[:, :width])
            self.hidden.weight.copy_(fc.weight[:, width:])

    def forward(self, embedded: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return self.embedding(embedded) + self.hidden(hidden)


@dataclass(frozen=True)
class MTPParts:
    """How a head other than the published layout builds its norms and its inner layer (a Megatron MTP block of
    any layer the Megatron decoder computes: ``megatron.mtp``). ``norm(width)`` -> a norm module; ``layer()`` -> a
    module with ``forward(x, past_key, past_value, positions, last_only) -> (x, key, value)``, as ``DecoderLayer``.
    Its parameters are named by the module tree, not by the published ``mtp.*`` names (``load_published`` and
    ``published_state_dict`` are the published layout's only)."""

    norm: Callable[[int], nn.Module]
    layer: Callable[[], nn.Module]
    words: str = ""  # what the layer computes, for the report


class MTPHead(nn.Module):
    """One MTP step over S positions: ``forward(hidden, next_ids, past_key, past_value) -> (logits, mtp_hidden,
    key, value)``.

    hidden ``[B, S, H]``: ``h_t`` of the S positions (the main model's state after ``model.norm``, or this head's own
    ``mtp_hidden`` for a chained draft); next_ids ``[B, S]`` int64: the token at t+1 of each; past_key/past_value
    ``[B, Hkv, P, D]``: this head's cache of the P positions before (every row of a batch shares P). Returns the
    logits ``[B, S, V]`` predicting token t+2, ``mtp_hidden`` ``[B, S, H]`` (after ``mtp.norm``), and the caches
    extended to P+S. ``embed_weight`` (``[V, H]``) and ``head_weight`` (``[V, H]``; None: tied to the embedding) are
    the main model's, shared: the tensors given are used as they are, not copied (the vocabulary-sized tables would
    otherwise be in memory twice while a head is made; the readers hand over tensors of their own, a training script
    the frozen model's), and nothing here writes them.
    """

    def __init__(self, config: MTPConfig, embed_weight: torch.Tensor, head_weight: torch.Tensor | None,
                 parts: MTPParts | None = None) -> None:
        """``parts``: how the norms and the inner layer are built (``MTPParts``); None: Qwen3-Next's
        (``ZeroCentredRMSNorm``, ``DecoderLayer``), the published layout."""
        super().__init__()
        self.config, self.parts = config, parts
        hidden = config.hidden_size
        # made on the meta device (no [V, H] table allocated and initialized), then given the tables themselves
        self.embed_tokens = nn.Embedding(config.vocab_size, hidden, device="meta")
        self.embed_tokens.weight = nn.Parameter(embed_weight.detach(), requires_grad=False)
        self.lm_head = nn.Linear(hidden, config.vocab_size, bias=False, device="meta")
        self.lm_head.weight = (self.embed_tokens.weight if head_weight is None else
                               nn.Parameter(head_weight.detach(), requires_grad=False))

        def norm() -> nn.Module:
            return ZeroCentredRMSNorm(hidden, config.rms_norm_eps) if parts is None else parts.norm(hidden)

        self.pre_fc_norm_embedding = norm()
        self.pre_fc_norm_hidden = norm()
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.layers = nn.ModuleList([DecoderLayer(config) if parts is None else parts.layer()])
        self.norm = norm()

    def rebuilt(self, embed_weight: torch.Tensor, head_weight: torch.Tensor | None) -> MTPHead:
        """A head of the same config and parts (its weights fresh): what a check rebuilds from stored weights."""
        return MTPHead(self.config, embed_weight, head_weight, self.parts)

    reads = "final_norm"  # which main-model state it reads: after model.norm (vLLM; see the module doc)
    # True: logits and mtp_hidden of the last position only (the cache of every position): what a drafter reads, the
    # archive's member computes (pipeline/mtp.py); False: every position's (the reference, training)
    last_only = False

    def empty_cache(self, batch: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (batch, self.config.num_key_value_heads, 0, self.config.head_dim)
        return torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)

    def forward(self, hidden: torch.Tensor, next_ids: torch.Tensor, past_key: torch.Tensor,
                past_value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        embedded = self.pre_fc_norm_embedding(self.embed_tokens(next_ids))
        normed = self.pre_fc_norm_hidden(hidden)
        x = self.fc(embedded, normed) if isinstance(self.fc, SplitFC) else self.fc(torch.cat([embedded, normed], -1))
        positions = blocks.positions(next_ids, past_key)
        x, key, value = self.layers[0](x, past_key, past_value, positions, self.last_only)
        out = self.norm(x)
        return vocab_projection(out, self.lm_head, self.tied_head), out, key, value

    def split_fc(self) -> MTPHead:
        """``fc`` as ``SplitFC`` (in place; the archive's form): its parameters are then ``fc.embedding.weight`` and
        ``fc.hidden.weight``, no longer the published names (load and save before)."""
        if not isinstance(self.fc, SplitFC):
            self.fc = SplitFC(self.fc)
        return self

    @property
    def tied_head(self) -> bool:
        """Whether the head reads the embedding table itself (a quantized export gives it a copy of its own)."""
        return self.lm_head.weight is self.embed_tokens.weight

    # ---- the published names ----

    def published_names(self) -> dict[str, str]:
        """{published name: this module's parameter name}; routed experts as stacks (see ``load_published``)."""
        names = {}
        for name, _ in self.named_parameters():
            if name.startswith(("embed_tokens.", "lm_head.")):
                continue
            names[PREFIX + name] = name
        return names

    def published_numel(self) -> int:
        """How many values the ``mtp.*`` tensors of this head hold (per-expert or fused: the same count)."""
        params = dict(self.named_parameters())
        return sum(params[name].numel() for name in self.published_names().values())

    def load_published(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Every ``mtp.*`` weight from ``tensors`` (published names; any other name is not read); routed experts per
        expert (``mtp.layers.0.mlp.experts.<e>.{gate,up,down}_proj.weight``) or fused (``...experts.gate_up_proj``
        ``[E, 2I, H]``, ``...experts.down_proj`` ``[E, H, I]``). Shapes are checked; a missing or extra ``mtp.*``
        tensor is an ``MTPError`` naming it."""
        given = {k: v for k, v in tensors.items() if k.startswith(PREFIX)}
        params = dict(self.named_parameters())
        used = set()
        for published, name in self.published_names().items():
            value = given.get(published)
            if value is None and name.startswith("layers.0.mlp.experts."):
                value = self._stacked_experts(given, name.rsplit(".", 1)[1], used)
            elif value is not None:
                used.add(published)
            if value is None:
                raise MTPError(f"the checkpoint has no {published} (an MTP head of this config needs it)")
            target = params[name]
            if tuple(value.shape) != tuple(target.shape):
                raise MTPError(f"{published} has shape {list(value.shape)}, expected {list(target.shape)}")
            with torch.no_grad():
                target.copy_(value.to(target.dtype))
        extra = sorted(set(given) - used)
        if extra:
            raise MTPError(f"{len(extra)} mtp.* tensors this head does not read, e.g. {extra[0]} "
                           f"(expected mtp_num_hidden_layers: 1 in the family's layout)")

    def _stacked_experts(self, given: Mapping[str, torch.Tensor], which: str, used: set) -> torch.Tensor | None:
        base = LAYER + "mlp.experts."
        fused = {"gate_proj": "gate_up_proj", "up_proj": "gate_up_proj", "down_proj": "down_proj"}[which]
        if base + fused in given:
            used.add(base + fused)
            value = given[base + fused]
            if which == "down_proj":
                return value
            half = value.shape[1] // 2
            return value[:, :half] if which == "gate_proj" else value[:, half:]
        names = [f"{base}{e}.{which}.weight" for e in range(self.config.num_experts)]
        if not all(n in given for n in names):
            return None
        used.update(names)
        return torch.stack([given[n] for n in names])

    def published_state_dict(self) -> dict[str, torch.Tensor]:
        """This head's weights under the published names, routed experts per expert (how a trained head is saved)."""
        out = {}
        params = dict(self.named_parameters())
        for published, name in self.published_names().items():
            value = params[name].detach()
            if name.startswith("layers.0.mlp.experts."):
                which = name.rsplit(".", 1)[1]
                for e in range(value.shape[0]):
                    out[f"{LAYER}mlp.experts.{e}.{which}.weight"] = value[e].contiguous()
            else:
                out[published] = value.contiguous()
        return out


def init_random(head: MTPHead, generator: torch.Generator, scale: float = 0.02) -> None:
    """Seeded random weights of a fresh head (fixtures, benchmarks): matrices ~ N(0, scale), norm weights ~ N(0, 0.1)
    (``1 + w`` near 1), in ``named_parameters`` order."""
    with torch.no_grad():
        for name, param in head.named_parameters():
            if name.startswith(("embed_tokens.", "lm_head.")):
                continue
            std = 0.1 if param.dim() == 1 else scale
            param.copy_(torch.randn(param.shape, generator=generator) * std)


__all__ = ["MTPConfig", "MTPError", "MTPHead", "MTPParts", "init_random"]
