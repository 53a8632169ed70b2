"""The one decoder loop of every family: embed, per layer a token mixer and a feed-forward, head.

``Decoder.decode(input_ids, states, specs)`` runs

    x = embed(input_ids)
    context = positions of the new tokens (from the first key cache) and rotary_tables(x, positions)
    for each layer i (layer_step, inside run_layer):
        x, new states of i = residual(i, layer, "mixer", x, mixer on its carried states)
        x, _ = residual(i, layer, "feed_forward", x, feed_forward)
    logits = head(x)

A family overrides only the hooks that differ:

| hook | default |
|---|---|
| ``embed(input_ids)`` | required |
| ``decoder_layers()`` | required: the layer modules, in order |
| ``layer_types`` | required: per layer, ``"linear_attention"`` (a delta-rule mixer) or an attention kind |
| ``rotary_tables(x, positions)`` | None (no tables shared by the layers) |
| ``mixer(i, layer, x, states, context)`` | ``delta_mixer`` on linear-attention layers, ``attention`` on the others |
| ``delta_mixer(i, layer, x, states, rows)``, ``attention(i, layer, x, states, context)`` | required unless ``mixer`` is |
| ``feed_forward(i, layer, x)`` | required |
| ``norms(i, layer, part)`` | required unless ``residual`` is: (norm of the branch input, of its output), either None |
| ``residual(i, layer, part, x, branch)`` | ``x + after(branch(before(x)))`` with ``norms``' pair (pre- or post-norm) |
| ``head(x)`` | required: final norm and LM head (``vocab_projection``: a head tied to the embedding table) |
| ``run_layer(layer, step, *args)`` | ``step(*args)`` (a hook for the trace's node names only) |

A head tied to the embedding table goes through ``vocab_projection``, which reads the table as two row slices
(see there: tract then packs the head once at load instead of on every call).

Mixers return ``(out, *new states)``: the layer's new states, in the order of its specs, which is the order
they take among the graph's outputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import nn

from gdn_export.models import blocks
from gdn_export.models.row_lengths import RowLengths
from gdn_export.models.state import StateSpec

# a sublayer's branch: its input -> (output, *new states)
Branch = Callable[[torch.Tensor], tuple]


@dataclass
class Context:
    """What the layers of one call share, computed once before the loop."""

    positions: torch.Tensor | None  # [1, S] absolute positions of the new tokens ([B, S] serving); None without a cache
    rotary: Any = None  # rotary_tables' result (None where the family shares none)
    past_len: torch.Tensor | None = None  # serving graphs: [B], each row's own past length
    past: torch.Tensor | None = None  # the first key cache input (its axis 2 is the padded past P)
    rows: RowLengths | None = None  # serving graphs: each row's own count of real new tokens
    masks: dict = field(default_factory=dict)  # (dtype, sliding_window) -> the mask built by the first layer asking
    # last_logits_only: the layer after whose mixer only the last position goes on (None: none); set True once taken
    last_position_at: int | None = None
    last_position_taken: bool = False

    def mask(self, keys: torch.Tensor, dtype: torch.dtype, sliding_window: int | None = None) -> torch.Tensor:
        """The additive attention mask over ``keys`` (an extended key cache): ``blocks.causal_mask``, built once per
        call for every attention layer of the same dtype and window. Every key cache of a call has the same past
        length (``positions`` are taken from the first one for all layers alike), so every layer's mask is the same
        tensor; built per layer, each would scan its P+S key positions again (a cumsum, 0.28 ms a layer per decode
        step of the 0.8B shape at 512 tokens of past)."""
        key = (dtype, sliding_window)
        if key not in self.masks:
            self.masks[key] = blocks.causal_mask(self.positions, keys, dtype, sliding_window, self.past_len, self.past)
        return self.masks[key]


class Decoder:
    """The decoder loop and its hooks (see the module docstring); mixed into an ``nn.Module``."""

    layer_types: Sequence[str]

    # True: logits of the last position only (``[B, 1, vocab]``), all a generation needs: the head (a vocab x hidden
    # product per position, a quarter of Qwen3.5 0.8B's per-token work) then runs once per call, not per token
    last_logits_only: bool = False

    # True: a serving graph (``convert(serving=True)``): inputs ``past_len`` ``[B]`` (with attention caches) and
    # ``seq_len`` ``[B]`` give each row its own past length and its own count of real new tokens (the rest are
    # identity steps, models/row_lengths.py); cache inputs are padded to the longest (keys past a row's length
    # masked) and cache outputs are the new positions only, ``[B, Hkv, S, D]``, for the host to write at each row's
    # own length
    serving: bool = False
    # why this family has no serving graph (None: it has one)
    serving_refusal: str | None = None

    def decode(self, input_ids: torch.Tensor, states: Sequence[torch.Tensor],
               specs: Sequence[StateSpec], past_len: torch.Tensor | None = None,
               seq_len: torch.Tensor | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """input_ids ``[B, S]`` and the flat states (``specs`` order) -> (logits ``[B, S, vocab]``, or ``[B, 1, vocab]``
        with ``last_logits_only``; new flat states). ``past_len`` and ``seq_len`` ``[B]``: a serving graph's per-row
        past lengths and counts of real new tokens."""
        layers = list(self.decoder_layers())
        per_layer = split_states(states, specs, len(layers))
        x = self.embed(input_ids)
        # every attention layer has seen the same past: the first key cache's length gives the positions
        first_key = next((s for spec, s in zip(specs, states) if spec.kind == "key"), None)
        positions = None if first_key is None else blocks.positions(input_ids, first_key, past_len)
        rows = None if seq_len is None else RowLengths.of(seq_len, input_ids)
        context = Context(positions, None if positions is None else self.rotary_tables(x, positions),
                          past_len, first_key, rows,
                          last_position_at=len(layers) - 1 if self.last_logits_only and rows is None else None)
        new_states = []
        for i, layer in enumerate(layers):
            x, *layer_states = self.run_layer(layer, self.layer_step, i, layer, x, per_layer[i], context)
            new_states += layer_states
        if past_len is not None:  # a cache's output: the S new positions, after the padded past
            new_states = [new_positions(new, old, spec) for spec, old, new in zip(specs, states, new_states)]
        if self.last_logits_only and not context.last_position_taken:
            x = x[:, -1:] if rows is None else rows.last(x)
        return self.head(x), new_states

    def split_inputs(self, inputs: Sequence[torch.Tensor], specs: Sequence[StateSpec]
                     ) -> tuple[torch.Tensor | None, torch.Tensor | None, list[torch.Tensor]]:
        """A graph's inputs after ``input_ids``: ``(past_len, seq_len, states)`` (``serving_inputs`` names them; each
        None where the graph has no such input)."""
        inputs, named = list(inputs), {}
        for name in serving_inputs(self.serving, specs):
            named[name] = inputs.pop(0)
        return named.get("past_len"), named.get("seq_len"), inputs

    def layer_step(self, index: int, layer: nn.Module, x: torch.Tensor, states: list[torch.Tensor],
                   context: Context) -> tuple:
        """One layer: ``(new x, *its new states)``."""
        x, *new_states = self.residual(index, layer, "mixer", x,
                                       lambda h: self.mixer(index, layer, h, states, context))
        if index == context.last_position_at:  # --logits last: the last feed-forward and the head on one position
            x, context.last_position_taken = x[:, -1:], True  # (the feed-forward is per position: the same values)
        x, *_ = self.residual(index, layer, "feed_forward", x, lambda h: (self.feed_forward(index, layer, h),))
        return (x, *new_states)

    # --- hooks ------------------------------------------------------------------------------------------------

    def run_layer(self, layer: nn.Module, step: Callable[..., tuple], *args) -> tuple:
        """Calls ``step(*args)``; a family whose layer modules accept it may call ``layer(step, *args)`` instead,
        so that the trace scopes the layer's nodes under the layer's name (FLA's ``_0__attn__...``)."""
        return step(*args)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def decoder_layers(self) -> Sequence[nn.Module]:
        raise NotImplementedError

    def rotary_tables(self, x: torch.Tensor, positions: torch.Tensor):
        return None

    def mixer(self, index: int, layer: nn.Module, x: torch.Tensor, states: list[torch.Tensor],
              context: Context) -> tuple:
        if self.layer_types[index] == "linear_attention":
            return self.delta_mixer(index, layer, x, states, context.rows)
        return self.attention(index, layer, x, states, context)

    def delta_mixer(self, index: int, layer: nn.Module, x: torch.Tensor, states: list[torch.Tensor],
                    rows: RowLengths | None) -> tuple:
        """A delta-rule layer; ``rows`` (a serving graph's per-row token counts) goes to ``blocks.gated_delta_mixer``."""
        raise NotImplementedError

    def attention(self, index: int, layer: nn.Module, x: torch.Tensor, states: list[torch.Tensor],
                  context: Context) -> tuple:
        raise NotImplementedError

    def feed_forward(self, index: int, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def norms(self, index: int, layer: nn.Module, part: str) -> tuple[nn.Module | None, nn.Module | None]:
        """(norm of the branch input, norm of the branch output) of ``part`` ("mixer" or "feed_forward")."""
        raise NotImplementedError

    def residual(self, index: int, layer: nn.Module, part: str, x: torch.Tensor, branch: Branch) -> tuple:
        """The residual stream through one sublayer: ``(new x, *the branch's new states)``."""
        before, after = self.norms(index, layer, part)
        out, *states = branch(x if before is None else before(x))
        return (x + (out if after is None else after(out)), *states)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


def serving_inputs(serving: bool, specs: Sequence[StateSpec]) -> list[str]:
    """The inputs a graph takes between ``input_ids`` and its states: a serving graph's ``past_len`` (with an
    attention cache) and ``seq_len``."""
    if not serving:
        return []
    return (["past_len"] if takes_past_len(serving, specs) else []) + ["seq_len"]


def takes_past_len(serving: bool, specs: Sequence[StateSpec]) -> bool:
    """Whether a graph has the ``past_len`` input: a serving graph with an attention cache (a graph of delta-rule
    layers only is the same graph served or not: its states have no past axis)."""
    return serving and any("P" in spec.shape for spec in specs)


def new_positions(new: torch.Tensor, old: torch.Tensor, spec: StateSpec) -> torch.Tensor:
    """A serving graph's state output: a cache's positions after the padded past ``old`` (its S new ones); any other
    state as it is."""
    if "P" not in spec.shape:
        return new
    axis = spec.shape.index("P")
    return new[(slice(None),) * axis + (slice(old.shape[axis], None),)]


def split_states(states: Sequence[torch.Tensor], specs: Sequence[StateSpec], layers: int) -> list[list[torch.Tensor]]:
    """The flat states as one list per layer (by each spec's layer), graph order kept within a layer."""
    if len(states) != len(specs):
        raise ValueError(f"expected {len(specs)} state tensors, got {len(states)}")
    per_layer: list[list[torch.Tensor]] = [[] for _ in range(layers)]
    for spec, state in zip(specs, states):
        per_layer[spec.layer].append(state)
    return per_layer


def vocab_projection(x: torch.Tensor, lm_head: nn.Linear, tied: bool) -> torch.Tensor:
    """``lm_head(x)``; with ``tied`` (``lm_head``'s weight is the embedding table: ``tie_word_embeddings``) the same
    logits as two products over row slices of the table, concatenated: ``[x W[:V/2]^T | x W[V/2:]^T]``.

    Why (tract 0.23.9; benchmarks/results/cpu_tied_head.md): tract packs a constant matmul operand once, at load,
    by constant-folding its packing; but it folds no op whose constant input has several consumers once that
    input is over 4 MiB (``PropConst`` against ``CONST_FOLD_MEM_BUDGET``, so as not to copy a big weight once per
    consumer). A tied table feeds both the embedding's gather and the head, so the head (622 MB for vocab 151936
    x 1024) was packed again on every call: a decode step ~8x slower than with an untied head. A second copy of
    the table in the file does not help: tract merges constants of equal value (``add_const``). A ``Slice`` is
    the one op that budget exempts: each slice of the shared table becomes a constant of its own that only its
    matmul reads, packed once at load. Costs: no extra byte on disk (one variable, read by the gather and the
    two slices); in memory the packed head, as an untied head has too; per call one copy of the logits (the
    concatenation). Every logit is the same dot product as before.

    Written ``x @ slice.t()`` on ``Tensor.split``'s pieces: torch-to-nnef then emits NNEF ``slice`` ops on the
    table's variable (``F.linear`` on a slice would write the slice out as a new variable: the table twice on
    disk)."""
    rows = lm_head.out_features  # an int (the weight is a traced tensor under export)
    if not tied or rows < 2:
        return lm_head(x)
    first, second = lm_head.weight.split([rows // 2, rows - rows // 2])
    logits = torch.cat([x @ first.t(), x @ second.t()], dim=-1)
    return logits if lm_head.bias is None else logits + lm_head.bias
