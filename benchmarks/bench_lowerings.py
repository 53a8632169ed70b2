"""Median time of one gated delta-rule core per lowering, measured side by side in one run.

    python benchmarks/bench_lowerings.py [--heads 16] [--width 128] [--seq 1 128 1024] [--threads 1]
                                         [--onnx-threads 1 2]

Rows: tract with the fused op, tract with the portable scan (one symbolic-S graph each, exported by
gdn_export), and torch eager running gdn_export's reference (the token loop) and transformers' chunked
rule when transformers is installed. With ``--onnx-threads``: also the same core exported to ONNX
(bench_onnx.py's forms): onnxruntime's contrib op and portable Scan at each thread count, tract's ONNX loader on
the elementwise Scan. Ratios are against the fused op in the same run: > 1 is faster.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import gdn_export  # noqa: E402


class Rule(torch.nn.Module):
    def forward(self, q, k, v, g, beta, s0):
        return gdn_export.gated_delta_rule(q, k, v, g, beta, s0, use_qk_l2norm=True)


NAMES = ["q", "k", "v", "g", "beta", "s0"]


def inputs(seq: int, heads: int, width: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randn(1, seq, heads, width, generator=gen),
        torch.randn(1, seq, heads, width, generator=gen),
        torch.randn(1, seq, heads, width, generator=gen),
        -torch.rand(1, seq, heads, generator=gen),
        torch.rand(1, seq, heads, generator=gen),
        torch.randn(1, heads, width, width, generator=gen),
    ]


def median_ms(fn, budget_s: float, min_runs: int = 3, max_runs: int = 50) -> float:
    fn()  # warm-up
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_runs or (len(times) < max_runs and time.perf_counter() - start < budget_s):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def add_allocator_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--glibc-default-allocator", action="store_true",
                        help="leave glibc's adaptive mmap/trim thresholds: timings then flip between modes from run to "
                             "run (see gdn_export.run.runtime.steady_allocator); by default they are fixed for every row")


def apply_allocator_option(args: argparse.Namespace) -> None:
    if not args.glibc_default_allocator:
        import gdn_export.run.runtime  # not imported by the package's facade

        gdn_export.run.runtime.steady_allocator()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--seq", type=int, nargs="+", default=[1, 128, 1024])
    parser.add_argument("--threads", type=int, default=1, help="torch threads (tract runs on one)")
    parser.add_argument("--budget", type=float, default=2.0, help="seconds of timing per cell")
    parser.add_argument("--variants", action="store_true",
                        help="one row per delta-rule variant (runtime='cpu' auto lowering) instead of per lowering")
    parser.add_argument("--only", nargs="+", help="with --variants: these variants only")
    parser.add_argument("--onnx-threads", type=int, nargs="*", default=None,
                        help="add the ONNX rows (onnxruntime at these thread counts, tract's ONNX loader)")
    add_allocator_option(parser)
    args = parser.parse_args(argv)
    apply_allocator_option(args)
    torch.set_num_threads(args.threads)
    if args.variants:
        return bench_variants(args)

    methods: dict[str, callable] = {}
    with tempfile.TemporaryDirectory() as tmp:
        dynamic = {name: {1: "S"} for name in NAMES[:5]}
        for lowering in ("native", "scan", "recurrent", "chunked"):
            path = Path(tmp) / f"{lowering}.nnef.tgz"
            gdn_export.export(Rule(), inputs(2, args.heads, args.width), path, lowering=lowering,
                              input_names=NAMES, output_names=["o", "state"], dynamic_axes=dynamic)
            runnable = gdn_export.run.runtime.load_tract_model(path)
            label = {"native": "tract fused tract_transformers_gdn_recurrent", "scan": "tract portable scan",
                     "recurrent": "tract recurrent (matmul step)",
                     "chunked": "tract chunked (WY form, chunks of 64)"}[lowering]
            methods[label] = lambda xs, r=runnable: r.run([np.ascontiguousarray(x.numpy()) for x in xs])
        if args.onnx_threads is not None:
            from bench_onnx import onnx_methods

            methods.update(onnx_methods(Path(tmp), args.heads, args.width, args.onnx_threads or [1, 2]))
    methods[f"torch eager reference (token loop, {args.threads} thr)"] = lambda xs: gdn_export.gated_delta_rule(
        *xs, use_qk_l2norm=True)
    try:
        from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

        methods[f"torch transformers chunked rule ({args.threads} thr)"] = lambda xs: torch_chunk_gated_delta_rule(
            *xs[:5], initial_state=xs[5], output_final_state=True, use_qk_l2norm_in_kernel=True)
    except ImportError:
        pass

    results: dict[str, dict[int, float]] = {name: {} for name in methods}
    with torch.no_grad():
        for seq in args.seq:
            xs = inputs(seq, args.heads, args.width, seed=seq)
            for name, fn in methods.items():
                results[name][seq] = median_ms(lambda: fn(xs), args.budget)

    fused = next(iter(results.values()))
    print(f"H={args.heads}, K=V={args.width}, B=1, f32; median ms per call (x = speed-up over the fused op)\n")
    print("| method | " + " | ".join(f"S={s}" for s in args.seq) + " |")
    print("|---|" + "---|" * len(args.seq))
    for name, row in results.items():
        cells = [f"{row[s]:.3g} ms ({fused[s] / row[s]:.2f}x)" for s in args.seq]
        print(f"| {name} | " + " | ".join(cells) + " |")


def bench_variants(args) -> None:
    """Each variant of the family (docs/MATH.md) through the lowering runtime='cpu' picks for it,
    against gdn_export's eager reference on the same inputs."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from test_family_variants import VARIANTS, graph_inputs, variant_inputs

    rows: dict[str, dict[int, tuple[float, float, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        for variant in args.only or VARIANTS:
            shape = dict(batch=1, key_heads=args.heads, heads=args.heads, width_k=args.width, width_v=args.width)
            module, traced, names = graph_inputs(*variant_inputs(variant, seq=2, **shape))
            n = int(variant[7]) if variant.startswith("product") else 1
            dynamic = {name: {1: "S" if name in ("q", "g", "erase", "write") or n == 1 else f"{n}*S"}
                       for name in names[:-1]}
            runnables, picked = {}, None
            for lowering in ("scan", "auto"):
                report = gdn_export.export(module, traced, Path(tmp) / f"{variant}_{lowering}.nnef.tgz",
                                           input_names=names, output_names=["o", "state"], dynamic_axes=dynamic,
                                           runtime="cpu", lowering=lowering)
                runnables[lowering] = gdn_export.run.runtime.load_tract_model(report.path)
                picked = report.lowerings()[0]
            label = f"{variant} ({picked})"
            rows[label] = {}
            for seq in args.seq:
                _, tensors, _ = graph_inputs(*variant_inputs(variant, seq=seq, **shape))
                arrays = [np.ascontiguousarray(t.numpy()) for t in tensors]
                scan_ms = median_ms(lambda: runnables["scan"].run(arrays), args.budget)
                auto_ms = median_ms(lambda: runnables["auto"].run(arrays), args.budget)
                torch_ms = median_ms(lambda: module(*tensors), args.budget)
                rows[label][seq] = (auto_ms, scan_ms, torch_ms)
            print(f"done {variant}", file=sys.stderr)
    print(f"H={args.heads}, K=V={args.width}, B=1, f32; median ms per call: tract with the lowering runtime='cpu' "
          f"picks / tract's portable scan / torch eager reference ({args.threads} thr); x = speed-up of the picked "
          "lowering over the scan, and over torch\n")
    print("| variant (lowering) | " + " | ".join(f"S={s}" for s in args.seq) + " |")
    print("|---|" + "---|" * len(args.seq))
    for label, row in rows.items():
        print(f"| {label} | " + " | ".join(
            f"{row[s][0]:.3g} / {row[s][1]:.3g} / {row[s][2]:.3g} ms ({row[s][1] / row[s][0]:.2f}x, "
            f"{row[s][2] / row[s][0]:.2f}x)" for s in args.seq) + " |")


if __name__ == "__main__":
    main()
