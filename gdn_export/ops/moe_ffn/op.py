"""``t2n_extra::moe_ffn``: a routed mixture-of-experts feed-forward (SwiGLU experts) as one torch custom op.

Contract::

    y = moe_ffn(x, routing, router_weight, gate_proj, up_proj, down_proj, top_k, gate[, gate_bias, up_bias,
                down_bias])
    x [N, D]                   tokens (model dtype)
    routing [N, E]             the routing weights the caller computed for x: zero for unselected experts
    router_weight [E, D]       the router (its logits are x @ router_weight.T)
    gate_proj, up_proj [E, I, D + W]   the experts' gate and up matrices (nn.Linear layout, tract's w1 and w3)
    down_proj [E, D + W, I]            their down matrices (tract's w2)
    gate_bias, up_bias [E, I], down_bias [E, D]   optional, all three or none: the experts' linear biases
                                                  (Megatron's add_bias_linear)
    y[n] = sum_e routing[n, e] * down_e @ (silu(gate_e x_n) * (up_e x_n))      (in x's dtype)
    with biases: sum_e routing[n, e] * (down_e @ (silu(gate_e x_n + gate_bias_e) * (up_e x_n + up_bias_e))
                                        + down_bias_e)

with gate_e, up_e, down_e the stacks' first D columns (rows for down_proj). ``W`` is 0, except for a given
routing (below), where it is E and the last E columns of gate_proj and up_proj and the last E rows of down_proj
are zero: the stacks come widened as tract's fused op needs them, so that the archive stores them as the op reads
them (a widening in the graph would not fold over a Q4_0 stack). The gate and up stacks are separate operands
(transformers fuses them into one ``gate_up_proj``) for the same reason: tract cannot slice a Q4_0 constant.

The torch kernel is the reference: ``naive.dense_experts`` (every expert on every token, mixed by
``routing``), the code the dense form always ran. ``gate`` says how ``routing`` was computed from the router, so
that tract's fused ``tract_moe_ffn`` can compute it again by itself:

- ``"softmax_topk"``: ``top_k_routing(x @ router_weight.T, top_k, normalize=True)`` (the top-k of the softmax,
  renormalized: Qwen with ``norm_topk_prob``), which is tract's ``gate = 'softmax_topk'`` (softmax over the
  top-k logits: the same numbers);
- ``"softmax_all"``: the same without renormalization, tract's ``gate = 'softmax_all'``;
- ``"grouped_sigmoid"`` (DeepSeek-V3's, Kimi Linear; ``naive.grouped_sigmoid_routing``): a routing none
  of tract's gate modes computes from the router, but whose ``routing`` rows are non-negative with at most
  ``top_k`` non-zero entries, exactly the chosen experts (a *given* routing, ``GIVEN_ROUTING_GATES``). Then the top
  k of ``routing`` itself are the chosen experts and its values their weights: tract's ``gate = 'raw'`` (the top-k
  logits, unchanged, as weights) computes the node if its router logits are ``routing``, which the export arranges
  by widening the token: ``[x | routing] @ [0 | I].T = routing`` exactly (products with 0 and 1, sums with 0), and
  the expert stacks carry E zero columns (w1, w3) and E zero output rows (w2): ``W = E`` above, so the experts see
  x unchanged and the first D outputs are y. Where a chosen weight is 0 (underflow) the tie among zeros may pick another expert, whose
  weight is 0 too: the same sum. Cost: E / D more expert work than the plain op;
- anything else names a routing the node cannot vouch for: only ``routing`` says which experts a token takes, and
  the node stays dense.

The NNEF emission (``gdn_export/ops/moe_ffn/nnef.py``: ops import no export code) decides per node and records
the decision with its reason on the target like the gated delta rule's: ``tract_moe_ffn`` where it computes exactly
this function (``decide``), else ``dense``: the experts as two matmuls over the whole stacks, mixed by ``routing``.
A node with expert biases is always dense (``BIASED_EXPERTS``): ``tract_moe_ffn`` has no bias input, and while
``down_bias``'s share is ``routing @ down_bias`` outside any op, ``gate_bias`` and ``up_bias`` sit inside SwiGLU.
With a softmax gate ``routing`` is unused (the fused op reads the router's weight itself): its few ops stay in
graph.nnef and tract drops them at load (tract_quirks.MOE_UNUSED_ROUTING_DROPPED); a given routing is the op's
router input.

Measured on tract 0.23.9 (``tests/test_moe.py``, docs/TRACT.md): ``tract_moe_ffn(x, wg, w1, w2, w3, k, activation
= 'silu', gate, expert_layout = 'linear')`` with w1/w3 ``[E, I, D]`` and w2 ``[E, D, I]`` (nn.Linear layout: the
operands as they are, f32, f16 or Q4_0 variables) computes
``sum over the top k of x @ wg.T of weight * w2_e @ (silu(w1_e x) * w3_e x)``, x ``[N, D]`` or ``[B, S, D]``, f32 or
f16 (output in x's dtype), routing and mixing in f32; on exactly tied logits it takes the lowest expert index.
``gate = 'raw'`` weighs the chosen experts by their logits as they are; the output's width must be x's (hence the
zero output rows of the given-routing form). With the three stacks in Q4_0 it runs its Q4_0 kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gdn_export.errors import OperandError
from gdn_export.ops.moe_ffn.naive import dense_experts
from gdn_export.ops.registration import define_or_reuse

QUALNAME = "t2n_extra::moe_ffn"
SCHEMA = ("(Tensor x, Tensor routing, Tensor router_weight, Tensor gate_proj, Tensor up_proj, Tensor down_proj, "
          "int top_k, str gate, Tensor? gate_bias=None, Tensor? up_bias=None, Tensor? down_bias=None) -> Tensor")

OP_NAME = "tract_moe_ffn"
# caller's gate -> tract_moe_ffn's gate mode computing the same routing
TRACT_GATES = {"softmax_topk": "softmax_topk", "softmax_all": "softmax_all"}
# routings whose weights the graph computes (``routing``: non-negative, at most top_k non-zero per row), and what
# they are; tract_moe_ffn runs them with gate = 'raw' over [x | routing] (module docstring)
GIVEN_ROUTING_GATES = {
    "grouped_sigmoid": "DeepSeek-V3 routing (sigmoid scores, biased choice in the top groups, a positive scaling)",
    "grouped_sqrtsoftplus": "Megatron's sqrtsoftplus routing (sqrt(softplus) scores, biased choice in the top "
                            "groups, a positive scaling)",
    "grouped_softmax": "Megatron's softmax routing with expert groups or a positive scaling",
}
# routings the export cannot make sparse, and why
UNSUPPORTED_GATES = {
    "grouped_sigmoid_signed": "DeepSeek-V3 routing with a routed scaling factor <= 0 (negative or zero weights: the "
                              "top k of the routing would not be the chosen experts)",
    "grouped_softmax_signed": "Megatron's softmax routing times a negative moe_router_topk_scaling_factor (negative "
                              "weights: the top k of the routing would not be the chosen experts)",
}
# why a node with expert biases stays dense
BIASED_EXPERTS = ("expert biases (add_bias_linear): tract_moe_ffn has no bias inputs, and a bias inside SwiGLU "
                  "(gate_bias, up_bias) cannot be moved outside the op")
# measured exact on this version (tests/test_moe.py); earlier versions were not checked
FIRST_VERSION = (0, 23, 9)


@dataclass(frozen=True)
class MoeNode:
    """One ``moe_ffn`` node as ``decide`` sees it (``ops.protocol.Node``): its routing ``gate``, and the experts it
    runs (``top_k`` of ``experts``; None before tracing, where only the lowering is asked for)."""

    name: str
    gate: str
    top_k: int | None = None
    experts: int | None = None
    entry: str = QUALNAME
    biased: bool = False  # the experts' gate_bias, up_bias and down_bias are given


def widening(gate: str, experts: int) -> int:
    """``W``: the zero columns (rows of down_proj) the stacks of a ``gate`` node carry."""
    return experts if gate in GIVEN_ROUTING_GATES else 0


def check_moe_operands(x_shape, routing_shape, router_shape, gate_shape, up_shape, down_shape, top_k: int,
                       gate: str, bias_shapes: tuple | None = None) -> tuple:
    """(N, D, E, I) of consistent operands (``bias_shapes``: those of gate_bias, up_bias, down_bias, each None when
    absent); OperandError names the first that disagrees."""
    x_shape, routing_shape, router_shape, gate_shape, up_shape, down_shape = (
        tuple(int(d) for d in s) for s in (x_shape, routing_shape, router_shape, gate_shape, up_shape, down_shape))
    if len(x_shape) != 2:
        raise OperandError("x", "rank 2 [N, D]", f"rank {len(x_shape)} {list(x_shape)}")
    tokens, width = x_shape
    if len(gate_shape) != 3:
        raise OperandError("gate_proj", "[E, I, D + W]", str(list(gate_shape)))
    experts, inner = gate_shape[:2]
    wide = width + widening(gate, experts)
    if gate_shape[2] != wide:
        raise OperandError("gate_proj", f"[E, I, D + W] with D + W = {wide} (gate {gate!r})", str(list(gate_shape)))
    if up_shape != gate_shape:
        raise OperandError("up_proj", f"gate_proj's shape {list(gate_shape)}", str(list(up_shape)))
    if down_shape != (experts, wide, inner):
        raise OperandError("down_proj", f"[E, D + W, I] = {[experts, wide, inner]}", str(list(down_shape)))
    if router_shape != (experts, width):
        raise OperandError("router_weight", f"[E, D] = {[experts, width]}", str(list(router_shape)))
    if routing_shape != (tokens, experts):
        raise OperandError("routing", f"[N, E] = {[tokens, experts]}", str(list(routing_shape)))
    if not 1 <= top_k <= experts:
        raise OperandError("top_k", f"1 <= top_k <= E = {experts}", str(top_k))
    given = [shape is not None for shape in bias_shapes or ()]
    if any(given) and not all(given):
        raise OperandError("gate_bias, up_bias, down_bias", "all three or none",
                           ", ".join(n for n, g in zip(("gate_bias", "up_bias", "down_bias"), given) if g) + " only")
    if all(given) and given:
        for name, shape, want in zip(("gate_bias", "up_bias", "down_bias"), bias_shapes,
                                     ((experts, inner), (experts, inner), (experts, width))):
            if tuple(int(d) for d in shape) != want:
                raise OperandError(name, str(list(want)), str(list(shape)))
    return tokens, width, experts, inner


def _bias_shapes(*biases) -> tuple:
    return tuple(None if b is None else b.shape for b in biases)


def _reference(x, routing, router_weight, gate_proj, up_proj, down_proj, top_k, gate, gate_bias=None, up_bias=None,
               down_bias=None):
    tokens, width, _, _ = check_moe_operands(x.shape, routing.shape, router_weight.shape, gate_proj.shape,
                                             up_proj.shape, down_proj.shape, top_k, gate,
                                             _bias_shapes(gate_bias, up_bias, down_bias))
    biases = None if gate_bias is None else (gate_bias, up_bias, down_bias)
    return dense_experts(x, routing, gate_proj[..., :width], up_proj[..., :width], down_proj[:, :width],
                         F.silu, biases).contiguous()


def _fake(x, routing, router_weight, gate_proj, up_proj, down_proj, top_k, gate, gate_bias=None, up_bias=None,
          down_bias=None):
    return torch.empty_like(x)


define_or_reuse(QUALNAME, SCHEMA, _reference, _fake)


def moe_ffn(x: torch.Tensor, routing: torch.Tensor, router_weight: torch.Tensor, gate_proj: torch.Tensor,
            up_proj: torch.Tensor, down_proj: torch.Tensor, top_k: int, gate: str,
            biases: tuple | None = None) -> torch.Tensor:
    """Call ``torch.ops.t2n_extra.moe_ffn`` (see the module docstring for the contract); ``biases``: the experts'
    ``(gate_bias, up_bias, down_bias)`` or None."""
    if biases is None:
        return torch.ops.t2n_extra.moe_ffn(x, routing, router_weight, gate_proj, up_proj, down_proj, top_k, gate)
    return torch.ops.t2n_extra.moe_ffn(x, routing, router_weight, gate_proj, up_proj, down_proj, top_k, gate,
                                       *biases)


def moe_report(decisions) -> list[str]:
    """One line per distinct MoE decision of an export (its ``Decision`` list), with how many feed-forwards got it:
    ``moe (2 feed-forwards): tract_moe_ffn - <reason>``."""
    counts: dict[tuple[str, str], int] = {}
    for d in decisions:
        if d.entry == QUALNAME:
            counts[d.lowering, d.reason] = counts.get((d.lowering, d.reason), 0) + 1
    return [f"moe ({n} feed-forward{'s' if n > 1 else ''}): {lowering} - {reason}"
            for (lowering, reason), n in counts.items()]
