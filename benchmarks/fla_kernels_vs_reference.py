"""FLA's Triton kernels against gdn_export's reference of the delta-rule family, on a GPU.

    python benchmarks/fla_kernels_vs_reference.py      # needs CUDA, fla-core (Triton); not run in CI

For each variant (GDN, KDA, GDN2 with and without negative eigenvalues, Gated DeltaProduct n=2/3 with
and without decay, DeltaNet) it feeds the same inputs to FLA's chunk and fused-recurrent kernels and to
``gdn_export.ops.gated_delta_rule.naive.delta_rule_recurrence`` (float64, CPU), and prints the max abs error of the output
and the final state relative to max |reference|. Loads naive.py by path so only torch is needed.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import torch
import torch.nn.functional as F

NAIVE = Path(__file__).resolve().parents[1] / "gdn_export" / "ops" / "naive.py"
spec = importlib.util.spec_from_file_location("gdn_naive", NAIVE)
naive = importlib.util.module_from_spec(spec)
spec.loader.exec_module(naive)


def reference(q, k, v, s0, *, g=None, beta=None, erase=None, write=None, n=1):
    """gdn_export's math in float64: q/k L2-normalized, q scaled by 1/sqrt(K), [B, T, H, *] layout."""
    to = lambda x: None if x is None else x.detach().double().cpu().transpose(1, 2)  # noqa: E731
    q64, k64 = naive.l2norm(q.double()), naive.l2norm(k.double())
    q64 = q64 / math.sqrt(q.shape[-1])
    y, state = naive.delta_rule_recurrence(to(q64), to(k64), to(v), s0.double().cpu(), g=to(g), beta=to(beta),
                                           erase=to(erase), write=to(write), num_householder=n)
    return y.transpose(1, 2), state


def error(actual, expected) -> str:
    actual = actual.double().cpu()
    return f"{(actual - expected).abs().max().item() / expected.abs().max().item():.2e}"


def main() -> None:
    from fla.ops.delta_rule import chunk_delta_rule, fused_recurrent_delta_rule
    from fla.ops.gated_delta_product import chunk_gated_delta_product
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    from fla.ops.gdn2 import chunk_gdn2, fused_recurrent_gdn2
    from fla.ops.kda import chunk_kda, fused_recurrent_kda

    torch.manual_seed(0)
    dev, B, T, H, K, V = "cuda", 2, 300, 4, 64, 64
    rand = lambda *s: torch.randn(*s, device=dev)  # noqa: E731
    q, k, v = rand(B, T, H, K), rand(B, T, H, K), rand(B, T, H, V)
    s0 = 0.1 * rand(B, H, K, V)
    g_head = -F.softplus(rand(B, T, H)) * 0.5
    g_chan = -F.softplus(rand(B, T, H, K)) * 0.5
    beta = torch.sigmoid(rand(B, T, H))
    common = dict(initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    rows = []

    def check(name, kernel, ref, **kw):
        try:
            y, state = kernel(**kw)
            rows.append((name, error(y, ref[0]), error(state, ref[1])))
        except Exception as err:  # report and go on: one kernel's API change must not hide the others
            rows.append((name, f"failed: {type(err).__name__}: {str(err)[:80]}", ""))

    ref = reference(q, k, v, s0, g=g_head, beta=beta)
    for kernel in (chunk_gated_delta_rule, fused_recurrent_gated_delta_rule):
        check(f"GDN {kernel.__name__}", kernel, ref, q=q, k=k, v=v, g=g_head, beta=beta, **common)
    ref = reference(q, k, v, s0, g=g_chan, beta=beta)
    for kernel in (chunk_kda, fused_recurrent_kda):
        check(f"KDA {kernel.__name__}", kernel, ref, q=q, k=k, v=v, g=g_chan, beta=beta, **common)
    for neg in (False, True):
        erase, write = torch.sigmoid(rand(B, T, H, K)) * (2 if neg else 1), torch.sigmoid(rand(B, T, H, V))
        ref = reference(q, k, v, s0, g=g_chan, erase=erase, write=write)
        for kernel in (chunk_gdn2, fused_recurrent_gdn2):
            check(f"GDN2{' neg-eig' if neg else ''} {kernel.__name__}", kernel, ref, q=q, k=k, v=v, g=g_chan,
                  b=erase, w=write, **common)
    ref = reference(q, k, v, s0, beta=beta)
    for kernel in (chunk_delta_rule, fused_recurrent_delta_rule):
        check(f"DeltaNet {kernel.__name__}", kernel, ref, q=q, k=k, v=v, beta=beta, **common)
    for n in (2, 3):
        kn, vn = rand(B, T * n, H, K), rand(B, T * n, H, V)
        bn = torch.sigmoid(rand(B, T * n, H)) * 2
        for decay in (True, False):
            ref = reference(q, kn, vn, s0, g=g_head if decay else None, beta=bn, n=n)
            # FLA asserts q.dtype != float32 for this kernel: bf16 operands, f32 state
            check(f"DeltaProduct n={n}{'' if decay else ' no decay'} chunk (bf16)", chunk_gated_delta_product, ref,
                  q=q.bfloat16(), k=kn.bfloat16(), v=vn.bfloat16(), g=g_head if decay else None,
                  beta=bn.bfloat16(), num_householder=n, **common)
    print(f"B={B} T={T} H={H} K={K} V={V}; max |error| / max |reference| (reference: gdn_export, float64)\n")
    print("| kernel | output | final state |\n|---|---|---|")
    for name, y_err, s_err in rows:
        print(f"| {name} | {y_err} | {s_err} |")


if __name__ == "__main__":
    main()
