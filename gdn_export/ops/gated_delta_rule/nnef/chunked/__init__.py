"""Prefill lowering: the chunked (WY / UT-transform) form of the delta rule over chunks of tokens, plus a
per-token tail, for every variant; one graph with a symbolic S serves prefill and decode.

outer.py holds what every node shares (sizes, the split of S into whole chunks and a tail, the chunk scan,
the tail scan, the outputs); the chunk body is gdn.py's for GDN and DeltaNet, general.py's for the rest
(erase/write gates, Householder sub-steps, per-channel decay); body.py has what both bodies write with.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gdn_export.ops.gated_delta_rule.nnef.chunked import gdn, general, outer
from gdn_export.ops.gated_delta_rule.nnef.chunked.outer import CHANNEL_CHUNK, CHUNK, chunk_size_error, tokens_per_chunk
from gdn_export.ops.gated_delta_rule.nnef.chunking import TAIL_CHUNK
from gdn_export.backends.nnef.builder import NnefBuilder
from gdn_export.ops.gated_delta_rule.operands import Dims

if TYPE_CHECKING:
    from gdn_export.ops.gated_delta_rule.nnef.node import GdnNode
    from gdn_export.ops.gated_delta_rule.nnef.options import GatedDeltaRuleOptions

__all__ = ["CHANNEL_CHUNK", "CHUNK", "NAME", "TAIL_CHUNK", "body_for", "chunk_size_error", "lower", "note", "refusal",
           "tail_tokens", "tokens"]

NAME = "chunked"


def body_for(dims: Dims):
    """The body that computes the node: the tuned one where it covers it, else the general one."""
    return gdn if gdn.covers(dims) else general


def tokens(dims: Dims, options: GatedDeltaRuleOptions) -> int:
    """Tokens per chunk for this node: the ``chunk_size`` option, or the default of the node's variant."""
    return tokens_per_chunk(dims, options.chunk_size)


def tail_tokens(dims: Dims, options: GatedDeltaRuleOptions) -> int | None:
    """Tokens per chunk of the tail (the last S mod C tokens): the options' ``tail_chunk`` (default TAIL_CHUNK)
    where the tuned body computes the node (GDN, DeltaNet), None (token by token) for the general body's variants
    or a tail_chunk of 1."""
    size = TAIL_CHUNK if options.tail_chunk is None else options.tail_chunk
    return size if gdn.covers(dims) and size > 1 else None


def refusal(node: GdnNode, dims: Dims, options: GatedDeltaRuleOptions) -> str | None:
    """Why the chunked form does not apply: a variant it cannot compute exactly, or a static S that holds
    no whole chunk (nothing to gain, and a scan over zero chunks does not load)."""
    variant = None if gdn.covers(dims) else general.refusal(dims)
    size = tokens(dims, options)
    if variant is None and not options.seq_may_vary and dims.seq < size:
        return f"a static S={dims.seq} holds no chunk of {size} tokens"
    return variant


def note(node: GdnNode, dims: Dims, options: GatedDeltaRuleOptions) -> str:
    size, tail = tokens(dims, options), tail_tokens(dims, options)
    rest = f"in chunks of {tail} tokens" if tail else "token by token"
    return f"; chunks of {size} tokens, the last S mod {size} {rest}"


def lower(b: NnefBuilder, node: GdnNode, dims: Dims, options: GatedDeltaRuleOptions) -> list:
    return outer.lower(b, node, dims, body_for(dims), tokens(dims, options), tail_tokens(dims, options))
