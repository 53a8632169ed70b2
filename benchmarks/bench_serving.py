"""Serving throughput: N concurrent requests through the batched ``Engine`` against the same N requests run one after
another through ``Session``, in one run.

    python benchmarks/bench_serving.py CHECKPOINT_DIR [--concurrency 1,2,4,8,16] [--prompt 128] [--new 64]
                                       [--workers 2] [--prefill-piece 128[,64...]] [--prefill-rows 1[,2...]]
                                       [--quantize q4_0] [--plans one[,per-batch]] [--keep DIR]
                                       [--session-archive plain|serving]

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

Each Engine configuration runs in a process of its own, so its peak resident memory (``VmHWM``: the Engine's plan,
the slots, Python and numpy; what ``gdn-export serve`` would hold) is its own; the table gives it beside the
archive's weight bytes. ``--plans one,per-batch`` runs the Engine's default (one plan for every batch size: one
packed copy of the weights) and the earlier scheme (a plan per batch-size bucket, ``Engine(one_plan=False)``) side by
side. ``--session-archive serving`` runs the Session baseline on the serving archive (no plain archive needed: for a
``--keep`` folder that holds only ``serving.nnef.tgz``).
"""

from __future__ import annotations

import argparse
import json
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


def peak_rss_bytes() -> int:
    """This process's peak resident memory (``VmHWM``), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def weight_bytes(archive: Path) -> int:
    """The bytes of the archive's tensors (its ``.dat`` members, uncompressed)."""
    import tarfile

    with tarfile.open(archive) as tar:
        return sum(member.size for member in tar if member.name.endswith(".dat"))


def engine_run(job: dict) -> dict:
    """One Engine configuration (a child process's work): planned, warmed up, then each N of ``job["counts"]``."""
    prompts = [tuple(p) for p in job["prompts"]]
    results = {}
    with Engine(job["archive"], slots=job["slots"], workers=job["workers"], prefix_cache_mib=0, plan_now=True,
                prefill_piece=job["piece"], prefill_rows=job["rows"], one_plan=job["one_plan"]) as engine:
        list(engine.submit(TokenRequest(tuple(job["warm_up"]), 2)))  # warm-up, as the Session's
        for n in job["counts"]:
            results[n] = batched(engine, prompts[:n], job["new"])
            print(f"  N={n}: {n * job['new'] / results[n]['seconds']:.1f} tok/s", file=sys.stderr, flush=True)
        planned, rows = engine.plans.planned, engine.prefill_rows
    return dict(results=results, planned=planned, rows=rows, peak_rss=peak_rss_bytes())


def in_child(job: dict) -> dict:
    """``engine_run(job)`` in a fresh process (its own peak resident memory)."""
    done = subprocess.run([sys.executable, __file__, "--child"], input=json.dumps(job), capture_output=True,
                          text=True)
    if done.returncode:
        raise RuntimeError(f"the Engine run failed:\n{done.stderr[-4000:]}")
    result = json.loads(done.stdout)
    result["results"] = {int(n): r for n, r in result["results"].items()}
    return result


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--child"]:
        print(json.dumps(engine_run(json.loads(sys.stdin.read()))))
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--concurrency", default="1,2,4,8,16")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--prefill-piece", default="128", help="the Engine's prefill_piece; a comma list runs each")
    parser.add_argument("--prefill-rows", default="1", help="the Engine's prefill_rows; a comma list runs each")
    parser.add_argument("--plans", default="one", help="one (one plan for every batch size), per-batch (a plan per "
                        "batch-size bucket, the earlier scheme), or both: one,per-batch")
    parser.add_argument("--quantize", choices=["q4_0"], default=None)
    parser.add_argument("--keep", type=Path, help="write (and reuse) the archives here (default: a temporary folder)")
    parser.add_argument("--session-archive", choices=["plain", "serving"], default="plain",
                        help="the archive the Session baseline runs (plain: converted without --serving)")
    args = parser.parse_args(argv)
    counts = [int(n) for n in args.concurrency.split(",")]
    vocab = json.loads((args.checkpoint / "config.json").read_text())["vocab_size"]
    folder = args.keep or Path(tempfile.mkdtemp(prefix="gdn_serving_"))
    folder.mkdir(parents=True, exist_ok=True)
    suffix = f"-{args.quantize}" if args.quantize else ""
    plain, served = folder / f"plain{suffix}.nnef.tgz", folder / f"serving{suffix}.nnef.tgz"
    seconds = (0.0 if args.session_archive == "serving" else convert(args.checkpoint, plain, False, args.quantize),
               convert(args.checkpoint, served, True, args.quantize))
    if args.session_archive == "serving":
        plain = served
    print(f"converted in {seconds[0]:.0f} s (plain) and {seconds[1]:.0f} s (--serving)", flush=True)
    rng = np.random.default_rng(0)
    prompts = [tuple(int(t) for t in rng.integers(0, vocab, args.prompt)) for _ in range(max(counts))]

    warm_up = tuple(int(t) for t in rng.integers(0, vocab, args.prompt))  # a whole piece: first calls are slower
    session = Session(plain)
    session.prefill(np.asarray([warm_up]))  # plans B=1
    session.decode(np.asarray([[warm_up[0]]]))
    baseline = sequential(session, prompts, args.new, counts)
    del session

    rows, planned = [], {}
    slots = max(counts)
    weights = weight_bytes(served)
    configurations = [(plans, int(piece), int(prefill_rows)) for plans in args.plans.split(",")
                      for piece in args.prefill_piece.split(",") for prefill_rows in args.prefill_rows.split(",")]
    for plans, piece, prefill_rows in configurations:
        if plans not in ("one", "per-batch"):
            parser.error(f"--plans takes one and per-batch, got {plans!r}")
        job = dict(archive=str(served), slots=slots, workers=min(args.workers, slots), piece=piece, rows=prefill_rows,
                   one_plan=plans == "one", prompts=prompts, warm_up=warm_up, new=args.new, counts=counts)
        print(f"Engine, {plans} plan{'s' if plans != 'one' else ''}, prefill piece {piece} x {prefill_rows} rows:",
              flush=True)
        run = in_child(job)
        planned[plans] = run["planned"]
        for n in counts:
            result, alone = run["results"][n], baseline[n]
            same = result["tokens"] == alone["tokens"]
            rows.append((plans, f"{piece} x {run['rows']}", n, result, alone, same, run["peak_rss"]))
            print(f"  N={n}: {n * args.new / result['seconds']:.1f} tok/s batched, "
                  f"{n * args.new / alone['seconds']:.1f} sequential, tokens equal: {same}", flush=True)
    print(f"\n{args.checkpoint.name}{' ' + args.quantize if args.quantize else ''}: prompt {args.prompt}, "
          f"{args.new} new tokens each, Engine with {min(args.workers, slots)} workers and {slots} slots (plans: "
          f"{planned}), Session one request at a time on the {args.session_archive} archive; the archive's weights "
          f"{weights / 1e9:.2f} GB; peak RSS of each Engine's process")
    print("| plans | N | prefill piece x rows | Engine tok/s | Session tok/s | x | TTFT p50 / p99 s (Engine) | "
          "TTFT p50 / p99 s (Session) | ITL p50 / p99 ms (Engine) | ITL p50 / p99 ms (Session) | same tokens | "
          "peak RSS GB (x weights) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for plans, piece, n, result, alone, same, peak in rows:
        ours, theirs = n * args.new / result["seconds"], n * args.new / alone["seconds"]
        print(f"| {plans} | {n} | {piece} | {ours:.1f} | {theirs:.1f} | {ours / theirs:.2f}x | "
              f"{percentile(result['ttft'], 50):.2f} / {percentile(result['ttft'], 99):.2f} | "
              f"{percentile(alone['ttft'], 50):.2f} / {percentile(alone['ttft'], 99):.2f} | "
              f"{1e3 * percentile(result['itl'], 50):.0f} / {1e3 * percentile(result['itl'], 99):.0f} | "
              f"{1e3 * percentile(alone['itl'], 50):.0f} / {1e3 * percentile(alone['itl'], 99):.0f} | {same} | "
              f"{peak / 1e9:.2f} ({peak / weights:.2f}x) |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
