"""The GDN core's lowerings on each tract runtime (CPU, CUDA), timed side by side in one run.

    python benchmarks/bench_tract_runtimes.py export DIR     # here: write the graphs (needs gdn_export)
    python benchmarks/bench_tract_runtimes.py run DIR        # anywhere with tract + numpy, e.g. a GPU host

Graphs: H=16, K=V=128, B=1, one symbolic-S graph per lowering (fused op with f16 and with f32 operands,
portable scan, matmul-step recurrent, chunked when present), and a KDA core (per-channel decay: no fused op)
as scan and chunked. ``run`` times each on every runtime tract offers there ("default" CPU and "cuda" when
a driver is found) at S in --seq, checks every output against the CPU run of the f32 scan graph of its
variant, and prints median ms with ratios against the fused f16 op (GDN) or the scan (KDA) on the same
runtime.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

HEADS, WIDTH = 16, 128
NAMES = ["q", "k", "v", "g", "beta", "s0"]


def export(folder: Path) -> None:
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import gdn_export
    from gdn_export.ops.gated_delta_rule.nnef.emitter import LOWERINGS

    class Rule(torch.nn.Module):
        def forward(self, q, k, v, g, beta, s0):
            return gdn_export.gated_delta_rule(q, k, v, g, beta, s0, use_qk_l2norm=True)

    folder.mkdir(parents=True, exist_ok=True)
    graphs = {}
    for lowering, dtype in [("native", torch.float16), ("native", torch.float32), ("scan", torch.float32),
                            ("recurrent", torch.float32), ("chunked", torch.float32)]:
        if lowering not in LOWERINGS:
            continue
        args = [torch.from_numpy(x).to(dtype if i in (0, 1, 2, 4) else torch.float32)
                for i, x in enumerate(inputs(2, "float32", "gdn"))]
        name = f"{lowering}_{str(dtype)[6:]}"
        gdn_export.export(Rule(), args, folder / f"{name}.nnef.tgz", lowering=lowering, input_names=NAMES,
                          output_names=["o", "state"], dynamic_axes={n: {1: "S"} for n in NAMES[:5]})
        graphs[name] = {"dtype": "float16" if dtype == torch.float16 else "float32", "variant": "gdn"}
    for lowering in ("scan", "chunked"):
        name = f"kda_{lowering}_float32"
        gdn_export.export(Rule(), [torch.from_numpy(x) for x in inputs(2, "float32", "kda")],
                          folder / f"{name}.nnef.tgz", lowering=lowering, input_names=NAMES,
                          output_names=["o", "state"], dynamic_axes={n: {1: "S"} for n in NAMES[:5]})
        graphs[name] = {"dtype": "float32", "variant": "kda"}
    (folder / "graphs.json").write_text(json.dumps(graphs))
    print(f"wrote {', '.join(graphs)} to {folder}")


def inputs(seq: int, dtype: str, variant: str) -> list[np.ndarray]:
    """GDN: g [1, S, H]; KDA: g [1, S, H, K] (per key channel, KDA-like strengths)."""
    rng = np.random.default_rng(seq)
    q, k, v = (rng.standard_normal((1, seq, HEADS, WIDTH)).astype(dtype) for _ in range(3))
    g = -rng.random((1, seq, HEADS) if variant == "gdn" else (1, seq, HEADS, WIDTH)).astype(np.float32)
    beta = rng.random((1, seq, HEADS)).astype(dtype)
    s0 = rng.standard_normal((1, HEADS, WIDTH, WIDTH)).astype(np.float32)
    return [q, k, v, g, beta, s0]


def median_ms(fn, budget: float) -> float:
    fn()
    times, start = [], time.perf_counter()
    while len(times) < 3 or (len(times) < 50 and time.perf_counter() - start < budget):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def run(folder: Path, seqs: list[int], budget: float) -> None:
    import tract

    try:  # fixed allocator thresholds, as every benchmark here (gdn_export.run.runtime.steady_allocator)
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from gdn_export.run.runtime import steady_allocator

        steady_allocator()
    except ImportError:  # a host with tract and numpy only
        print("(glibc's default allocator thresholds: gdn_export not importable)")
    graphs = json.loads((folder / "graphs.json").read_text())
    runtimes = ["default"]
    try:
        tract.runtime_for_name("cuda")
        runtimes.append("cuda")
    except Exception as err:  # no driver here: CPU only
        print(f"(no cuda runtime: {str(err).splitlines()[0]})")
    references = {variant: tract.nnef().with_tract_transformers().load(str(folder / f"{name}.nnef.tgz")).into_runnable()
                  for variant, name in (("gdn", "scan_float32"), ("kda", "kda_scan_float32"))}
    table: dict[tuple[str, str], dict[int, str]] = {}
    for runtime in runtimes:
        for name, spec in graphs.items():
            model = tract.nnef().with_tract_transformers().load(str(folder / f"{name}.nnef.tgz"))
            runnable = model.into_runnable() if runtime == "default" else tract.runtime_for_name(runtime).prepare(model)
            row = table.setdefault((runtime, name), {})
            for seq in seqs:
                xs = inputs(seq, spec["dtype"], spec["variant"])
                try:
                    out = [o.to_numpy() for o in runnable.run(xs)]
                except Exception as err:  # a runtime refusing a graph is a result too
                    row[seq] = (float("nan"), str(err).splitlines()[0][:60])
                    continue
                ref = [o.to_numpy() for o in references[spec["variant"]].run([x.astype(np.float32) for x in xs])]
                err = max(float(np.abs(a.astype(np.float64) - b).max() / np.abs(b).max()) for a, b in zip(out, ref))
                ms = median_ms(lambda: runnable.run(xs), budget)
                row[seq] = (ms, err)
            print(f"done {runtime} {name}", file=sys.stderr, flush=True)
    print(f"H={HEADS}, K=V={WIDTH}, B=1; median ms (x = speed-up over the fused f16 op on the same runtime, for KDA "
          "over its scan; err = max error relative to the f32 scan on CPU)\n")
    print("| runtime | graph | " + " | ".join(f"S={s}" for s in seqs) + " |\n|---|---|" + "---|" * len(seqs))
    for (runtime, name), row in table.items():
        base = table.get((runtime, "kda_scan_float32" if name.startswith("kda") else "native_float16"), row)
        cells = [f"fails: {row[s][1]}" if isinstance(row[s][1], str)
                 else f"{row[s][0]:.3g} ms ({base[s][0] / row[s][0]:.2f}x, err {row[s][1]:.0e})" for s in seqs]
        print(f"| {runtime} | {name} | " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["export", "run"])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--seq", type=int, nargs="+", default=[1, 128, 2048])
    parser.add_argument("--budget", type=float, default=2.0)
    args = parser.parse_args()
    export(args.folder) if args.mode == "export" else run(args.folder, args.seq, args.budget)


if __name__ == "__main__":
    main()
