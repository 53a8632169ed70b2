"""Export-friendly tensor functions shared by the FLA layers and the Hugging Face families.

Each takes weights and explicit state tensors (never a transformers module) and is traceable into one
S-generic graph: nothing here reads a sequence length into Python, positions and masks come from tensor
shapes, and the gated delta rule and its short conv are single ``t2n_extra`` nodes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.nn.functional as F

from gdn_export.ops.causal_conv1d.op import causal_conv1d_update
from gdn_export.ops.gated_delta_rule.op import gated_delta_rule
from gdn_export.ops.moe_ffn.naive import (dense_experts, grouped_sigmoid_routing,  # noqa: F401  (the families'
                                          grouped_softmax_routing, softmax_gate,     # names for them)
                                          top_k_routing)
from gdn_export.ops.moe_ffn.op import moe_ffn

if TYPE_CHECKING:
    from torch.nn import Module

    from gdn_export.models.row_lengths import RowLengths


def indices_along(along: torch.Tensor) -> torch.Tensor:
    """0..n-1 for a 1-D tensor of n elements, from its shape alone (a cumsum: no arithmetic on a symbolic size, which
    torch-to-nnef would type as f32). int64; a float ``along`` is written in its own dtype by torch-to-nnef
    (tract_quirks.T2N_ONES_LIKE_INT64), exact below 2**24."""
    return torch.ones_like(along, dtype=torch.int64).cumsum(-1) - 1


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """NeoX-style rotary's partner channels: ``[-x2 | x1]`` for ``x = [x1 | x2]``."""
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x · rsqrt(mean(x²) + eps)`` over the last axis, in f32 (FLA's norm kernels load everything as f32)."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def layer_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``(x - mean(x)) · rsqrt(var(x) + eps)`` over the last axis, the biased variance (torch's and Megatron's
    ``LayerNorm``; apex's and Transformer Engine's kernels), in f32. Spelled as the mean of the centred squares:
    the plain ops that lower to NNEF (no ``layer_norm`` node)."""
    x = x.float()
    centred = x - x.mean(-1, keepdim=True)
    return centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + eps)


def swiglu(x: torch.Tensor, gate_proj, up_proj, down_proj) -> torch.Tensor:
    """The SwiGLU feed-forward ``down_proj(silu(gate_proj(x)) · up_proj(x))`` (the three bias-free linears given)."""
    return down_proj(F.silu(gate_proj(x)) * up_proj(x))


def positions(input_ids: torch.Tensor, past: torch.Tensor, past_len: torch.Tensor | None = None) -> torch.Tensor:
    """Absolute positions of the new tokens: ``[1, S]``, the past length (axis 2 of a cache) plus 0..S-1, one row for
    the whole batch (every sequence of a batch shares its past length: no batch axis enters the position
    arithmetic, which keeps tract's symbolic shapes simple); or, in a serving graph (``past_len`` ``[B]``, each
    row's own past length), ``[B, S]``: ``past_len[b]`` plus 0..S-1.
    """
    # input_ids[0] (a select, not a [:1] slice): tract would carry a slice's extent as min(B, 1) - min(B, 0)
    offsets = indices_along(input_ids[0])[None]
    if past_len is not None:
        return offsets + past_len[:, None]
    return offsets + past.shape[2]


def causal_mask(query_positions: torch.Tensor, keys: torch.Tensor, dtype: torch.dtype,
                sliding_window: int | None = None, past_len: torch.Tensor | None = None,
                past: torch.Tensor | None = None) -> torch.Tensor:
    """Additive mask ``[1, 1, S, P+S]`` (``[B, 1, S, P+S]`` in a serving graph): 0 where key position j <= query
    position i (and within the window), the dtype's lowest value elsewhere.

    ``keys`` is any tensor with the P+S key positions on axis 2 (a layer's extended key cache): the mask
    takes its length from there, so a symbolic past stays symbolic.

    Serving graph (``past_len`` ``[B]`` and ``past``, a cache input with P on axis 2): the cache rows are padded
    to the longest past of the batch, so past key j is row b's position j, a key only where j < past_len[b] (the
    rest is padding: masked, its softmax weight exactly 0); the S new keys are at the query positions. Built as
    the past part and the new part side by side, with no arithmetic on P (torch-to-nnef would type a shape used
    in arithmetic as f32 against the int64 indices). P >= 1: tract fails a cumsum over an empty axis, so a
    serving graph's caches always hold at least one (padding) position (``Session`` and ``Engine`` pad them).
    """
    window = None if sliding_window is None else query_positions[:, :, None] - sliding_window
    if past_len is None:
        key_positions = indices_along(keys[0, 0, :, 0])[None]  # [1, P+S]
        allowed = key_positions[:, None, :] <= query_positions[:, :, None]
        if window is not None:
            allowed = allowed & (key_positions[:, None, :] > window)
    else:
        past_positions = indices_along(past[0, 0, :, 0])[None, None]  # [1, 1, P]
        # below every query position of its row; "& (q >= 0)" (always true) broadcasts it over the S queries
        allowed_past = (past_positions < past_len[:, None, None]) & (query_positions[:, :, None] >= 0)
        allowed_new = query_positions[:, None, :] <= query_positions[:, :, None]
        if window is not None:
            allowed_past = allowed_past & (past_positions > window)
            allowed_new = allowed_new & (query_positions[:, None, :] > window)
        allowed = torch.cat([allowed_past, allowed_new], dim=2)
    zero = torch.zeros((), dtype=dtype)
    return torch.where(allowed, zero, torch.finfo(dtype).min)[:, None]


def rope_cos_sin(inv_freq: torch.Tensor, position_ids: torch.Tensor, scaling: float, dtype: torch.dtype):
    """Standard rotary tables ``[B, S, 2*len(inv_freq)]`` (transformers' default rope)."""
    freqs = position_ids[..., None].float() * inv_freq.float()
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scaling: float):
    """transformers' eager attention: q ``[B, H, S, D]``, k/v ``[B, Hkv, P+S, D]``, mask ``[B or 1, 1, S, P+S]``;
    returns ``[B, S, H, Dv]``.

    GQA: query head ``h`` reads key/value head ``h // G`` (``G = H / Hkv``), as transformers' ``repeat_interleave``
    of k and v; here the G query heads of one key head are stacked as rows of one product (q viewed ``[B, Hkv, G*S,
    D]``): the same dot products, without copying the cache G times per call, which in tract cost O(past) copies and
    operand packings every decode step (a quarter of the 0.8B shape's step at 512 tokens of past)."""
    batch, heads, seq, dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    if groups == 1:  # one query head per key head: the plain products (no reshapes in the graph)
        weights = torch.matmul(query, key.transpose(2, 3)) * scaling + mask
        weights = F.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
        return torch.matmul(weights, value).transpose(1, 2)
    stacked = query.reshape(batch, kv_heads, groups * seq, dim)
    scores = torch.matmul(stacked, key.transpose(2, 3)) * scaling                    # [B, Hkv, G*S, P+S]
    scores = scores.reshape(batch, kv_heads, groups, seq, -1) + mask[:, :, None]    # [B, Hkv, G, S, P+S]
    weights = F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    out = torch.matmul(weights.reshape(batch, kv_heads, groups * seq, -1), value)   # [B, Hkv, G*S, Dv]
    return out.reshape(batch, heads, seq, -1).transpose(1, 2)


def extend_cache(past: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    return torch.cat([past.to(new.dtype), new], dim=2)


def gated_delta_mixer(
    mixed_qkv: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_state: torch.Tensor,
    recurrent_state: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    key_heads: int,
    heads: int,
    width_k: int,
    width_v: int,
    rows: RowLengths | None = None,
):
    """Short conv + SiLU over ``[q|k|v]`` channels, then the gated delta rule with in-kernel q/k L2 norm.

    mixed_qkv ``[B, S, 2*Hk*K + H*V]`` (pre-conv, model dtype); g, beta ``[B, S, H]``; ``rows``: a serving graph's
    per-row token counts (padding tokens are identity steps, the conv state is taken at each row's end).
    Returns (core output ``[B, S, H, V]``, new conv state, new recurrent state).
    """
    batch_seq = mixed_qkv.shape[:2]
    convolved, conv_state = short_conv(mixed_qkv.transpose(1, 2), conv_weight, conv_state, rows)
    convolved = convolved.transpose(1, 2)
    g, beta = identity_steps(rows, g, beta)
    key_dim = key_heads * width_k
    query, key, value = torch.split(convolved, [key_dim, key_dim, heads * width_v], dim=-1)
    query = query.reshape(*batch_seq, key_heads, width_k)
    key = key.reshape(*batch_seq, key_heads, width_k)
    value = value.reshape(*batch_seq, heads, width_v)
    core, recurrent_state = gated_delta_rule(query, key, value, g, beta, recurrent_state, use_qk_l2norm=True)
    return core, conv_state, recurrent_state


def short_conv(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor,
               rows: RowLengths | None = None, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``causal_conv1d_update`` (x ``[B, C, S]``, a ``bias`` ``[C]`` before the SiLU or None); with ``rows``, the new
    state is taken at each row's own last real token (``RowLengths.conv_state``) instead of after all S."""
    out, new_state = causal_conv1d_update(x, weight, state, bias)
    return out, new_state if rows is None else rows.conv_state(state, x)


def identity_steps(rows: RowLengths | None, *gates: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """The gates as they are, or with a serving call's padding tokens made identity steps
    (``RowLengths.identity_steps``)."""
    return gates if rows is None else rows.identity_steps(*gates)


def delta_beta(b: torch.Tensor, allow_neg_eigval: bool) -> torch.Tensor:
    """β = σ(b), doubled with ``allow_neg_eigval`` (β in [0, 2]: the transition may have a negative eigenvalue)."""
    beta = b.sigmoid()
    return beta * 2.0 if allow_neg_eigval else beta


def gdn_decay(a: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """g = -exp(A_log) * softplus(a + dt_bias), in f32 (docs/MATH.md): one decay per head, a ``[B, S, H]``."""
    return -a_log.float().exp() * F.softplus(a.float() + dt_bias)


def per_head_decay(f: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """The same per key channel: ``-exp(A_log[h]) · softplus(f + dt_bias)``, f32: f ``[B, S, H, K]``, A_log ``[H]``,
    dt_bias ``[H·K]`` (FLA's KDA gate ``naive_kda_gate`` and GDN-2's inline gate)."""
    heads = f.shape[-2]
    return -a_log.float().exp()[:, None] * F.softplus(f.float() + dt_bias.float().view(heads, -1))


def cached_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, past_key: torch.Tensor,
                     past_value: torch.Tensor, mask: Callable[..., torch.Tensor], scaling: float,
                     sliding_window: int | None = None):
    """Ungated attention over an explicit cache: q ``[B, H, S, D]``, new k/v ``[B, Hkv, S, D]`` after rotary;
    ``mask(keys, dtype, sliding_window)`` the additive mask over the extended keys (``Context.mask``).

    Returns (output ``[B, S, H*Dv]`` ready for the output projection, extended key cache, extended value cache).
    The whole past is kept and out-of-window keys are masked: transformers' sliding cache drops them instead,
    which leaves the same softmax since masked weights are exactly zero.
    """
    key, value = extend_cache(past_key, key), extend_cache(past_value, value)
    out = attend(query, key, value, mask(key, query.dtype, sliding_window), scaling)
    return out.flatten(2), key, value


def routed_moe(x: torch.Tensor, routing: torch.Tensor, router_weight: torch.Tensor, gate_proj: torch.Tensor,
               up_proj: torch.Tensor, down_proj: torch.Tensor, top_k: int, gate: str,
               biases: tuple | None = None) -> torch.Tensor:
    """SwiGLU experts ``[N, D] -> [N, D]`` mixed by ``routing`` ``[N, E]`` as one ``t2n_extra::moe_ffn`` node
    (``gdn_export/ops/moe_ffn/op.py``: its contract, the stacks' layout), whose torch kernel is ``dense_experts``.
    ``gate`` states how ``routing`` was computed from ``x @ router_weight.T``: ``"softmax_topk"``/``"softmax_all"``
    (``top_k_routing`` with and without renormalization) let the export use tract's sparse ``tract_moe_ffn``, and so
    does ``"grouped_sigmoid"`` (``grouped_sigmoid_routing`` with a positive scaling: the routing itself chooses the
    experts; its stacks come widened); any other name keeps the dense form, and so do ``biases`` (the experts'
    ``(gate_bias, up_bias, down_bias)``: tract's op has none)."""
    return moe_ffn(x, routing, router_weight, gate_proj, up_proj, down_proj, top_k, gate, biases)


def gated_attention(module: Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, apply_rotary,
                    past_key: torch.Tensor, past_value: torch.Tensor, mask) -> tuple:
    """Qwen3.5's ``*Attention`` with its output gate: per-head q/k norms, rotary, cache, sigmoid-gated ``o_proj``.

    ``module``: any module with transformers' attribute names (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``,
    ``q_norm``, ``k_norm``, ``head_dim``, ``scaling``): a transformers ``*Attention`` or ``models.mtp``'s.

    ``q_proj`` yields ``[q | gate]`` per head; ``mask(key, dtype)`` gives the additive mask over the extended key
    cache (``Context.mask``). Returns (output ``[B, S, D]``, key cache, value cache).
    """
    batch, seq = x.shape[:2]
    hidden_shape = (batch, seq, -1, module.head_dim)
    query, gate = torch.chunk(module.q_proj(x).view(batch, seq, -1, module.head_dim * 2), 2, dim=-1)
    gate = gate.reshape(batch, seq, -1)
    query = module.q_norm(query.reshape(hidden_shape)).transpose(1, 2)
    key = module.k_norm(module.k_proj(x).view(hidden_shape)).transpose(1, 2)
    value = module.v_proj(x).view(hidden_shape).transpose(1, 2)
    query, key = apply_rotary(query, key, cos, sin)
    key, value = extend_cache(past_key, key), extend_cache(past_value, value)
    out = attend(query, key, value, mask(key, query.dtype), module.scaling).reshape(batch, seq, -1)
    return module.o_proj(out * torch.sigmoid(gate)), key, value


def routed_experts(experts: Module, stacks: Any, flat: torch.Tensor, weights: torch.Tensor,
                   router_weight: torch.Tensor, top_k: int) -> torch.Tensor:
    """A transformers ``*Experts`` module (or one with its attribute names) on ``flat`` ``[N, D]``, mixed by the routing ``weights`` ``[N, E]``: one
    ``t2n_extra::moe_ffn`` node over its ``stacks``, which the export makes sparse where tract's ``tract_moe_ffn``
    computes the stacks' gate exactly (``gdn_export/ops/moe_ffn/op.py``). ``stacks``: ``gate_proj``, ``up_proj``,
    ``down_proj`` in ``moe_ffn``'s layout and its ``gate`` (``hf.blocks.ExpertStacks``, ``models.mtp.Experts``).

    Experts with another activation than SiLU (no ``stacks``) stay plain dense torch code (no MoE decision is
    reported for them).
    """
    if stacks is None:
        gate, up = experts.gate_up_proj.chunk(2, dim=1)
        return dense_experts(flat, weights, gate, up, experts.down_proj, experts.act_fn)
    return routed_moe(flat, weights, router_weight, stacks.gate_proj, stacks.up_proj, stacks.down_proj, top_k,
                      stacks.gate)


def sparse_moe(block: Module, stacks: Any, x: torch.Tensor, normalize_topk: bool) -> torch.Tensor:
    """transformers' Qwen ``*SparseMoeBlock`` (or a module with its attribute names): top-k softmax experts plus a shared expert scaled by a sigmoid gate.

    Reads only the block's weights: its own forward loops over the experts a batch happens to hit, which a
    trace would freeze. The routed experts are one ``moe_ffn`` node (sparse in tract where exact); the shared expert
    and its gate stay ordinary graph ops.
    """
    router = block.gate
    flat = x.reshape(-1, router.hidden_dim)
    weights = top_k_routing(F.linear(flat, router.weight), router.top_k, normalize_topk)
    routed = routed_experts(block.experts, stacks, flat, weights, router.weight, router.top_k)
    shared = torch.sigmoid(block.shared_expert_gate(flat)) * block.shared_expert(flat)
    return (routed + shared).view_as(x)
