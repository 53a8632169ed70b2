"""Prefill and decode speed of one checkpoint converted at float32, float16 and Q4_0, measured side by side.

    python benchmarks/bench_quantized.py CHECKPOINT_DIR [--prompt 128] [--decode 32] [--formats float32,float16,q4_0]
                                         [--logits all|last] [--keep DIR]

Each format is converted with `gdn-export convert --no-check` (Q4_0: `--quantize q4_0`, float32 activations), then
run through `Session` on one thread (tract's Python bindings run one): a prefill of --prompt tokens, then --decode
single-token steps, each timed after a warm-up. Prints one table with tokens/s and the ratio to float32. Build a
realistic checkpoint with `python benchmarks/large_checkpoint.py DIR --layers 24 --hidden 1024 --vocab 32000`
(Qwen3.5 0.8B's text model, tied: `--layers 24 --hidden 1024 --intermediate 3584 --tied`). `--logits last`
converts with `--logits last` (the head on the last position only, as generation and llama.cpp run it).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gdn_export.run.session import Session  # noqa: E402

FORMATS = {"float32": ["--dtype", "float32"], "float16": ["--dtype", "float16"],
           "q4_0": ["--dtype", "float32", "--quantize", "q4_0"]}


def convert(checkpoint: Path, out: Path, fmt: str, logits: str = "all") -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "gdn_export.cli", "convert", str(checkpoint), "-o", str(out), "--force",
                    "--no-check", "--logits", logits, *FORMATS[fmt]], check=True, capture_output=True)
    return time.perf_counter() - start


def measure(archive: Path, vocab: int, prompt: int, decode: int) -> tuple[float, float]:
    session = Session(archive)
    tokens = np.random.default_rng(0).integers(0, vocab, (1, prompt + decode + 1))
    session.prefill(tokens[:, :8])  # warm-up: plan and first call
    session.reset()
    start = time.perf_counter()
    session.prefill(tokens[:, :prompt])
    prefill = prompt / (time.perf_counter() - start)
    session.decode(tokens[:, prompt:prompt + 1])  # warm-up of the one-token plan
    start = time.perf_counter()
    for t in range(prompt + 1, prompt + 1 + decode):
        session.decode(tokens[:, t:t + 1])
    return prefill, decode / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--decode", type=int, default=32)
    parser.add_argument("--formats", default="float32,float16,q4_0")
    parser.add_argument("--logits", choices=["all", "last"], default="all")
    parser.add_argument("--keep", type=Path, help="write the archives here (default: a temporary folder)")
    args = parser.parse_args(argv)
    import json

    vocab = json.loads((args.checkpoint / "config.json").read_text())["vocab_size"]
    folder = args.keep or Path(tempfile.mkdtemp(prefix="gdn_quantized_"))
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for fmt in args.formats.split(","):
        out = folder / f"model-{fmt}.nnef.tgz"
        seconds = convert(args.checkpoint, out, fmt, args.logits)
        prefill, decode = measure(out, vocab, args.prompt, args.decode)
        rows.append((fmt, out.stat().st_size / 1e9, seconds, prefill, decode))
    base = {r[0]: r for r in rows}.get("float32", rows[0])
    print(f"{args.checkpoint.name}: prefill {args.prompt} tokens, {args.decode} decode steps, 1 thread, logits "
          f"{args.logits}")
    print("| format | archive GB | convert s | prefill tok/s | x f32 | decode tok/s | x f32 |")
    print("|---|---|---|---|---|---|---|")
    for fmt, size, seconds, prefill, decode in rows:
        print(f"| {fmt} | {size:.2f} | {seconds:.0f} | {prefill:.1f} | {prefill / base[3]:.2f} | {decode:.2f} | "
              f"{decode / base[4]:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
