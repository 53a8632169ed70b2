"""Serving throughput: N concurrent requests through the batched ``Engine`` against the same N requests run one after
another through ``Session``, in one run.

    python benchmarks/bench_serving.py CHECKPOINT_DIR [--concurrency 1,2,4,8,16] [--prompt 128] [--new 64]
                                       [--workers 2] [--prefill-piece 128[,64...]] [--prefill-rows 1[,2...]]
                                       [--quantize q4_0] [--keep DIR]

The checkpoint is converted twice with ``gdn-export convert --no-check --logits last``: once plainly (the Session
baseline, the fastest one-request path) and once with ``--serving`` (the Engine's graph). Build the realistic
580M-shape checkpoint with ``python benchmarks/large_checkpoint.py DIR --layers 24 --hidden 1024 --vocab 32000``.

For each N: N requests (random prompts of --prompt tokens, --new greedy tokens each, every token generated) all
submitted at once to an Engine of N slots and --workers threads (tract's Python calls are single-threaded: a
thread per core), then the same N requests one after another through one Session (one thread: how a
``Session`` serves). Reported: total generated tokens/s, time to first token (from submission; the sequential run's
k-th request waits for the k-1 before it) and inter-token latency, p50 and p99, and the throughput ratio. Every
request's tokens are checked equal between the two runs. Planning (once per batch-size bucket) is done before the
clock starts. With several ``--prefill-piece`` sizes (prompt tokens per prefill call, multiples of 64), an Engine
runs at each against the same sequential run: a smaller piece stalls a worker's decode rows for less time (the
ITL p99) at some cost in prefill speed. With several ``--prefill-rows`` (the Engine's ``prefill_rows``: prompts whose
pieces run in one call, each row its own length), each is run too (every piece size with every row count).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gdn_export.run.generation import SamplingParams, TokenRequest  # noqa: E402
from gdn_export.run.serving import Engine  # noqa: E402
from gdn_export.run.session import Session  # noqa: E402


def convert(checkpoint: Path, out: Path, serving: bool, quantize: str | None) -> float:
    if out.is_file():
        return 0.0
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "gdn_export.cli", "convert", str(checkpoint), "-o", str(out), "--force",
                    "--no-check", "--logits", "last", *(["--serving"] if serving else []),
                    *(["--quantize", quantize] if quantize else [])], check=True, capture_output=True)
    return time.perf_counter() - start


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


def sequential(session: Session, prompts: list[tuple[int, ...]], new: int, counts: list[int]) -> dict[int, dict]:
    """The requests one after another through ``session`` (greedy); for each n of ``counts``, the first n of them
    (exactly the run of n requests one after another): total seconds, TTFT and ITL lists, tokens."""
    start = time.perf_counter()
    ttft, itl, tokens, ends = [], [], [], []
    for prompt in prompts:
        session.reset()
        logits = session.prefill(np.asarray([prompt]))[0, -1]
        last = time.perf_counter()
        ttft.append(last - start)
        out = []
        for step in range(new):
            out.append(int(np.argmax(logits)))
            if step + 1 < new:
                logits = session.decode(np.asarray([[out[-1]]]))[0, -1]
                now = time.perf_counter()
                itl.append((len(tokens), now - last))
                last = now
        tokens.append(out)
        ends.append(time.perf_counter() - start)
    return {n: dict(seconds=ends[n - 1], ttft=ttft[:n], itl=[gap for i, gap in itl if i < n], tokens=tokens[:n])
            for n in counts}


def batched(engine: Engine, prompts: list[tuple[int, ...]], new: int) -> dict:
    """The requests submitted at once to ``engine``, read as they come (one reader thread each)."""
    import threading

    ttft, itl, tokens = [0.0] * len(prompts), [], [None] * len(prompts)
    lock = threading.Lock()
    start = time.perf_counter()
    streams = [engine.submit(TokenRequest(p, new, SamplingParams(temperature=0.0))) for p in prompts]

    def read(i):
        out, gaps, last = [], [], None
        for event in streams[i]:
            now = time.perf_counter()
            if last is None:
                ttft[i] = now - start
            else:
                gaps.append(now - last)
            last = now
            out.append(event.token_id)
        tokens[i] = out
        with lock:
            itl.extend(gaps)

    readers = [threading.Thread(target=read, args=(i,)) for i in range(len(prompts))]
    for reader in readers:
        reader.start()
    for reader in readers:
        reader.join()
    return dict(seconds=time.perf_counter() - start, ttft=ttft, itl=itl, tokens=tokens)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--concurrency", default="1,2,4,8,16")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--prefill-piece", default="128", help="the Engine's prefill_piece; a comma list runs each")
    parser.add_argument("--prefill-rows", default="1", help="the Engine's prefill_rows; a comma list runs each")
    parser.add_argument("--quantize", choices=["q4_0"], default=None)
    parser.add_argument("--keep", type=Path, help="write (and reuse) the archives here (default: a temporary folder)")
    args = parser.parse_args(argv)
    counts = [int(n) for n in args.concurrency.split(",")]
    vocab = json.loads((args.checkpoint / "config.json").read_text())["vocab_size"]
    folder = args.keep or Path(tempfile.mkdtemp(prefix="gdn_serving_"))
    folder.mkdir(parents=True, exist_ok=True)
    suffix = f"-{args.quantize}" if args.quantize else ""
    plain, served = folder / f"plain{suffix}.nnef.tgz", folder / f"serving{suffix}.nnef.tgz"
    seconds = convert(args.checkpoint, plain, False, args.quantize), convert(args.checkpoint, served, True,
                                                                              args.quantize)
    print(f"converted in {seconds[0]:.0f} s (plain) and {seconds[1]:.0f} s (--serving)", flush=True)
    rng = np.random.default_rng(0)
    prompts = [tuple(int(t) for t in rng.integers(0, vocab, args.prompt)) for _ in range(max(counts))]

    warm_up = tuple(int(t) for t in rng.integers(0, vocab, args.prompt))  # a whole piece: first calls are slower
    session = Session(plain)
    session.prefill(np.asarray([warm_up]))  # plans B=1
    session.decode(np.asarray([[warm_up[0]]]))
    baseline = sequential(session, prompts, args.new, counts)
    del session

    rows, planned = [], None
    slots = max(counts)
    configurations = [(int(piece), int(prefill_rows)) for piece in args.prefill_piece.split(",")
                      for prefill_rows in args.prefill_rows.split(",")]
    for piece, prefill_rows in configurations:
        with Engine(served, slots=slots, workers=min(args.workers, slots), prefix_cache_mib=0, plan_now=True,
                    prefill_piece=piece, prefill_rows=prefill_rows) as engine:
            list(engine.submit(TokenRequest(warm_up, 2)))  # warm-up, as the Session's
            for n in counts:
                result = batched(engine, prompts[:n], args.new)
                alone = baseline[n]
                same = result["tokens"] == alone["tokens"]
                rows.append((f"{piece} x {engine.prefill_rows}", n, result, alone, same))
                print(f"prefill piece {piece} x {engine.prefill_rows} rows, N={n}: "
                      f"{n * args.new / result['seconds']:.1f} tok/s batched, "
                      f"{n * args.new / alone['seconds']:.1f} sequential, tokens equal: {same}", flush=True)
            planned = engine.plans.planned
    print(f"\n{args.checkpoint.name}{' ' + args.quantize if args.quantize else ' f32'}: prompt {args.prompt}, "
          f"{args.new} new tokens each, Engine with {min(args.workers, slots)} workers and {slots} slots (plans for "
          f"batches of {planned}), Session one request at a time; peak RSS "
          f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6:.1f} GB")
    print("| N | prefill piece x rows | Engine tok/s | Session tok/s | x | TTFT p50 / p99 s (Engine) | TTFT p50 / p99 s (Session) | "
          "ITL p50 / p99 ms (Engine) | ITL p50 / p99 ms (Session) | same tokens |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for piece, n, result, alone, same in rows:
        ours, theirs = n * args.new / result["seconds"], n * args.new / alone["seconds"]
        print(f"| {n} | {piece} | {ours:.1f} | {theirs:.1f} | {ours / theirs:.2f}x | "
              f"{percentile(result['ttft'], 50):.2f} / {percentile(result['ttft'], 99):.2f} | "
              f"{percentile(alone['ttft'], 50):.2f} / {percentile(alone['ttft'], 99):.2f} | "
              f"{1e3 * percentile(result['itl'], 50):.0f} / {1e3 * percentile(result['itl'], 99):.0f} | "
              f"{1e3 * percentile(alone['itl'], 50):.0f} / {1e3 * percentile(alone['itl'], 99):.0f} | {same} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
