"""The GDN core's lowerings on each tract runtime (CPU, CUDA), timed side by side in one run.

    python benchmarks/bench_tract_runtimes.py export DIR     # here: write the graphs (needs gdn_export)
    python benchmarks/bench_tract_runtimes.py run DIR        # anywhere with tract + numpy, e.g. a GPU host

Graphs: H=16, K=V=128, B=1, one symbolic-S graph per lowering (fused op with f16 and with f32 operands,
portable scan, matmul-step recurrent, chunked when present). ``run`` times each on every runtime tract
offers there ("default" CPU and "cuda" when a driver is found) at S in --seq, checks every output against
the CPU run of the f32 scan graph, and prints median ms with ratios against the fused f16 op on the same
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
    from gdn_export.lowering.emitter import LOWERINGS

    class Rule(torch.nn.Module):
        def forward(self, q, k, v, g, beta, s0):
            return gdn_export.gated_delta_rule(q, k, v, g, beta, s0, use_qk_l2norm=True)

    folder.mkdir(parents=True, exist_ok=True)
    graphs = {}
    for lowering, dtype in [("native", torch.float16), ("native", torch.float32), ("scan", torch.float32),
                            ("recurrent", torch.float32), ("chunked", torch.float32)]:
        if lowering not in LOWERINGS:
            continue
        args = [torch.randn(1, 2, HEADS, WIDTH).to(dtype) for _ in range(3)] + [
            -torch.rand(1, 2, HEADS), torch.rand(1, 2, HEADS).to(dtype), torch.randn(1, HEADS, WIDTH, WIDTH)]
        name = f"{lowering}_{str(dtype)[6:]}"
        gdn_export.export(Rule(), args, folder / f"{name}.nnef.tgz", lowering=lowering, input_names=NAMES,
                          output_names=["o", "state"], dynamic_axes={n: {1: "S"} for n in NAMES[:5]})
        graphs[name] = "float16" if dtype == torch.float16 else "float32"
    (folder / "graphs.json").write_text(json.dumps(graphs))
    print(f"wrote {', '.join(graphs)} to {folder}")


def inputs(seq: int, dtype: str) -> list[np.ndarray]:
    rng = np.random.default_rng(seq)
    q, k, v = (rng.standard_normal((1, seq, HEADS, WIDTH)).astype(dtype) for _ in range(3))
    g = -rng.random((1, seq, HEADS)).astype(np.float32)
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

    graphs = json.loads((folder / "graphs.json").read_text())
    runtimes = ["default"]
    try:
        tract.runtime_for_name("cuda")
        runtimes.append("cuda")
    except Exception as err:  # no driver here: CPU only
        print(f"(no cuda runtime: {str(err).splitlines()[0]})")
    reference = tract.nnef().with_tract_transformers().load(str(folder / "scan_float32.nnef.tgz")).into_runnable()
    table: dict[tuple[str, str], dict[int, str]] = {}
    for runtime in runtimes:
        for name, dtype in graphs.items():
            model = tract.nnef().with_tract_transformers().load(str(folder / f"{name}.nnef.tgz"))
            runnable = model.into_runnable() if runtime == "default" else tract.runtime_for_name(runtime).prepare(model)
            row = table.setdefault((runtime, name), {})
            for seq in seqs:
                xs = inputs(seq, dtype)
                try:
                    out = [o.to_numpy() for o in runnable.run(xs)]
                except Exception as err:  # a runtime refusing a graph is a result too
                    row[seq] = (float("nan"), str(err).splitlines()[0][:60])
                    continue
                ref = [o.to_numpy() for o in reference.run([x.astype(np.float32) for x in xs])]
                err = max(float(np.abs(a.astype(np.float64) - b).max() / np.abs(b).max()) for a, b in zip(out, ref))
                ms = median_ms(lambda: runnable.run(xs), budget)
                row[seq] = (ms, err)
            print(f"done {runtime} {name}", file=sys.stderr, flush=True)
    print(f"H={HEADS}, K=V={WIDTH}, B=1; median ms (x = speed-up over the fused f16 op on the same runtime; "
          "err = max error relative to the f32 scan on CPU)\n")
    print("| runtime | graph | " + " | ".join(f"S={s}" for s in seqs) + " |\n|---|---|" + "---|" * len(seqs))
    for (runtime, name), row in table.items():
        base = table.get((runtime, "native_float16"), row)
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
