"""Which exact lowering is fastest where tract runs: the order ``lowering="auto"`` tries, per runtime and dtype.

Exactness is decided elsewhere (the emitter refuses a candidate that would not compute the node's
function); this table only ranks the exact ones, from the measurements in benchmarks/RESULTS.md
(``benchmarks/bench_lowerings.py``, H=16, K=V=128):

- "cpu": tract's fused op is the slowest exact form on CPU (one token at a time through a generic
  kernel); the chunked form runs prefill on packed matmuls and its per-token remainder covers decode.
- "cuda": the fused op with f16 operands has tract's GPU kernel and wins by 4-40x. With f32 operands it
  has none (it runs as on CPU: 1.6 ms a decode step against 0.31 ms for the scan), so f32 models take
  the portable scan, unless the caller explicitly asks for an f16 core (``core_dtype="float16"``),
  which rounds q/k/v/beta and is reported as such. The chunked form is not offered on cuda: tract
  0.23.9's CUDA runtime fails on its empty intermediate tensors (S < 64, S a multiple of 64).
- "any": no back-end known; the fused op where exact (the compact form every back-end names), else the
  portable scan.
"""

from __future__ import annotations

import numpy as np

RUNTIMES = ("any", "cpu", "cuda")
F16 = np.dtype(np.float16)


def candidates(runtime: str, operand_dtype: np.dtype) -> tuple[str, ...]:
    """Lowerings to try in order for ``lowering="auto"``; the emitter takes the first exact one."""
    if runtime == "cpu":
        return ("chunked", "scan")
    if runtime == "cuda":
        return ("native", "scan") if np.dtype(operand_dtype) == F16 else ("scan", "native")
    return ("native", "scan")


def basis(runtime: str, lowering: str) -> str:
    """Why this lowering ranks where it does on this runtime, for the export report."""
    if runtime == "any":
        return "no runtime given: the fused op where exact, else the portable scan"
    return f"fastest exact lowering measured on {runtime} (benchmarks/RESULTS.md)"
