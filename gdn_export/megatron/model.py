"""Megatron-core hybrid models in plain torch, on the project's ops, with explicit states.

A Megatron hybrid stack (``megatron/core/models/hybrid/hybrid_block.py``) is a list of single-purpose layers named
by the pattern's symbols; each has a pre-norm and a residual:

| symbol | Megatron layer | here |
|---|---|---|
| ``G`` | ``TransformerLayer`` + ``ssm.gated_delta_net.GatedDeltaNet`` | ``GatedDeltaNetMixer`` |
| ``G`` with ``experimental_attention_variant='gdn2'`` | ``TransformerLayer`` + ``GatedDeltaNet2`` | ``GatedDeltaNet2Mixer`` |
| ``M`` (a ``GatedDeltaProductMixer`` spec) | ``MambaLayer`` + ``ssm.gated_delta_product.GatedDeltaProductMixer`` | ``GatedDeltaProductMixer`` |
| ``M`` (a ``MambaMixer`` spec: it has ``D``) | ``MambaLayer`` + ``ssm.mamba_mixer.MambaMixer`` (Mamba2) | ``Mamba2Mixer`` |
| ``*`` | ``TransformerLayer`` + ``SelfAttention`` (GQA, rotary) | ``gdn_export.layers.Attention``; ``MegatronAttention`` with an output gate, partial rotary or ``kv_channels`` != hidden / heads |
| ``-`` | ``MLPLayer`` + ``MLP`` (SwiGLU or squared ReLU) | ``MegatronMLP`` |
| ``E`` | ``MoETransformerLayer`` + ``MoELayer`` (top-k softmax router, SwiGLU experts, gated shared expert) | ``MegatronMoE`` |

The project's decoder loop runs blocks of one mixer followed by the MLP layers after it (``Block``); each block is
one "layer" of the export (its states are ``conv_<i>``/``state_<i>`` or ``key_<i>``/``value_<i>``, i the block).
MLP / MoE layers before the first mixer (a pattern that starts with ``-`` or ``E``) hold no state: they run on the
embeddings, before the first block (``model.lead_norms``, ``model.lead_mlps``).

Every norm Megatron builds from its config (the pre-norms, ``q_layernorm`` / ``k_layernorm``, GDN's ``out_norm``,
the final norm) is its ``normalization``: RMSNorm or LayerNorm (``megatron_norm``); with ``add_bias_linear`` the
attention's ``linear_qkv`` / ``linear_proj`` and the MLP's ``linear_fc1`` / ``linear_fc2`` have biases (Megatron's
GDN and GDP build their projections without, whatever the flag).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from gdn_export.layers.attention import Attention, rotate_half
from gdn_export.layers.common import (LayerNorm, RMSNorm, ShortConvolution, decay_parameters, rms_normalize,
                                      split_heads)
from gdn_export.layers.lm import FlaForCausalLM, LMConfig
from gdn_export.models import blocks
from gdn_export.models.blocks import (dense_experts, gated_delta_mixer, gdn_decay, grouped_sigmoid_routing,
                                      grouped_softmax_routing,
                                      identity_steps, per_head_decay, routed_moe, short_conv, softmax_gate,
                                      top_k_routing)
from gdn_export.models.state import StateSpec, conv_state, delta_states, recurrent_state
from gdn_export.ops.gated_delta_rule.op import gated_delta_rule

MIXER_NAMES = {"gdn": "GatedDeltaNet", "gdn2": "GatedDeltaNet2", "gdp": "GatedDeltaProductMixer",
               "mamba2": "MambaMixer (Mamba2)", "attention": "SelfAttention"}


@dataclass
class MegatronConfig(LMConfig):
    """The model's arguments as read from the checkpoint (``gdn_export.megatron.args``)."""

    pattern: str = ""  # the main pattern, one symbol per Megatron layer
    blocks: list = field(default_factory=list)  # per block: (mixer kind, Megatron index, [MLP Megatron indices])
    num_attention_heads: int = 0
    num_query_groups: int = 0
    kv_channels: int = 0
    qk_layernorm: bool = False
    add_qkv_bias: bool = False
    rotary_base: float = 10000.0
    ffn_hidden_size: int = 0
    mlp_activation: str = "swiglu"  # or "squared_relu"
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    mamba_state_dim: int = 0
    mamba_head_dim: int = 0
    mamba_num_groups: int = 0
    mamba_num_heads: int = 0
    gdp_num_householder: int = 1
    gdp_conv_kernel_dim: int = 4  # the 'M' layers' conv width (GDP's or Mamba2's), read from the checkpoint
    attention_output_gate: bool = False
    rotary_dim: int = 0  # channels of a head that rotary turns (Megatron's int(kv_channels * rotary_percent))
    # Megatron's rotary_interleaved (a GPTModel's): pairs of adjacent channels turn; read as NeoX halves over q/k rows
    # reordered per head (megatron.family.head_channel_order), which leaves every q·k product as it was
    rotary_interleaved: bool = False
    moe_layers: list = field(default_factory=list)  # Megatron indices of the 'E' layers (among the blocks' MLPs)
    num_experts: int = 0
    moe_ffn_hidden_size: int = 0
    moe_router_topk: int = 1
    moe_router_pre_softmax: bool = False  # softmax over all experts, then top-k (no renormalization)
    moe_router_score_function: str = "softmax"  # or "sigmoid" (DeepSeek-V3's routing, below) or "sqrtsoftplus"
    moe_router_expert_bias: bool = False  # sigmoid: a bias added to the scores for the choice only
    moe_router_scaling: float = 1.0  # sigmoid: the chosen (renormalized) scores times this
    moe_router_num_groups: int = 1  # sigmoid: experts in groups, the top group_topk groups chosen first
    moe_router_group_topk: int = 1
    moe_shared_expert_size: int = 0
    moe_shared_expert_gate: bool = False
    normalization: str = "RMSNorm"  # or "LayerNorm" (every norm Megatron builds from its config)
    add_bias_linear: bool = False  # biases in linear_qkv, linear_proj, linear_fc1, linear_fc2
    lead_mlps: list = field(default_factory=list)  # Megatron indices of the MLP / MoE layers before the first mixer


def megatron_norm(config: MegatronConfig, width: int) -> nn.Module:
    """A norm Megatron builds from its config (``TENorm`` / ``WrappedTorchNorm`` / ``FusedLayerNorm``): its
    ``normalization``, ``layernorm_epsilon``; a zero-centred weight is read as ``1 + w`` (``megatron.family``)."""
    if config.normalization == "LayerNorm":
        return LayerNorm(width, eps=config.norm_eps)
    return RMSNorm(width, eps=config.norm_eps)


def _linear(inputs: int, outputs: int) -> nn.Linear:
    return nn.Linear(inputs, outputs, bias=False)


class _DeltaMixer(nn.Module):
    """What the three Megatron delta-rule mixers share: one conv cache and one recurrent state."""

    conv: ShortConvolution
    heads: int
    width_k: int
    width_v: int

    def state_specs(self, layer: int, dtype: torch.dtype) -> list[StateSpec]:
        return delta_states(layer, self.conv.hidden_size, self.conv.kernel_size, self.heads, self.width_k,
                            self.width_v, dtype)

    def forward_states(self, x, states, context=None):
        out, conv, state = self(x, states[0], states[1], None if context is None else context.rows)
        return out, [conv, state]


class _GatedNormOut(nn.Module):
    """``out_norm`` (RMSNorm over a value head) times ``silu(z)``, then ``out_proj`` (``_GDNBase._apply_gated_norm``)."""

    def __init__(self, config: MegatronConfig, width_v: int, value_dim: int) -> None:
        super().__init__()
        self.out_norm = megatron_norm(config, width_v)
        self.out_proj = _linear(value_dim, config.hidden_size)

    def project_out(self, core: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        y = self.out_norm(core) * F.silu(split_heads(z, core.shape[-1]).float())
        return self.out_proj(y.to(core.dtype).flatten(-2))


class _GDNBase(_DeltaMixer, _GatedNormOut):
    """What Megatron's ``_GDNBase`` gives both GDN variants: the split ``in_proj`` (``sections``), the conv over
    ``[q|k|v]``, ``A_log``/``dt_bias`` of the variant's sizes, and the gated output norm."""

    def __init__(self, config: MegatronConfig, a_log_size: int, dt_bias_size: int) -> None:
        c = config
        value_dim = c.linear_num_value_heads * c.linear_value_head_dim
        _GatedNormOut.__init__(self, c, c.linear_value_head_dim, value_dim)
        self.heads, self.key_heads = c.linear_num_value_heads, c.linear_num_key_heads
        self.width_k, self.width_v = c.linear_key_head_dim, c.linear_value_head_dim
        self.in_proj = nn.ModuleDict({name: _linear(c.hidden_size, size) for name, size in self.sections(c)})
        self.conv = ShortConvolution(2 * self.key_heads * self.width_k + value_dim, c.linear_conv_kernel_dim)
        self.A_log, self.dt_bias = decay_parameters(a_log_size, dt_bias_size, 1.0, 16.0)

    @staticmethod
    def sections(c: MegatronConfig) -> list[tuple[str, int]]:
        raise NotImplementedError


class GatedDeltaNetMixer(_GDNBase):
    """Megatron's ``GatedDeltaNet``: ``in_proj`` = ``[query, key, value, z, beta, alpha]``, one conv over
    ``[q|k|v]``, ``g = -exp(A_log)·softplus(alpha + dt_bias)`` per value head, ``β = σ(beta)``, q/k L2-normalized."""

    def __init__(self, config: MegatronConfig) -> None:
        super().__init__(config, config.linear_num_value_heads, config.linear_num_value_heads)

    @staticmethod
    def sections(c: MegatronConfig) -> list[tuple[str, int]]:
        key_dim, value_dim = c.linear_num_key_heads * c.linear_key_head_dim, c.linear_num_value_heads * c.linear_value_head_dim
        return [("query", key_dim), ("key", key_dim), ("value", value_dim), ("z", value_dim),
                ("beta", c.linear_num_value_heads), ("alpha", c.linear_num_value_heads)]

    def forward(self, x, conv_state_, state, rows=None):
        p = {name: linear(x) for name, linear in self.in_proj.items()}
        mixed = torch.cat([p["query"], p["key"], p["value"]], dim=-1)
        g = gdn_decay(p["alpha"], self.A_log, self.dt_bias)
        core, conv_state_, state = gated_delta_mixer(mixed, self.conv.weight.squeeze(1), conv_state_, state, g,
                                                     p["beta"].sigmoid(), key_heads=self.key_heads, heads=self.heads,
                                                     width_k=self.width_k, width_v=self.width_v, rows=rows)
        return self.project_out(core, p["z"]), conv_state_, state


class GatedDeltaNet2Mixer(_GDNBase):
    """Megatron's ``GatedDeltaNet2``: ``in_proj`` = ``[query, key, value, z, f, b, w]`` (full rank), per-channel
    decay ``g = -exp(A_log[key head])·softplus(f + dt_bias)``, erase ``σ(b)`` on K, write ``σ(w)`` on V."""

    def __init__(self, config: MegatronConfig) -> None:
        super().__init__(config, config.linear_num_key_heads, config.linear_num_key_heads * config.linear_key_head_dim)

    @staticmethod
    def sections(c: MegatronConfig) -> list[tuple[str, int]]:
        key_dim, value_dim = c.linear_num_key_heads * c.linear_key_head_dim, c.linear_num_value_heads * c.linear_value_head_dim
        return [("query", key_dim), ("key", key_dim), ("value", value_dim), ("z", value_dim), ("f", key_dim),
                ("b", key_dim), ("w", value_dim)]

    def forward(self, x, conv_state_, state, rows=None):
        p = {name: linear(x) for name, linear in self.in_proj.items()}
        mixed = torch.cat([p["query"], p["key"], p["value"]], dim=-1)
        convolved, conv_state_ = short_conv(mixed.transpose(1, 2), self.conv.weight.squeeze(1), conv_state_, rows)
        q, k, v = torch.split(convolved.transpose(1, 2), [self.key_heads * self.width_k] * 2 + [self.heads * self.width_v], -1)
        g = per_head_decay(split_heads(p["f"], self.width_k), self.A_log, self.dt_bias)
        erase = split_heads(p["b"].sigmoid(), self.width_k)
        write = split_heads(p["w"].sigmoid(), self.width_v)
        groups = self.heads // self.key_heads
        if groups > 1:  # the op repeats q and k itself; the K-side gates live on the value heads
            g, erase = g.repeat_interleave(groups, dim=2), erase.repeat_interleave(groups, dim=2)
        g, erase, write = identity_steps(rows, g, erase, write)
        core, state = gated_delta_rule(split_heads(q, self.width_k), split_heads(k, self.width_k),
                                       split_heads(v, self.width_v), g, None, state, erase=erase, write=write,
                                       use_qk_l2norm=True)
        return self.project_out(core, p["z"]), conv_state_, state


class GatedDeltaProductMixer(_DeltaMixer):
    """Megatron's ``GatedDeltaProductMixer``: ``in_proj`` = ``[z, V0..Vn-1, K0..Kn-1, Q, b0..bn-1, a]``, one conv over
    ``[V.., K.., Q]``, n Householder sub-steps per token (sub-step j of token t at t·n + j), ``β = σ(b)``,
    ``g = -exp(A_log)·softplus(a + dt_bias)`` per head, then mamba_ssm's gated RMSNorm with ``norm_before_gate=False``
    over groups of ``d_inner / ngroups`` channels: ``rmsnorm(y ⊙ silu(z)) ⊙ weight``."""

    def __init__(self, config: MegatronConfig) -> None:
        super().__init__()
        c = config
        self.n, self.heads, self.groups = c.gdp_num_householder, c.mamba_num_heads, c.mamba_num_groups
        self.width_k, self.width_v = c.mamba_state_dim, c.mamba_head_dim
        self.d_inner = self.heads * self.width_v
        self.in_proj = nn.ModuleDict({name: _linear(c.hidden_size, size) for name, size in self.sections(c)})
        self.conv = ShortConvolution(self.n * self.d_inner + (self.n + 1) * self.groups * self.width_k,
                                     c.gdp_conv_kernel_dim)
        self.A_log, self.dt_bias = decay_parameters(self.heads, self.heads, 0.0, 16.0)
        self.norm = nn.Parameter(torch.ones(self.d_inner))
        self.out_proj = _linear(self.d_inner, c.hidden_size)

    @staticmethod
    def sections(c: MegatronConfig) -> list[tuple[str, int]]:
        n, d_inner, group_state = c.gdp_num_householder, c.mamba_num_heads * c.mamba_head_dim, c.mamba_num_groups * c.mamba_state_dim
        return ([("z", d_inner)] + [(f"V{i}", d_inner) for i in range(n)] + [(f"K{i}", group_state) for i in range(n)]
                + [("Q", group_state)] + [(f"b{i}", c.mamba_num_heads) for i in range(n)] + [("a", c.mamba_num_heads)])

    def forward(self, x, conv_state_, state, rows=None):
        p = {name: linear(x) for name, linear in self.in_proj.items()}
        n = self.n
        mixed = torch.cat([p[f"V{i}"] for i in range(n)] + [p[f"K{i}"] for i in range(n)] + [p["Q"]], dim=-1)
        convolved, conv_state_ = short_conv(mixed.transpose(1, 2), self.conv.weight.squeeze(1), conv_state_, rows)
        group_state = self.groups * self.width_k
        v, k, q = torch.split(convolved.transpose(1, 2), [n * self.d_inner, n * group_state, group_state], -1)
        batch = x.shape[0]
        # 'b l (m h p) -> b (l m) h p': a row-major reshape, a token's sub-steps stay adjacent
        v = v.reshape(batch, -1, self.heads, self.width_v)
        k = k.reshape(batch, -1, self.groups, self.width_k)
        q = split_heads(q, self.width_k)
        beta = torch.cat([p[f"b{i}"] for i in range(n)], dim=-1).sigmoid()  # [B, S, n·H], (m h) order
        g, beta = identity_steps(rows, gdn_decay(p["a"], self.A_log, self.dt_bias), beta)
        core, state = gated_delta_rule(q, k, v, g, beta.reshape(batch, -1, self.heads), state,
                                       num_householder=n, use_qk_l2norm=True)
        return self.out_proj(gated_group_norm(core, p["z"], self.groups, self.norm).to(x.dtype)), conv_state_, state

    def state_specs(self, layer: int, dtype: torch.dtype) -> list[StateSpec]:
        return [conv_state(f"conv_{layer}", layer, self.conv.hidden_size, self.conv.kernel_size, dtype),
                recurrent_state(layer, self.heads, self.width_k, self.width_v)]


def gated_group_norm(core: torch.Tensor, z: torch.Tensor, groups: int, weight: torch.Tensor) -> torch.Tensor:
    """mamba_ssm's gated ``RMSNorm`` with ``norm_before_gate=False`` (GDP's and Mamba2's output norm), f32:
    ``rmsnorm(y ⊙ silu(z)) ⊙ weight`` over ``groups`` groups of channels (``d_inner / ngroups`` each, eps 1e-5);
    core ``[B, S, H, V]``, z ``[B, S, H·V]``."""
    y = core.flatten(-2).float() * F.silu(z.float())
    return rms_normalize(y.reshape(*y.shape[:-1], groups, -1), 1e-5).flatten(-2) * weight.float()


class Mamba2Mixer(_DeltaMixer):
    """Megatron's ``MambaMixer`` (Mamba2): ``in_proj`` = ``[z, x, B, C, dt]``, a conv with bias over ``[x|B|C]`` (then
    SiLU), ``dt = softplus(dt + dt_bias)``, per head ``h_t = exp(dt·A) h_{t-1} + dt · B_t ⊗ x_t`` and ``y_t = C_t ·
    h_t + D · x_t`` (``A = -exp(A_log)``; B, C shared by the heads of a group), then mamba_ssm's gated RMSNorm as
    GDP's. The recurrence is the gated delta rule with nothing erased: decay ``g = dt·A``, erase 0, write ``dt`` on
    every value channel, k = B, v = x, q = C at scale 1; the ``D`` skip is added after it."""

    def __init__(self, config: MegatronConfig) -> None:
        super().__init__()
        c = config
        self.heads, self.groups = c.mamba_num_heads, c.mamba_num_groups
        self.width_k, self.width_v = c.mamba_state_dim, c.mamba_head_dim
        self.d_inner = self.heads * self.width_v
        self.in_proj = nn.ModuleDict({name: _linear(c.hidden_size, size) for name, size in self.sections(c)})
        self.conv = ShortConvolution(self.d_inner + 2 * self.groups * self.width_k, c.gdp_conv_kernel_dim)
        self.conv_bias = nn.Parameter(torch.zeros(self.conv.hidden_size))
        self.A_log, self.dt_bias = decay_parameters(self.heads, self.heads, 1.0, 16.0)
        self.D = nn.Parameter(torch.ones(self.heads))
        self.norm = nn.Parameter(torch.ones(self.d_inner))
        self.out_proj = _linear(self.d_inner, c.hidden_size)

    @staticmethod
    def sections(c: MegatronConfig) -> list[tuple[str, int]]:
        d_inner, group_state = c.mamba_num_heads * c.mamba_head_dim, c.mamba_num_groups * c.mamba_state_dim
        return [("z", d_inner), ("x", d_inner), ("B", group_state), ("C", group_state), ("dt", c.mamba_num_heads)]

    def forward(self, x, conv_state_, state, rows=None):
        p = {name: linear(x) for name, linear in self.in_proj.items()}
        mixed = torch.cat([p["x"], p["B"], p["C"]], dim=-1)
        convolved, conv_state_ = short_conv(mixed.transpose(1, 2), self.conv.weight.squeeze(1), conv_state_, rows,
                                            self.conv_bias)
        group_state = self.groups * self.width_k
        values, keys, queries = torch.split(convolved.transpose(1, 2), [self.d_inner, group_state, group_state], -1)
        values, keys, queries = (split_heads(t, w) for t, w in ((values, self.width_v), (keys, self.width_k),
                                                                 (queries, self.width_k)))
        dt = F.softplus(p["dt"].float() + self.dt_bias.float())  # [B, S, H]
        g = -self.A_log.float().exp() * dt
        write = dt[..., None].expand(*dt.shape, self.width_v)
        erase = torch.zeros_like(keys[:, :, :1].float()).expand(*dt.shape, self.width_k)
        g, erase, write = identity_steps(rows, g, erase, write)
        core, state = gated_delta_rule(queries, keys, values, g, None, state, erase=erase, write=write, scale=1.0)
        core = core.float() + self.D.float()[:, None] * values.float()
        return self.out_proj(gated_group_norm(core, p["z"], self.groups, self.norm).to(x.dtype)), conv_state_, state


class MegatronMLP(nn.Module):
    """Megatron's ``MLP``: SwiGLU (``linear_fc1`` = ``[gate; up]``) or squared ReLU, with biases when ``bias``
    (``add_bias_linear``)."""

    def __init__(self, hidden: int, ffn: int, activation: str, bias: bool = False) -> None:
        super().__init__()
        self.activation = activation
        if activation == "swiglu":
            self.gate_proj = nn.Linear(hidden, ffn, bias=bias)
        self.up_proj = nn.Linear(hidden, ffn, bias=bias)
        self.down_proj = nn.Linear(ffn, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.activation == "swiglu":
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return self.down_proj(F.relu(self.up_proj(x)).square())


class MegatronExperts(nn.Module):
    """A ``MoELayer``'s routed SwiGLU experts as stacks, in the layout of transformers' ``*Experts`` that the
    project's sparse MoE path takes (``hf.blocks.ExpertStacks``): ``gate_up_proj`` ``[E, 2I, D]`` (each expert's
    ``linear_fc1`` = ``[gate; up]``), ``down_proj`` ``[E, D, I]`` (its ``linear_fc2``); with ``bias``
    (``add_bias_linear``) their biases ``gate_up_bias`` ``[E, 2I]`` and ``down_bias`` ``[E, D]``."""

    def __init__(self, experts: int, hidden: int, ffn: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * ffn, hidden))
        self.down_proj = nn.Parameter(torch.empty(experts, hidden, ffn))
        if bias:
            self.gate_up_bias = nn.Parameter(torch.empty(experts, 2 * ffn))
            self.down_bias = nn.Parameter(torch.empty(experts, hidden))
        self.act_fn = nn.SiLU()

    def biases(self) -> tuple | None:
        """``moe_ffn``'s ``(gate_bias, up_bias, down_bias)``, None without biases."""
        if not hasattr(self, "gate_up_bias"):
            return None
        gate, up = self.gate_up_bias.chunk(2, dim=1)
        return gate, up, self.down_bias


class MegatronMoE(nn.Module):
    """Megatron's ``MoELayer``: ``TopKRouter`` (``topk_routing_with_score_function``), the routed experts mixed by its
    weights, plus the shared expert, scaled by ``sigmoid(x @ gate_weight)`` when it has a gate
    (``SharedExpertMLP``). Softmax scores: ``moe_router_pre_softmax``, top-k of the softmax over every expert;
    otherwise the softmax over the top-k logits (the top-k probabilities renormalized). Sigmoid scores: the experts
    chosen by score + ``expert_bias`` (within the ``group_topk`` best of ``num_groups`` groups, a group scored by its
    top-``topk / group_topk`` sum), weighted by their unbiased scores, renormalized when top-k > 1, times
    ``moe_router_topk_scaling_factor``: DeepSeek-V3's routing (``models.blocks.grouped_sigmoid_routing``); sqrtsoftplus
    scores (``sqrt(softplus(logits))``) the same way. Softmax scores with groups or a scaling: the same choice over
    the logits (or, ``moe_router_pre_softmax``, the softmax over every expert), the softmax weights times the
    scaling (``grouped_softmax_routing``). Every routing but plain softmax is computed in the graph and handed to
    tract's sparse ``tract_moe_ffn`` as a given routing (``ops/moe_ffn/op.py``). With ``add_bias_linear`` the
    router's logits have a bias (so plain softmax routing too is computed in the graph: tract's softmax gates read
    the router's weight alone) and each routed expert's ``linear_fc1`` / ``linear_fc2`` theirs, the expert's output
    ``p · (linear_fc2(swiglu(linear_fc1(x))))`` with its bias inside, as Megatron's expert ``MLP`` scales its
    ``linear_fc2`` bias by the routing probability (``per_token_scale``); the MoE node then stays dense."""

    def __init__(self, config: MegatronConfig) -> None:
        super().__init__()
        c = config
        self.top_k, self.normalize = c.moe_router_topk, not c.moe_router_pre_softmax
        self.score, self.scaling = c.moe_router_score_function, c.moe_router_scaling
        self.sigmoid = self.score in ("sigmoid", "sqrtsoftplus")
        self.groups, self.top_groups = c.moe_router_num_groups, c.moe_router_group_topk
        # Megatron's group_limited_topk scores a group by the sum of its top topk // group_topk scores
        self.group_score_k = self.top_k // self.top_groups
        self.plain_softmax = (not self.sigmoid and self.groups == 1 and self.scaling == 1.0
                              and not c.add_bias_linear)
        self.router = nn.Linear(c.hidden_size, c.num_experts, bias=c.add_bias_linear)
        if c.moe_router_expert_bias:
            self.expert_bias = nn.Parameter(torch.zeros(c.num_experts))
        self.experts = MegatronExperts(c.num_experts, c.hidden_size, c.moe_ffn_hidden_size, c.add_bias_linear)
        if c.moe_shared_expert_size:
            self.shared_expert = MegatronMLP(c.hidden_size, c.moe_shared_expert_size, "swiglu")
            if c.moe_shared_expert_gate:
                self.shared_expert_gate = _linear(c.hidden_size, 1)
        self.stacks = None  # the moe_ffn stacks, set (unregistered) by the exportable model (family.MegatronLM)

    @property
    def gate(self) -> str:
        if self.sigmoid:  # the weights choose the experts exactly when the scaling is positive (kimi_linear's rule)
            return f"grouped_{self.score}" if self.scaling > 0 else "grouped_sigmoid_signed"
        if self.plain_softmax:
            return softmax_gate(self.normalize)
        # Megatron scales by any non-zero factor (a zero one is none: family._moe_config reads it as 1)
        return "grouped_softmax" if self.scaling > 0 else "grouped_softmax_signed"

    def routing(self, flat: torch.Tensor) -> torch.Tensor:
        logits = self.router(flat)
        if self.plain_softmax:
            return top_k_routing(logits, self.top_k, self.normalize)
        if not self.sigmoid:
            return grouped_softmax_routing(logits, top_k=self.top_k, groups=self.groups, top_groups=self.top_groups,
                                           pre_softmax=not self.normalize, scaling=self.scaling,
                                           group_score_k=self.group_score_k).to(logits.dtype)
        bias = self.expert_bias if hasattr(self, "expert_bias") else torch.zeros(logits.shape[-1])
        return grouped_sigmoid_routing(logits.float(), bias, top_k=self.top_k, groups=self.groups,
                                       top_groups=self.top_groups, normalize=self.top_k > 1,
                                       scaling=self.scaling, score=self.score,
                                       group_score_k=self.group_score_k).to(logits.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weights = self.routing(flat)
        if self.stacks is None:  # the eager reference: every expert, mixed by the routing
            gate, up = self.experts.gate_up_proj.chunk(2, dim=1)
            out = dense_experts(flat, weights, gate, up, self.experts.down_proj, F.silu, self.experts.biases())
        else:
            out = routed_moe(flat, weights, self.router.weight, self.stacks.gate_proj, self.stacks.up_proj,
                             self.stacks.down_proj, self.top_k, self.stacks.gate, self.experts.biases())
        if hasattr(self, "shared_expert"):
            shared = self.shared_expert(flat)
            if hasattr(self, "shared_expert_gate"):
                shared = torch.sigmoid(self.shared_expert_gate(flat)) * shared
            out = out + shared
        return out.view_as(x)


class MegatronAttention(Attention):
    """Megatron's ``SelfAttention`` where it leaves FLA's layout: heads of ``kv_channels`` (any width),
    ``attention_output_gate`` (per query group ``[q | gate | k | v]`` in ``linear_qkv``; the attention output times
    ``sigmoid(gate)`` before ``linear_proj``), rotary on the first ``rotary_dim`` channels of each head (Megatron's
    ``rotary_percent``, NeoX halves within them; the rest pass through), LayerNorm q / k norms, ``add_bias_linear``
    (``linear_qkv``'s bias gives q, gate, k and v theirs; ``linear_proj`` has one)."""

    def __init__(self, config: MegatronConfig, layer_idx: int) -> None:
        nn.Module.__init__(self)
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_attention_heads, c.num_query_groups, c.kv_channels
        self.window_size, self.rope_theta, self.qk_norm, self.layer_idx = None, c.rotary_base, c.qk_layernorm, layer_idx
        self.rotary_dim = c.rotary_dim or c.kv_channels
        query, kv = c.num_attention_heads * c.kv_channels, c.num_query_groups * c.kv_channels
        qkv_bias = c.add_qkv_bias or c.add_bias_linear
        self.q_proj = nn.Linear(c.hidden_size, query, bias=qkv_bias)
        self.k_proj = nn.Linear(c.hidden_size, kv, bias=qkv_bias)
        self.v_proj = nn.Linear(c.hidden_size, kv, bias=qkv_bias)
        self.o_proj = nn.Linear(query, c.hidden_size, bias=c.add_bias_linear)
        if c.attention_output_gate:
            self.gate_proj = nn.Linear(c.hidden_size, query, bias=qkv_bias)
        if c.qk_layernorm:
            self.q_norm, self.k_norm = megatron_norm(c, c.kv_channels), megatron_norm(c, c.kv_channels)

    def inv_freq(self) -> torch.Tensor:
        exponents = torch.arange(0, self.rotary_dim, 2, dtype=torch.float32) / self.rotary_dim
        return 1.0 / (float(self.rope_theta) ** exponents)

    def forward(self, x, past_key, past_value, context):
        q, k, v = self.heads(x)
        cos, sin = blocks.rope_cos_sin(self.inv_freq(), context.positions, 1.0, x.dtype)
        cos, sin = cos[:, :, None], sin[:, :, None]
        r = self.rotary_dim

        def rotate(t):
            turned = t[..., :r] * cos + rotate_half(t[..., :r]) * sin
            return turned if r == self.head_dim else torch.cat([turned, t[..., r:]], dim=-1)

        out, key, value = blocks.cached_attention(rotate(q).transpose(1, 2), rotate(k).transpose(1, 2),
                                                  v.transpose(1, 2), past_key, past_value, context.mask,
                                                  self.head_dim ** -0.5)
        if hasattr(self, "gate_proj"):
            out = (out.float() * torch.sigmoid(self.gate_proj(x).float())).to(out.dtype)
        return self.o_proj(out), key, value


class Block(nn.Module):
    """One mixer layer (``attn_norm``, ``attn``) and the Megatron MLP / MoE layers after it (``mlp_norms``,
    ``mlps``)."""

    def __init__(self, config: MegatronConfig, mixer: nn.Module, mlp_indices: list[int]) -> None:
        super().__init__()
        self.attn_norm = megatron_norm(config, config.hidden_size)
        self.attn = mixer
        self.mlp_norms, self.mlps = mlp_layers(config, mlp_indices)

    def forward(self, step, *args):
        return step(*args)


def mlp_layers(config: MegatronConfig, indices: list[int]) -> tuple[nn.ModuleList, nn.ModuleList]:
    """The pre-norms and the ``MLP`` / ``MoELayer`` of the Megatron layers ``indices``."""
    norms = nn.ModuleList(megatron_norm(config, config.hidden_size) for _ in indices)
    mlps = nn.ModuleList(
        MegatronMoE(config) if index in config.moe_layers
        else MegatronMLP(config.hidden_size, config.ffn_hidden_size, config.mlp_activation, config.add_bias_linear)
        for index in indices)
    return norms, mlps


def build_mixer(kind: str, config: MegatronConfig, index: int) -> nn.Module:
    if kind == "gdn":
        return GatedDeltaNetMixer(config)
    if kind == "gdn2":
        return GatedDeltaNet2Mixer(config)
    if kind == "gdp":
        return GatedDeltaProductMixer(config)
    if kind == "mamba2":
        return Mamba2Mixer(config)
    c = config
    if c.attention_output_gate or (c.rotary_dim or c.kv_channels) != c.kv_channels or \
            c.kv_channels * c.num_attention_heads != c.hidden_size or c.normalization != "RMSNorm" or \
            c.add_bias_linear:
        return MegatronAttention(config, index)
    attention = Attention(config.hidden_size, config.num_attention_heads, config.num_query_groups,
                          qkv_bias=config.add_qkv_bias, qk_norm=config.qk_layernorm, rope_theta=config.rotary_base,
                          layer_idx=index)
    if config.qk_layernorm:
        attention.q_norm.eps = attention.k_norm.eps = config.norm_eps
    return attention


class MegatronHybridLM(FlaForCausalLM):
    """The hybrid model: FLA's stack layout (``model.embeddings``, ``model.layers``, ``model.norm``, ``lm_head``) and
    its decoder loop, with Megatron's blocks (a mixer and the MLP layers after it)."""

    def __init__(self, config: MegatronConfig) -> None:
        nn.Module.__init__(self)
        self.config = config
        self.model = nn.Module()
        self.model.embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.model.layers = nn.ModuleList(
            Block(config, build_mixer(kind, config, i), mlps) for i, (kind, _, mlps) in enumerate(config.blocks))
        self.model.lead_norms, self.model.lead_mlps = mlp_layers(config, config.lead_mlps)
        self.model.norm = megatron_norm(config, config.hidden_size)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embeddings.weight

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embeddings, then the MLP / MoE layers before the first mixer (no state: they run here, once)."""
        x = super().embed(input_ids)
        for norm, mlp in zip(self.model.lead_norms, self.model.lead_mlps):
            x = x + mlp(norm(x))
        return x

    def layer_step(self, index, layer, x, states, context):
        x, *new_states = self.residual(index, layer, "mixer", x,
                                       lambda h: self.mixer(index, layer, h, states, context))
        for norm, mlp in zip(layer.mlp_norms, layer.mlps):
            x = x + mlp(norm(x))
        return (x, *new_states)


class MegatronMTPLayer(nn.Module):
    """The inner layers of a Megatron MTP depth (``mtp_model_layer``: a HybridModel's MTP pattern, e.g. ``*E`` /
    ``*-`` / ``*-E``; a GPTModel's ``TransformerLayer`` = its attention and its MLP or MoE) as the decoder's own
    ``Block``: the attention layer (``build_mixer``, whatever it computes: output gate or not, partial rotary, q/k
    norms, biases) then the MLP / MoE layers after it (``mlp_layers``: any routing the decoder reads), each with its
    pre-norm and residual, as ``MegatronHybridLM.layer_step`` runs them. The interface of ``models.mtp``'s
    ``DecoderLayer`` (``MTPHead``'s inner layer): one KV cache, the attention's.

    The routed experts of its MoE layers run as one ``moe_ffn`` node over ``ExpertStacks`` (``attach_stacks``,
    registered here: the head is exported alone), as ``family.MegatronLM`` gives the decoder's."""

    def __init__(self, config: MegatronConfig) -> None:
        super().__init__()
        kind, _, mlps = config.blocks[0]
        self.block = Block(config, build_mixer(kind, config, 0), mlps)
        self.attach_stacks()

    def attach_stacks(self) -> None:
        """(Re)build the MoE layers' ``ExpertStacks`` from their experts' current weights (after loading them)."""
        from gdn_export.hf.blocks import ExpertStacks

        stacks = {}
        for j, mlp in enumerate(self.block.mlps):
            if isinstance(mlp, MegatronMoE):
                stacks[str(j)] = ExpertStacks(mlp.experts, mlp.gate)
                object.__setattr__(mlp, "stacks", stacks[str(j)])
        self.expert_stacks = nn.ModuleDict(stacks)

    def forward(self, x: torch.Tensor, past_key: torch.Tensor, past_value: torch.Tensor, positions: torch.Tensor,
                last_only: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``last_only``: the MLP layers (per position) and the output on the last position only."""
        from gdn_export.models.decoder import Context

        block = self.block
        out, (key, value) = block.attn.forward_states(block.attn_norm(x), [past_key, past_value], Context(positions))
        x = x + out
        if last_only:
            x = x[:, -1:]
        for norm, mlp in zip(block.mlp_norms, block.mlps):
            x = x + mlp(norm(x))
        return x, key, value
