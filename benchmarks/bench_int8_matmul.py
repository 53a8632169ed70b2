"""One linear layer of the Qwen3.5 0.8B shape in tract, f32 weights against Q4_0 and int8 (``--quantize int8``'s
lowering: the activation rounding and ``tract_core_einsum_q``), side by side in one run, one thread.

Prints a markdown table of median ms per call and the ratio to f32; names the CPU's int8 features (tract picks its
integer kernel from them: AVX2 8x8, AVX-VNNI, AVX-512 VNNI, AMX). Usage:
``python benchmarks/bench_int8_matmul.py [--rows 1 64] [--seconds 1.0] [--head]``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from gdn_export.hf.tensors import write_nnef_array
from gdn_export.weights import int8, q4_0

# (name, out features N, in features K) of the 0.8B text model's matrices (hidden 1024)
SHAPES = [("mlp gate/up", 3584, 1024), ("mlp down", 1024, 3584), ("gdn in_proj_qkv", 6144, 1024),
          ("gdn out_proj", 1024, 2048)]
HEAD = ("head (vocab 151936)", 151936, 1024)
SCHEMES = ("f32", "q4_0", "int8", "int8x2")  # int8x2: the input rounded in two passes (codes and residual)


def cpu_int8_features() -> str:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return "unknown"
    wanted = ["avx2", "avx_vnni", "avx512_vnni", "amx_int8"]
    have = set(flags.split(":", 1)[1].split())
    return ", ".join(f for f in wanted if f in have) or "none of " + ", ".join(wanted)


def linear_folder(folder: Path, weight: np.ndarray, scheme: str) -> Path:
    """The layer on an input [1, S, K]: f32 and Q4_0 as torch-to-nnef writes a linear layer, int8 exported through
    the export's own lowering (a graph pass over torch-to-nnef's graph, ``int8.linear_weights``)."""
    n, k = weight.shape
    if scheme.startswith("int8"):
        import torch

        import gdn_export

        module = torch.nn.Linear(k, n, bias=False)
        module.weight.data = torch.from_numpy(weight)
        path = folder.parent / f"{folder.name}.nnef.tgz"
        gdn_export.export(module, (torch.zeros(1, 5, k),), path, check=False,
                          weights=int8.linear_weights(module, passes=2 if scheme == "int8x2" else 1),
                          input_names=["x"], output_names=["y"], dynamic_axes={"x": {1: "S"}})
        return path
    folder.mkdir(parents=True)
    text = (f"version 1.0;\nextension tract_registry tract_core;\n\ngraph network(x) -> (y)\n{{\n"
            f"    x = tract_core_external(shape = [1, S, {k}], datum_type = 'f32');\n"
            f"    w = variable<scalar>(label = 'w', shape = [{n}, {k}]);\n"
            f"    w_aligned = unsqueeze(w, axes = [0]);\n    y = linear(x, w_aligned, 0.0);\n}}\n")
    (folder / "graph.nnef").write_text(text)
    with open(folder / "w.dat", "wb") as file:
        if scheme == "f32":
            write_nnef_array(file, weight)
        else:
            q4_0.write_nnef(file, weight.shape, lambda a, b: weight[a:b])
    return folder


def time_call(folder: Path, rows: int, seconds: float, k: int) -> float:
    import tract

    model = tract.nnef().with_tract_transformers().load(str(folder))
    model.transform(tract.SetSymbols({"S": rows}))
    runnable = model.into_runnable()
    x = np.random.default_rng(1).standard_normal((1, rows, k)).astype(np.float32)
    runnable.run([x])
    times, start = [], time.perf_counter()
    while time.perf_counter() - start < seconds or len(times) < 3:
        t = time.perf_counter()
        runnable.run([x])
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--head", action="store_true", help="the vocabulary head too (one row only)")
    args = parser.parse_args()
    print(f"CPU int8 features: {cpu_int8_features()}; tract one thread; median ms per call (ratio to f32)\n")
    print("| matrix | N x K | rows M | f32 | Q4_0 | int8 | int8, input in 2 passes |")
    print("|---|---|---|---|---|---|---|")
    rng = np.random.default_rng(0)
    shapes = SHAPES + ([HEAD] if args.head else [])
    with tempfile.TemporaryDirectory(prefix="bench_int8_") as tmp:
        for name, n, k in shapes:
            weight = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
            folders = {s: linear_folder(Path(tmp) / f"{s}_{n}_{k}", weight, s) for s in SCHEMES}
            for rows in args.rows if (name, n, k) != HEAD else [1]:
                ms = {s: time_call(f, rows, args.seconds, k) for s, f in folders.items()}
                cells = [f"{ms['f32']:.2f}"] + [f"{ms[s]:.2f} ({ms['f32'] / ms[s]:.2f}x)" for s in SCHEMES[1:]]
                print(f"| {name} | {n} x {k} | {rows} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
