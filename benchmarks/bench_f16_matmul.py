"""One linear layer of the Qwen3.5 0.8B shape in tract, f32 against f16 forms, side by side, one thread: why tract
0.23.9's f16 path is slow on an AVX-512 (FP16) Xeon.

Forms (weight [N, K], input [1, M, K]): ``f32`` (f32 weight and input), ``f16`` (both f16: what an f16 archive
runs), ``f16w_f32x`` (f16 weight, f32 input, one mixed ``linear``:
tract's f16f32 packing, f32 compute), ``f16w_cast`` (weight stored f16, cast to f32 in the graph, f32 input), ``f16_io_f32mm`` (f16 weight and
input, both cast to f32 around an f32 matmul, result cast back to f16). M is planned fixed (1, 128) or left
symbolic (run at 1 and 128). Prints median ms per call and the ratio to f32, then with ``--profile`` the ops of
each plan (tract's ``profile_json``). Usage: ``python benchmarks/bench_f16_matmul.py [--seconds 1] [--profile]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from gdn_export.hf.tensors import write_nnef_array

SHAPES = [("mlp gate/up", 3584, 1024), ("mlp down", 1024, 3584)]
FORMS = ("f32", "f16", "f16w_f32x", "f16w_cast", "f16_io_f32mm")


def folder_for(root: Path, weight: np.ndarray, form: str) -> Path:
    n, k = weight.shape
    folder = root / f"{form}_{n}_{k}"
    folder.mkdir(parents=True)
    io = "f16" if form in ("f16", "f16_io_f32mm") else "f32"
    body = [f"x = tract_core_external(shape = [1, M, {k}], datum_type = '{io}');",
            f"w = variable<scalar>(label = 'w', shape = [{n}, {k}]);"]
    if form == "f16w_cast":
        body += ["wc = tract_core_cast(w, to = 'f32');", "w_aligned = unsqueeze(wc, axes = [0]);",
                 "y = linear(x, w_aligned, 0.0);"]
    elif form == "f16_io_f32mm":
        body += ["wc = tract_core_cast(w, to = 'f32');", "xc = tract_core_cast(x, to = 'f32');",
                 "w_aligned = unsqueeze(wc, axes = [0]);", "y32 = linear(xc, w_aligned, 0.0);",
                 "y = tract_core_cast(y32, to = 'f16');"]
    else:
        body += ["w_aligned = unsqueeze(w, axes = [0]);", "y = linear(x, w_aligned, 0.0);"]
    text = ("version 1.0;\nextension tract_registry tract_core;\n\ngraph network(x) -> (y)\n{\n    "
            + "\n    ".join(body) + "\n}\n")
    (folder / "graph.nnef").write_text(text)
    with open(folder / "w.dat", "wb") as file:
        write_nnef_array(file, weight if form == "f32" else weight.astype(np.float16))
    return folder


def plan(folder: Path, rows: int | None) -> "tract.Runnable":
    import tract

    model = tract.nnef().with_tract_transformers().load(str(folder))
    if rows is not None:
        model.transform(tract.SetSymbols({"M": rows}))
    return model.into_runnable()


def time_call(runnable: "tract.Runnable", x: np.ndarray, seconds: float) -> float:
    runnable.run([x])
    times, start = [], time.perf_counter()
    while time.perf_counter() - start < seconds or len(times) < 5:
        t = time.perf_counter()
        runnable.run([x])
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times)


def profile(runnable: "tract.Runnable", x: np.ndarray) -> list[tuple[str, float]]:
    report = json.loads(runnable.profile_json([x]))
    rows = []
    for node in report.get("nodes", []):
        secs = node.get("secs_per_iter") or node.get("secs") or 0.0
        rows.append((f"{node.get('node_name')}: {node.get('op_name')}", 1000 * float(secs)))
    return rows or [("raw", 0.0), (json.dumps(report)[:2000], 0.0)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 128])
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    print("tract one thread; median ms per call (ratio to f32 of the same plan); M planned = the rows, or symbolic\n")
    print("| matrix | N x K | M | plan | " + " | ".join(FORMS) + " |")
    print("|---|---|---|---|" + "---|" * len(FORMS))
    rng = np.random.default_rng(0)
    profiles = []
    with tempfile.TemporaryDirectory(prefix="bench_f16_") as tmp:
        for name, n, k in SHAPES:
            weight = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
            folders = {f: folder_for(Path(tmp), weight, f) for f in FORMS}
            for rows in args.rows:
                for planned in (rows, None):
                    runs = {f: plan(folders[f], planned) for f in FORMS}
                    x32 = rng.standard_normal((1, rows, k)).astype(np.float32)
                    xs = {f: x32.astype(np.float16) if f in ("f16", "f16_io_f32mm") else x32 for f in FORMS}
                    ms: dict[str, list[float]] = {f: [] for f in FORMS}
                    for _ in range(3):  # interleaved rounds
                        for f in FORMS:
                            ms[f].append(time_call(runs[f], xs[f], args.seconds / 3))
                    med = {f: statistics.median(v) for f, v in ms.items()}
                    cells = [f"{med['f32']:.3f}"] + [f"{med[f]:.3f} ({med[f] / med['f32']:.2f}x)" for f in FORMS[1:]]
                    label = "fixed" if planned is not None else "symbolic"
                    print(f"| {name} | {n} x {k} | {rows} | {label} | " + " | ".join(cells) + " |", flush=True)
                    if args.profile:
                        for f in FORMS:
                            profiles.append((f"{name} M={rows} {label} {f}", profile(runs[f], xs[f])))
    for title, rows in profiles:
        print(f"\n{title}")
        for op, ms_ in rows:
            print(f"    {ms_:8.3f} ms  {op}")


if __name__ == "__main__":
    main()
