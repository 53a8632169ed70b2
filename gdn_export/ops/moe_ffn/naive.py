"""The reference of ``t2n_extra::moe_ffn`` and of the routings its callers compute: plain torch, what the op runs
in torch (``dense_experts``) and what the families' routers compute (``top_k_routing``,
``grouped_sigmoid_routing``, ``grouped_softmax_routing``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def top_k_routing(router_logits: torch.Tensor, top_k: int, normalize: bool) -> torch.Tensor:
    """Dense routing weights ``[N, E]``: the top-k softmax probabilities (renormalized if asked), zeros elsewhere.

    The scatter names its axis as 1, not -1: torch_to_nnef passes the axis to tract's scatter_elements
    unnormalized, and tract 0.23 panics (index out of bounds) on a negative one.
    """
    probs = F.softmax(router_logits, dtype=torch.float, dim=-1)
    top_values, top_index = torch.topk(probs, top_k, dim=-1)
    if normalize:
        top_values = top_values / top_values.sum(dim=-1, keepdim=True)
    return torch.zeros_like(probs).scatter(1, top_index, top_values).to(router_logits.dtype)


def grouped_sigmoid_routing(router_logits: torch.Tensor, score_bias: torch.Tensor, *, top_k: int, groups: int,
                            top_groups: int, normalize: bool, scaling: float, score: str = "sigmoid",
                            group_score_k: int = 2) -> torch.Tensor:
    """DeepSeek-V3 routing (transformers' ``KimiLinearTopkRouter``) as dense weights ``[N, E]``, zero for unselected
    experts.

    Sigmoid scores plus the correction bias choose the experts: first the ``top_groups`` groups with the best
    top-2 sum, then the top k experts inside them; the chosen experts weigh their unbiased scores
    (renormalized if asked) times ``scaling``. Selection is topk, one-hot masks and where, so nothing data-dependent
    reaches Python. The topks are sorted (transformers' are not: torch_to_nnef exports only sorted topk; the
    chosen set, hence the scattered weights, is the same). The scatter names axis 1: tract 0.23 panics on
    torch_to_nnef's unnormalized axis -1. ``score="sqrtsoftplus"``: the scores are ``sqrt(softplus(logits))``
    instead (Megatron's ``moe_router_score_function``), the rest the same. ``group_score_k``: a group is scored by
    the sum of its top ``group_score_k`` (Megatron: ``topk // group_topk``; DeepSeek-V3 and transformers: 2).
    """
    if score == "sqrtsoftplus":
        scores = torch.sqrt(softplus(router_logits))
    else:
        # spelled with exp: tract's sigmoid bottoms out at ~4.5e-7 below x ~ -14.6, and renormalizing top-k scores
        # of that size would turn the floor into O(1) weight errors
        scores = 1.0 / (1.0 + torch.exp(-router_logits))
    top_index = _group_limited_top_k(scores + score_bias.float(), top_k, groups, top_groups, group_score_k)
    top_weights = scores.gather(1, top_index)
    if normalize:
        top_weights = top_weights / (top_weights.sum(dim=-1, keepdim=True) + 1e-20)
    return torch.zeros_like(scores).scatter(1, top_index, top_weights * scaling)


def softplus(x: torch.Tensor) -> torch.Tensor:
    """``log(1 + exp(x))`` within a few ulp of float32 over every x, in ops that export as they compute: NNEF's
    ``softplus`` (what torch_to_nnef emits for ``F.softplus``) is ``log(exp(x) + 1)``, infinite above x ~ 88 and 0
    below x ~ -17 where the value is ~exp(x); and ``log(1 + u)`` of a small u loses u's digits to the rounding of
    ``1 + u``. Here ``max(x, 0) + log1p(exp(-|x|))``, log1p spelled ``log(w) · u / (w - 1)`` with ``w = 1 + u``
    (exact to a few ulp; u itself where w rounds to 1)."""
    u = torch.exp(-torch.abs(x))
    w = 1.0 + u
    log1p = torch.where(w == 1.0, u, torch.log(w) * u / torch.where(w == 1.0, torch.ones_like(w), w - 1.0))
    return torch.clamp(x, min=0.0) + log1p


def grouped_softmax_routing(router_logits: torch.Tensor, *, top_k: int, groups: int, top_groups: int,
                            pre_softmax: bool, scaling: float, group_score_k: int = 2) -> torch.Tensor:
    """Megatron's softmax routing (``topk_routing_with_score_function``, score function ``softmax``) with expert
    groups and a scaling, as dense weights ``[N, E]``: the top k experts within the ``top_groups`` groups of best
    top-``group_score_k`` sum, chosen by the logits and weighted by the softmax over the chosen logits, or (``pre_softmax``) chosen
    by and weighted by the softmax over every expert; times ``scaling``."""
    logits = router_logits.float()
    if pre_softmax:
        scores = F.softmax(logits, dim=-1)
        top_index = _group_limited_top_k(scores, top_k, groups, top_groups, group_score_k)
        top_weights = scores.gather(1, top_index)
    else:
        top_index = _group_limited_top_k(logits, top_k, groups, top_groups, group_score_k)
        top_weights = F.softmax(logits.gather(1, top_index), dim=-1)
    return torch.zeros_like(logits).scatter(1, top_index, top_weights * scaling)


def _group_limited_top_k(choice: torch.Tensor, top_k: int, groups: int, top_groups: int,
                         group_score_k: int = 2) -> torch.Tensor:
    """The indices ``[N, top_k]`` of the top k of ``choice`` within the ``top_groups`` of ``groups`` equal groups of
    best top-``group_score_k`` sum (one group: every expert; the same ops then, so that a model's graph does not
    depend on it). DeepSeek-V3 scores a group by its top 2; Megatron's ``group_limited_topk`` by its top
    ``topk // group_topk``."""
    experts = choice.shape[-1]
    group_scores = choice.reshape(-1, groups, experts // groups).topk(group_score_k, dim=-1)[0].sum(dim=-1)  # [N, G]
    group_index = torch.topk(group_scores, k=top_groups, dim=-1)[1]
    # one-hot rows summed, not a scatter: tract panics on torch_to_nnef's scatter of a scalar source
    group_mask = (group_index[:, :, None] == torch.arange(groups)).sum(1)  # [N, G], 1 for a chosen group
    expert_mask = group_mask[:, :, None].expand(-1, groups, experts // groups).reshape(-1, experts)
    choice = torch.where(expert_mask > 0, choice, float("-inf"))
    return torch.topk(choice, k=top_k, dim=-1)[1]


def dense_experts(x: torch.Tensor, weights: torch.Tensor, gate_proj: torch.Tensor, up_proj: torch.Tensor,
                  down_proj: torch.Tensor, act, biases: tuple | None = None) -> torch.Tensor:
    """Every expert on every token, mixed by dense ``weights`` ``[N, E]`` (zero for unselected experts).

    x ``[N, D]``; gate_proj, up_proj ``[E, I, D]``; down_proj ``[E, D, I]``; the weights are cast to x's dtype
    before mixing, as transformers casts its routing scores. ``biases``: the experts' ``(gate_bias, up_bias,
    down_bias)`` ``[E, I]``, ``[E, I]``, ``[E, D]`` (Megatron's ``add_bias_linear``), each added to its linear's
    output, so that a token's share of expert e is ``weight · (down_e h + down_bias_e)``, as Megatron's expert MLP
    scales its ``linear_fc2`` bias by the routing probability.
    """
    gate, up = torch.einsum("nd,eid->nei", x, gate_proj), torch.einsum("nd,eid->nei", x, up_proj)
    if biases is not None:
        gate, up = gate + biases[0].to(gate.dtype), up + biases[1].to(up.dtype)
    expert_out = torch.einsum("nei,edi->ned", act(gate) * up, down_proj)  # [N, E, D]
    if biases is not None:
        expert_out = expert_out + biases[2].to(expert_out.dtype)
    return (expert_out * weights[..., None].to(expert_out.dtype)).sum(1)


def softmax_gate(normalize: bool) -> str:
    """The ``moe_ffn`` gate of ``top_k_routing(..., normalize)``."""
    return "softmax_topk" if normalize else "softmax_all"
