"""The chunked lowering's sizes: tokens per chunk, and which chunk sizes are valid (no NNEF here, so that the
export's options validate ``chunk_size`` before anything is written)."""

from __future__ import annotations

import math

from gdn_export.ops.gated_delta_rule.operands import Dims

SOLVE_BLOCK = 16  # sub-steps per forward-substitution block: 16 and 32 equally accurate in f32 (16 ~5% faster), 64 (pure doubling) 2x worse

CHUNK = 64  # tokens per chunk by default
# per-channel decay: chunks of 32 tokens cut into exact [4, 4, K] decay blocks (general.channel_decay_pairs).
# Measured (KDA, H=16, K=V=128, S=1024, bench_lowerings --variants): chunk 64 with blocks of 32/16/8/4:
# 619/267/195/223 ms, chunk 32 with blocks of 8/4: 160/142 ms; the scan takes ~480 ms
CHANNEL_CHUNK = 32

# tokens per chunk of the chunked lowering's tail (the last S mod C tokens; GDN and DeltaNet): a decode step runs
# one short chunk, and so does a speculative verify call of up to TAIL_CHUNK tokens, where the per-token tail ran
# one pass over the state per token (benchmarks/RESULTS.md, "Verify calls that pay"). A power of two <= SOLVE_BLOCK.
TAIL_CHUNK = 4


def chunk_size_error(chunk: int) -> str | None:
    """Why ``chunk`` cannot be a chunk size (None: it can): the solve cuts chunks into blocks of SOLVE_BLOCK."""
    if not isinstance(chunk, int) or chunk < SOLVE_BLOCK or chunk % SOLVE_BLOCK:
        return f"a chunk size must be a positive multiple of {SOLVE_BLOCK} tokens, got {chunk!r}"
    return None


def tokens_per_chunk(dims: Dims, size: int | None = None) -> int:
    """Real tokens per chunk, Cr, for this node: ``size`` (a valid chunk size; None: CHUNK, or CHANNEL_CHUNK with
    per-channel decay) for one step per token; with n Householder sub-steps, the fewest tokens whose ``n * Cr``
    sub-steps are at least ``size`` and a multiple of the solve block."""
    chunk = size or (CHANNEL_CHUNK if dims.channel_decay else CHUNK)
    n = dims.num_householder
    unit = SOLVE_BLOCK // math.gcd(SOLVE_BLOCK, n)  # tokens per solve-block multiple
    return unit * max(1, -(-chunk // (unit * n)))


