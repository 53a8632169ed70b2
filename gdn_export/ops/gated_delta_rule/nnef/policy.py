"""Which exact lowering is fastest where tract runs: the order ``lowering="auto"`` tries, per runtime.

Exactness is decided by each lowering (its ``refusal``); this table only ranks the exact ones, from the
measurements in benchmarks/RESULTS.md (``benchmarks/bench_lowerings.py``, H=16, K=V=128):

- "cpu": tract's fused op is the slowest exact form on CPU (one token at a time through a generic
  kernel); the chunked form runs prefill on packed matmuls and its per-token remainder covers decode,
  for every variant (chunked/gdn.py for GDN and DeltaNet, chunked/general.py for the rest). The operand
  dtype needs no entry: the measured order is the same for f16 and f32.
- "cuda" (benchmarks/results/tract_runtimes_h200.md): the fused op with f16 operands has tract's GPU
  kernel (0.29-0.36 ms a decode step, 29 ms for S=2048); with f32 operands it has none and runs as on CPU
  (1.7-1.9 ms, 1340 ms), still a little ahead of the portable scan on prefill. An f32 model gets the f16 core
  only when the caller asks for it (``core_dtype="float16"``): it rounds q/k/v/beta, and the report
  says so; the fused op's own exactness check (f16 operands, or an f16 core asked for) decides, so the
  dtype needs no entry here either. The chunked form is not offered on cuda: tract 0.23.9's CUDA runtime
  fails on its empty pieces (no whole chunk when S < C, no remainder when C divides S: CudaNeg /
  CudaSquare; measured with chunks of C = 64 tokens); where both pieces are non-empty it runs, exact, at
  CPU speed (16 ms at S=130, 219 ms at S=2050: 7x behind the f16 fused op, 7x ahead of the f32 one).
- "any": no back-end known; the fused op where exact (the compact form every back-end names), else the
  portable scan.
"""

from __future__ import annotations

from gdn_export.targets import NNEF_RUNTIMES

# runtime -> registered lowerings (registry.py) to try in order; the emitter takes the first exact one
ORDER: dict[str, tuple[str, ...]] = {
    "any": ("native", "scan"),
    "cpu": ("chunked", "scan"),
    "cuda": ("native", "scan"),
}
RUNTIMES = NNEF_RUNTIMES  # tests/test_lowering_interface.py: ORDER has a lowering order for each


def candidates(runtime: str) -> tuple[str, ...]:
    """Lowerings to try in order for ``lowering="auto"``; the emitter takes the first exact one."""
    return ORDER[runtime]


def basis(runtime: str, lowering: str) -> str:
    """Why auto took this lowering on this runtime, for the export report."""
    if lowering == "native":  # ranked first wherever it is offered: taken as soon as it is exact
        return "fused op is exact for this node on this tract"
    if runtime == "any":
        return "no runtime given: the fused op where exact, else the portable scan"
    return f"fastest exact lowering measured on {runtime} (benchmarks/RESULTS.md)"
