"""Qwen4-Exp text (``qwen4_exp_text``): GDN and QSA-indexed gated attention over hyper-connection streams, sparse MoE.

What differs from Qwen3.5 (whose GDN mixer this reuses):
- the residual stream is ``hc_count`` streams side by side (``[B, S, hc*D]``); every mixer and MoE reads a
  learned mix of them and writes back through per-stream gates (transformers' ``Qwen4ExpTextGatedResidual``,
  called as is), and a last mixer (no final norm) feeds the LM head;
- attention layers run a token indexer (QSA) that restricts each query to the top ``budget / ratio`` blocks
  of ``ratio`` past tokens plus its own incomplete block; the indexer keeps its raw keys in the cache, so
  they are a carried state here (``indexer_key_<layer>``);
- every feed-forward is a sparse MoE with a shared expert (``sparse_moe``: routing in graph ops, the routed experts
  one ``t2n_extra::moe_ffn`` node, sparse in tract where exact).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from gdn_export.hf.blocks import gated_attention, rope_tables, sparse_moe
from gdn_export.hf.checkpoint import CheckpointError
from gdn_export.hf.families.base import Family
from gdn_export.hf.families.qwen3_5 import Qwen3_5LM
from gdn_export.models.blocks import softmax_gate
from gdn_export.models.state import StateSpec

# scores are sums of ReLUs (>= 0), so this marks "not a candidate block" without an infinity in the graph
NOT_CANDIDATE = -1.0
# below any negated position: marks "not a tied candidate" when ranking ties by position
NOT_TIED = -3.0e38


def indexer_key_state(layer: int, config, dtype: torch.dtype) -> StateSpec:
    # kind "indexer_key": the indexer's raw keys (projection output: before norm, pooling and rotary), one per
    # past token ([B, P, indexer_head_dim]), exactly what transformers' DynamicIndexedLayer.update_indexer keeps
    return StateSpec(f"indexer_key_{layer}", ("B", "P", config.indexer_head_dim), dtype, layer, "indexer_key")


def unsupported_reason(config) -> str | None:
    """Why a config cannot be exported exactly, or None."""
    if config.ple_layer_ids:
        return (f"per-layer n-gram embeddings (PLE, ple_layer_ids={config.ple_layer_ids}) are not supported: their "
                "hashed n-gram lookup needs the previous tokens and a dilated conv state carried across calls, "
                "which this exporter does not implement")
    extra = sorted(set(config.layer_types) - {"linear_attention", "indexed_attention"})
    if extra:
        return f"layer types {extra} are not supported (only linear_attention and indexed_attention)"
    if "indexed_attention" in config.layer_types:
        fields = ("indexer_n_heads", "indexer_kv_heads", "indexer_head_dim", "indexer_budget", "indexer_compress_ratio")
        missing = [name for name in fields if getattr(config, name, None) is None]
        if missing:
            return f"indexed attention layers need the QSA indexer settings, missing: {', '.join(missing)}"
        if config.indexer_kv_heads != 1:
            return f"the QSA indexer supports one key head (indexer_kv_heads={config.indexer_kv_heads})"
    rope_type = (config.rope_parameters or {}).get("rope_type", "default")
    if "dynamic" in rope_type or rope_type == "longrope":
        # transformers recomputes these tables from the longest position seen, a data-dependent switch
        return f"rope_type {rope_type!r} is not supported (its frequencies depend on the sequence length)"
    return None


def token_positions(keys: torch.Tensor) -> torch.Tensor:
    """Positions ``[L]`` of the tokens on axis 1 of ``keys`` ``[B, L, ...]``, taken from its shape, in f32.

    f32 holds every position below 2**24 exactly. Not ``ones_like(..., dtype=torch.int64)``: torch-to-nnef
    keeps the source's float dtype for that result and casts the ``- 1`` to f32, which tract rejects.
    """
    return torch.ones_like(keys[0, :, 0].float()).cumsum(-1) - 1


def window_keys(indexer: nn.Module, keys: torch.Tensor, rotary) -> tuple[torch.Tensor, torch.Tensor]:
    """Pooled, normed, rotated keys of every window of ``ratio`` tokens: (``[B, L+ratio-1, D]``, first positions).

    Row m covers tokens m-ratio+1..m (zeros outside 0..L-1) and is rotated at its first position, which the
    second result holds (``[L+ratio-1]``, f32). transformers pools complete blocks only (windows starting at
    b*ratio); the selection uses only those rows. Every window is computed because gathering blocks would need
    L // ratio, which tract's symbolic shapes cannot follow. Shifts are pads on both sides, never slices: a
    slice of a symbolic axis gets a min()/max() length that tract cannot match with other tensors.
    The mean is summed in token order in f32, then divided: bit-exact with ``key_groups.float().mean(dim=1)``.
    """
    from transformers.models.qwen4_exp.modeling_qwen4_exp import apply_rotary_pos_emb

    ratio = indexer.compress_ratio
    wide = keys.float()
    total = F.pad(wide, (0, 0, ratio - 1, 0))
    for i in range(1, ratio):
        total = total + F.pad(wide, (0, 0, ratio - 1 - i, i))
    pooled = indexer.k_layernorm((total / ratio).to(keys.dtype))
    first = token_positions(total) - (ratio - 1)
    cos, sin = rope_tables(rotary, first[None], keys.dtype)
    return apply_rotary_pos_emb(pooled[:, :, None], cos=cos, sin=sin, unsqueeze_dim=2)[:, :, 0], first


def select_top_blocks(scores: torch.Tensor, candidate: torch.Tensor, where: torch.Tensor, k: int) -> torch.Tensor:
    """The k candidates with the highest score (all of them when there are fewer), ``[B, S, N]`` bool.

    Only topk's values are used (they do not depend on how ties are broken); candidates tied with the k-th
    value are then taken in position order, lowest first. transformers' ``scores.topk`` leaves that order to
    torch's CPU kernel (std::nth_element, not stable: [0, 0, .2, 0] with k=2 gives blocks 2 and 3), so on an
    exact tie at the k-th place the two may keep different blocks; with ReLU scores such ties are sums of
    zeros. ``where`` ``[N]`` holds the candidates' positions (f32).
    """
    if k == 0:
        return torch.zeros_like(scores, dtype=torch.bool)
    masked = torch.where(candidate, scores, NOT_CANDIDATE)
    # k non-candidates appended keep k within the axis while fewer than k positions exist (short prefills)
    kth = torch.topk(F.pad(masked, (0, k), value=NOT_CANDIDATE), k, dim=-1).values[..., k - 1 :]
    above = masked > kth
    tied = candidate & (masked == kth)
    room = k - above.sum(-1, keepdim=True)
    # the k lowest tied positions, ascending (negated for topk's largest-first); absent ones become +3e38
    lowest = -torch.topk(F.pad(torch.where(tied, -where, NOT_TIED), (0, k), value=NOT_TIED), k, dim=-1).values
    tie_rank = (lowest[..., None, :] < where[:, None]).sum(-1)  # tied candidates before each position
    return above | (tied & (tie_rank < room))


def indexer_mask(indexer: nn.Module, query: torch.Tensor, index_keys: torch.Tensor, position_ids: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor, rotary, dtype: torch.dtype) -> torch.Tensor:
    """transformers' ``Qwen4ExpTextQSAIndexer`` combined with the causal mask: additive ``[B, 1, S, L]``.

    A query at position p sees the tokens of its top ``budget // ratio`` complete blocks (blocks of ``ratio``
    tokens from position 0, complete when they end at or before p) and every token after the last complete
    block. Block b's score is sum over heads of relu(q . k_b) / sqrt(D), k_b the pooled key rotated at b*ratio.
    query ``[B, S, H*D]`` (raw projection), index_keys ``[B, L, D]`` (past + new raw keys); cos/sin ``[1, S, R]``
    of the query positions.
    """
    from transformers.models.qwen4_exp.modeling_qwen4_exp import apply_rotary_pos_emb

    batch, seq = query.shape[:2]
    query = indexer.q_layernorm(query.reshape(batch, seq, -1, indexer.index_head_dim))
    query = apply_rotary_pos_emb(query, cos=cos, sin=sin, unsqueeze_dim=2)  # [B, S, H, D]

    ratio = indexer.compress_ratio
    keys, first = window_keys(indexer, index_keys, rotary)
    scores = torch.matmul(query.float(), keys.float().transpose(1, 2)[:, None])  # [B, S, H, L+ratio-1]
    scores = torch.relu(scores).sum(dim=2) / math.sqrt(indexer.index_head_dim)

    query_end = position_ids[..., None].float() + 1  # [1, S, 1]: one past the query's position
    block_start = (first >= 0) & (torch.floor(first / ratio) * ratio == first)  # exact for integer positions
    candidate = block_start & (first + ratio <= query_end)  # complete blocks of the query's past
    chosen = select_top_blocks(scores, candidate, first, indexer.block_topk)
    # window m is chosen for tokens m-ratio+1..m: a max over the ratio windows ending at or after each token,
    # pooled as 2-D with one channel (tract's pooling wants a static channel axis, and S is not)
    chosen = F.max_pool2d(chosen.float()[:, None], (1, ratio), stride=1)[:, 0] > 0  # [B, S, L]

    key_pos = token_positions(index_keys)
    complete = torch.floor(key_pos / ratio) * ratio + ratio <= query_end  # the token's block is complete
    allowed = (key_pos < query_end) & (chosen | ~complete)
    zero = torch.zeros((), dtype=dtype)
    return torch.where(allowed, zero, torch.finfo(dtype).min)[:, None]


class Qwen4ExpLM(Qwen3_5LM):
    """Qwen3.5's GDN mixer and gated attention, with the QSA indexer, hyper-connections and MoE around them."""

    serving_refusal = ("Qwen4-Exp's QSA indexer picks key blocks by position over one shared past (its block "
                       "boundaries and budget come from the key count): per-row past lengths are not implemented")

    def attention_states(self, index, layer, dtype):
        return [*super().attention_states(index, layer, dtype), indexer_key_state(index, self.config, dtype)]

    def embed(self, input_ids):
        return super().embed(input_ids).repeat(1, 1, self.config.hc_count)  # the hc_count streams side by side

    def attention(self, index, layer, x, states, context):
        from transformers.models.qwen4_exp.modeling_qwen4_exp import apply_rotary_pos_emb

        module = layer.self_attn
        past_key, past_value, past_index_keys = states
        indexer = module.indexer
        index_query, new_index_keys = torch.split(
            indexer.index_qk_proj(x), [indexer.index_n_heads * indexer.index_head_dim, indexer.index_head_dim], -1)
        index_keys = torch.cat([past_index_keys.to(x.dtype), new_index_keys], dim=1)
        mask = indexer_mask(indexer, index_query, index_keys, context.positions, *context.rotary,
                            self.hf.model.rotary_emb, x.dtype)
        return (*gated_attention(module, x, *context.rotary, apply_rotary_pos_emb, past_key, past_value,
                                 lambda key, dtype: mask), index_keys)

    def residual(self, index, layer, part, x, branch):
        """Every mixer and MoE reads a learned mix of the streams and writes back through per-stream gates."""
        connection = layer.attn_hyper_connection if part == "mixer" else layer.mlp_hyper_connection
        h, streams, inject = connection(x)
        out, *states = branch(h)
        return (streams + (out.unsqueeze(-2) * inject.unsqueeze(-1)).flatten(-2), *states)

    def moe_gate(self, index, layer):
        return softmax_gate(layer.mlp.gate.norm_topk_prob)

    def feed_forward(self, index, layer, x):
        return sparse_moe(layer.mlp, self.stacks(index), x, layer.mlp.gate.norm_topk_prob)

    def head(self, x):
        return self.lm_head(self.hf.model.hyper_connection_mixer(x))  # a last mix of the streams, no final norm


class Qwen4ExpFamily(Family):
    def exportable(self, hf_model: nn.Module, state_dtype: torch.dtype) -> Qwen4ExpLM:
        reason = unsupported_reason(hf_model.config)
        if reason is not None:
            raise CheckpointError(f"{self.name}: {reason}")
        return super().exportable(hf_model, state_dtype)


FAMILY = Qwen4ExpFamily(
    name="Qwen4-Exp", model_types=("qwen4_exp_text",), lm_class=Qwen4ExpLM,
    config_class="Qwen4ExpTextConfig", model_class="Qwen4ExpForCausalLM",
)
