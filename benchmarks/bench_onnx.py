"""Median time of one gated delta-rule core exported to ONNX, per form and runtime (the ONNX rows next to
bench_lowerings.py's tract NNEF rows).

    python benchmarks/bench_onnx.py [--heads 16] [--width 128] [--seq 1 128 1024] [--threads 1 2]
    python benchmarks/bench_onnx.py --realistic [--prompt 128] [--decode 16] [--threads 1]
    python benchmarks/bench_onnx.py --convert-memory CKPT [--dtype float32]

``--convert-memory``: wall time and peak RSS of ``gdn-export convert CKPT -o OUT.onnx --no-check``, streamed (the
default) and ``--in-memory``, each in its own process (``os.wait4``'s rusage of that child); then whether the two
files are the same bytes (.onnx and .onnx.data; the in-memory one has external data above 1 GiB of weights only).
Make a checkpoint with ``large_checkpoint.py DIR --layers 24 --hidden 1024 --vocab 32000`` (580M parameters).

Rows: onnxruntime 1.32 (CPU provider) with the contrib op com.microsoft::GatedDeltaNet (``runtime="onnxruntime"``),
onnxruntime with the portable ONNX Scan (matmul step, ``runtime="any"``), tract's ONNX loader with the Scan of
``runtime="tract-onnx"`` (elementwise step); one symbolic-S graph each, exported by gdn_export
(format="onnx"), checked against torch at export. The same operands as bench_lowerings.py (B=1, f32).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import gdn_export  # noqa: E402
from bench_lowerings import NAMES, Rule, inputs, median_ms  # noqa: E402


def realistic(args) -> None:
    """bench_convert.py's realistic Qwen3.5 (hidden 1024, 24 layers, 580M parameters, random weights, f32): convert to
    ONNX (checked: prefill 8 + decode 2), then prefill and decode tokens/s through OnnxSession, per runtime."""
    import time

    from bench_convert import realistic_checkpoint, tokens_per_second
    from gdn_export.hf.check import sample_tokens, session_logits
    from gdn_export.backends.onnx import OnnxSession

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        checkpoint = realistic_checkpoint(tmp / "qwen3_5_realistic")
        for runtime, lowering in (("onnxruntime", "auto"), ("onnxruntime", "scan")):
            out = tmp / f"{runtime}-{lowering}.onnx"
            start = time.perf_counter()
            report = gdn_export.convert(checkpoint, out, format="onnx", runtime=runtime, lowering=lowering,
                                        force=True, prompt_len=8, decode_steps=2)
            print(report, f"\nconvert {time.perf_counter() - start:.1f} s", flush=True)
            for threads in args.threads:
                session = OnnxSession(out, "onnxruntime", threads=threads)
                tokens = sample_tokens(session.metadata["vocab_size"], 1, args.prompt + args.decode)

                def prefill():
                    session.reset()
                    session.prefill(tokens[:, :args.prompt])

                seconds: list[float] = []
                session_logits(session, tokens, args.prompt)
                for _ in range(2):
                    session_logits(session, tokens, args.prompt, decode_seconds=seconds)
                print(f"| {runtime} {report.layers[0].lowering} | {threads} | prefill {args.prompt}: "
                      f"{tokens_per_second(prefill, args.prompt):.1f} tok/s | decode: "
                      f"{args.decode / min(seconds):.1f} tok/s |", flush=True)


def onnx_methods(folder: Path, heads: int, width: int, threads: list[int]) -> dict:
    """label -> callable(torch inputs) for the ONNX forms of the same core (bench_lowerings.py's ``methods``): the
    contrib op and the portable Scan (matmul step) in onnxruntime at each of ``threads``, and the elementwise Scan in
    tract's ONNX loader. Each graph is exported into ``folder`` and checked against torch at export."""
    import numpy as np
    import onnxruntime as ort
    import tract

    axes = {n: {0: "B", 1: "S"} for n in NAMES[:-1]} | {"s0": {0: "B"}}
    example = inputs(4, heads, width)
    files = {}
    # runtime "any": the Scan with a matmul step (onnxruntime's faster one); "tract-onnx": the elementwise step
    for runtime, label, lowering in (("onnxruntime", "contrib op com.microsoft::GatedDeltaNet", "contrib"),
                                     ("any", "portable Scan (matmul step)", "scan"),
                                     ("tract-onnx", "tract scan", "scan")):
        path = folder / f"{runtime}.onnx"
        report = gdn_export.export(Rule(), example, path, format="onnx", runtime=runtime, input_names=NAMES,
                                   output_names=["o", "state"], dynamic_axes=axes,
                                   lowering="native" if lowering == "contrib" else "auto")
        assert report.lowerings() == [lowering], report
        files[label] = path

    def feed(xs):
        return {n: np.ascontiguousarray(x.numpy()) for n, x in zip(NAMES, xs)}

    methods = {}
    for count in threads:
        for label, path in files.items():
            if label == "tract scan":
                continue
            options = ort.SessionOptions()
            options.intra_op_num_threads = count
            options.inter_op_num_threads = 1
            session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
            methods[f"onnxruntime {label}, {count} thr"] = lambda xs, s=session: s.run(None, feed(xs))
    plan = tract.onnx().load(str(files["tract scan"])).into_model().into_runnable()
    methods["tract-onnx portable Scan (elementwise step)"] = lambda xs: plan.run(
        [np.ascontiguousarray(x.numpy()) for x in xs])
    return methods


def convert_memory(checkpoint: str, dtype: str) -> None:
    """One conversion per mode, one at a time (a large one holds the model several times over in memory)."""
    import filecmp
    import os
    import shutil
    import subprocess
    import time

    with tempfile.TemporaryDirectory(dir=Path(checkpoint).parent) as tmp:
        outs = {}
        print("| conversion | dtype | wall s | peak RSS GiB (ru_maxrss) | files GB |\n|---|---|---|---|---|")
        for mode, extra in (("streamed", []), ("in memory", ["--in-memory"])):
            out = Path(tmp) / mode.replace(" ", "_") / "m.onnx"
            command = [shutil.which("gdn-export") or "gdn-export", "convert", checkpoint, "-o", str(out), "--no-check",
                       "--dtype", dtype, *extra]
            start = time.perf_counter()
            child = subprocess.Popen(command, stdout=subprocess.DEVNULL)
            _, status, usage = os.wait4(child.pid, 0)
            wall = time.perf_counter() - start
            if os.waitstatus_to_exitcode(status) != 0:
                raise SystemExit(f"{' '.join(command)} failed")
            outs[mode] = out
            size = sum(p.stat().st_size for p in out.parent.iterdir())
            print(f"| {mode} | {dtype} | {wall:.1f} | {usage.ru_maxrss / 2**20:.2f} | {size / 1e9:.2f} |", flush=True)
        a, b = outs["streamed"].parent, outs["in memory"].parent
        names = ("m.onnx", "m.onnx.data")
        same = all((a / n).is_file() and (b / n).is_file() and filecmp.cmp(a / n, b / n, shallow=False) for n in names)
        print(f"same files: {same}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--seq", type=int, nargs="+", default=[1, 128, 1024])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--budget", type=float, default=3.0, help="seconds per measurement")
    parser.add_argument("--realistic", action="store_true", help="end to end on the realistic-size Qwen3.5")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--decode", type=int, default=16)
    parser.add_argument("--convert-memory", metavar="CKPT", help="peak RSS of a conversion, streamed and in memory")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    if args.convert_memory:
        return convert_memory(args.convert_memory, args.dtype)
    if args.realistic:
        return realistic(args)
    rows: dict[str, dict[int, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        methods = onnx_methods(Path(tmp), args.heads, args.width, args.threads)
        for seq in args.seq:
            xs = inputs(seq, args.heads, args.width, seed=seq)
            for label, fn in methods.items():
                rows.setdefault(label, {})[seq] = median_ms(lambda: fn(xs), args.budget)
    print(f"H={args.heads}, K=V={args.width}, B=1, f32; median ms per call")
    print("| runtime / form | " + " | ".join(f"S={s}" for s in args.seq) + " |")
    print("|---|" + "---|" * len(args.seq))
    for label, values in rows.items():
        print(f"| {label} | " + " | ".join(f"{values[s]:.3g}" for s in args.seq) + " |")


if __name__ == "__main__":
    main()
