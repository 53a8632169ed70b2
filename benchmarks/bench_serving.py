"""Serving throughput: N concurrent requests through the batched ``Engine`` against the same N requests run one after
another through ``Session``, in one run.

    python benchmarks/bench_serving.py CHECKPOINT_DIR [--concurrency 1,2,4,8,16] [--prompt 128] [--new 64]
                                       [--workers 2] [--prefill-piece 128[,64...]] [--prefill-rows 1[,2...]]
                                       [--dtype float32|float16] [--quantize q4_0|int8|f16]
                                       [--plans one[,per-batch][,serve]] [--rounds R] [--cpus 0,1] [--json OUT]
                                       [--keep DIR]
                                       [--session-archive plain|serving]

The checkpoint is converted twice with ``gdn-export convert --no-check --logits last --dtype D [--quantize Q]``:
once plainly (the Session baseline, the fastest one-request path) and once with ``--serving`` (the Engine's graph).
Build the realistic Qwen3.5 0.8B-shape checkpoint as ``bench_vs_llamacpp.py`` does (``build_checkpoint``: 24
layers, hidden 1024, intermediate 3584, vocab 151936, tied), or the 580M shape with ``python
benchmarks/large_checkpoint.py DIR --layers 24 --hidden 1024 --vocab 32000``.

For each N: N requests (random prompts of --prompt tokens, --new greedy tokens each, every token generated) all
submitted at once to an Engine of N slots and --workers threads (tract's Python calls are single-threaded: a
thread per core), against the same N requests one after another through one Session (one thread: how a
``Session`` serves; the "sequential" rows). Reported: total generated tokens/s and its ratio to the sequential
run's at the same N (``x seq``: the Engine's gain over serving one request at a time), time to first token (from
submission; the sequential run's k-th request waits for the k-1 before it) and inter-token latency, p50 and p99.
Every request's tokens are checked equal to the sequential run's. On a shared machine a run gets only a share of the
cores, which tokens/s hides: each row also gives tokens per CPU second of its process (every thread). Planning is done before the clock starts. With
several ``--prefill-piece`` sizes (prompt tokens per prefill call, multiples of 64), an Engine runs at each: a
smaller piece stalls a worker's decode rows for less time (the ITL p99) at some cost in prefill speed. With several
``--prefill-rows`` (the Engine's ``prefill_rows``: prompts whose pieces run in one call, each row its own length),
each is run too (every piece size with every row count).

Every run (the sequential baseline and each Engine configuration) is a process of its own, so its peak resident
memory (``VmHWM``: the plan, the slots, Python and numpy; what ``gdn-export serve`` would hold) is its own; each row
gives it beside the serving archive's weight bytes and the bound ``1.5 x weights + 1 GiB`` (issue 23).
``--plans one,per-batch`` runs the Engine's default (one plan for every batch size: one packed copy of the weights)
and the earlier scheme (a plan per batch-size bucket, ``Engine(one_plan=False)``) side by side; ``serve`` adds
``gdn-export serve --slots N --workers W`` itself (its own process, prefix cache on), fed N ``/v1/completions``
requests of token ids at once over HTTP (tokens/s and the server's peak RSS; no TTFT or ITL, no token check).
``--rounds R`` runs everything R times, every other round in reverse order (ABBA: drift between runs on a shared
machine falls on every configuration alike), and reports medians. ``--cpus`` pins the whole run (children
included). ``--session-archive serving`` runs the Session baseline on the serving archive (no plain archive
needed: for a ``--keep`` folder that holds only ``serving*.nnef.tgz``).
"""

from __future__ import annotations

import argparse
import json
import os
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

GIB = 1 << 30


def convert(checkpoint: Path, out: Path, serving: bool, options: list[str]) -> float:
    """``gdn-export convert --no-check --logits last [--serving] OPTIONS`` unless ``out`` exists: seconds."""
    if out.is_file():
        return 0.0
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "gdn_export.cli", "convert", str(checkpoint), "-o", str(out), "--force",
                    "--no-check", "--logits", "last", *(["--serving"] if serving else []), *options], check=True,
                   capture_output=True)
    return time.perf_counter() - start


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


def sequential(session: Session, prompts: list[tuple[int, ...]], new: int, counts: list[int]) -> dict[int, dict]:
    """The requests one after another through ``session`` (greedy); for each n of ``counts``, the first n of them
    (exactly the run of n requests one after another): total seconds, TTFT and ITL lists, tokens."""
    start, cpu = time.perf_counter(), time.process_time()
    ttft, itl, tokens, ends, cpus = [], [], [], [], []
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
        cpus.append(time.process_time() - cpu)
    return {n: dict(seconds=ends[n - 1], cpu=cpus[n - 1], ttft=ttft[:n], itl=[gap for i, gap in itl if i < n],
                    tokens=tokens[:n]) for n in counts}


def batched(engine: Engine, prompts: list[tuple[int, ...]], new: int) -> dict:
    """The requests submitted at once to ``engine``, read as they come (one reader thread each)."""
    import threading

    ttft, itl, tokens = [0.0] * len(prompts), [], [None] * len(prompts)
    lock = threading.Lock()
    start, cpu = time.perf_counter(), time.process_time()
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
    return dict(seconds=time.perf_counter() - start, cpu=time.process_time() - cpu, ttft=ttft, itl=itl,
                tokens=tokens)


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


def session_run(job: dict) -> dict:
    """The sequential baseline (a child process's work): one ``Session``, warmed up, the requests one after another."""
    prompts = [tuple(p) for p in job["prompts"]]
    session = Session(job["archive"])
    session.prefill(np.asarray([job["warm_up"]]))  # plans B=1
    session.decode(np.asarray([[job["warm_up"][0]]]))
    results = sequential(session, prompts, job["new"], job["counts"])
    return dict(results=results, planned=["B=1"], rows=1, peak_rss=peak_rss_bytes())


def serve_run(job: dict) -> dict:
    """``gdn-export serve`` on the serving archive (its own process, as a user starts it; the Engine's defaults but
    ``--slots``, ``--workers``, ``--prefill-piece``, ``--prefill-rows``), then for each N, N ``/v1/completions``
    requests of token ids at once (greedy, ``ignore_eos``): total tokens/s, and the server's peak RSS at the end
    (``VmHWM``, its prefix cache on as served). No TTFT or ITL (the answers are not streamed); the tokens are not
    compared (the answer carries text)."""
    import threading

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from server_bounds import kib, request, start_server

    log = Path(tempfile.mkdtemp(prefix="gdn_serving_serve_")) / "serve.log"
    process, base = start_server([job["archive"], "--slots", str(job["slots"]), "--workers", str(job["workers"]),
                                  "--prefill-piece", str(job["piece"]), "--prefill-rows", str(job["rows"])], {}, log,
                                 timeout=900)
    try:
        def complete(prompt, new):
            status, answer = request(base, "POST", "/v1/completions", json.dumps(
                {"prompt": list(prompt), "max_tokens": new, "temperature": 0, "ignore_eos": True}))
            if status != 200:
                raise RuntimeError(f"the server answered {status}: {answer}")
            return answer["usage"]["completion_tokens"]

        complete(job["warm_up"], 2)
        results = {}
        for n in job["counts"]:
            produced = [0] * n
            start = time.perf_counter()

            def one(i, n=n, produced=produced):
                produced[i] = complete(job["prompts"][i], job["new"])

            threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            seconds = time.perf_counter() - start
            if sum(produced) != n * job["new"]:
                raise RuntimeError(f"the server produced {sum(produced)} tokens, not {n * job['new']}")
            results[n] = dict(seconds=seconds, cpu=None, ttft=[], itl=[], tokens=None)
            print(f"  N={n}: {n * job['new'] / seconds:.1f} tok/s", file=sys.stderr, flush=True)
        peak = kib(process.pid, "VmHWM") * 1024
    finally:
        process.terminate()
        process.wait(60)
    return dict(results=results, planned=["B, S symbolic"], rows=job["rows"], peak_rss=peak)


RUNS = {"engine": engine_run, "session": session_run, "serve": serve_run}


def in_child(job: dict) -> dict:
    """``RUNS[job["kind"]](job)`` in a fresh process (its own peak resident memory)."""
    done = subprocess.run([sys.executable, __file__, "--child"], input=json.dumps(job), capture_output=True,
                          text=True)
    if done.returncode:
        raise RuntimeError(f"the {job['kind']} run failed:\n{done.stderr[-4000:]}")
    sys.stderr.write(done.stderr)
    result = json.loads(done.stdout)
    result["results"] = {int(n): r for n, r in result["results"].items()}
    return result


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--child"]:
        job = json.loads(sys.stdin.read())
        print(json.dumps(RUNS[job["kind"]](job)))
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
                        "batch-size bucket, the earlier scheme), serve (`gdn-export serve` over HTTP: one plan), or "
                        "a comma list of them: one,per-batch,serve")
    parser.add_argument("--dtype", choices=["float32", "float16"], default="float32")
    parser.add_argument("--quantize", choices=["q4_0", "int8", "f16"], default=None)
    parser.add_argument("--rounds", type=int, default=1, help="run the sequential baseline and every configuration "
                        "this many times, interleaved (every other round in reverse order); medians")
    parser.add_argument("--cpus", help="pin this script and its children to these cores (a list for "
                        "os.sched_setaffinity, e.g. 0,1)")
    parser.add_argument("--json", type=Path, help="write every run's measurements here")
    parser.add_argument("--keep", type=Path, help="write (and reuse) the archives here (default: a temporary folder)")
    parser.add_argument("--session-archive", choices=["plain", "serving"], default="plain",
                        help="the archive the Session baseline runs (plain: converted without --serving)")
    args = parser.parse_args(argv)
    if args.cpus:
        os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})
    counts = [int(n) for n in args.concurrency.split(",")]
    plans = args.plans.split(",")
    if not plans or any(p not in ("one", "per-batch", "serve") for p in plans):
        parser.error(f"--plans takes one, per-batch and serve, got {args.plans!r}")
    vocab = json.loads((args.checkpoint / "config.json").read_text())["vocab_size"]
    folder = args.keep or Path(tempfile.mkdtemp(prefix="gdn_serving_"))
    folder.mkdir(parents=True, exist_ok=True)
    fmt = args.quantize or {"float32": "f32", "float16": "f16-graph"}[args.dtype]
    suffix = "" if fmt == "f32" else f"-{fmt}"
    options = ["--dtype", args.dtype, *(["--quantize", args.quantize] if args.quantize else [])]
    plain, served = folder / f"plain{suffix}.nnef.tgz", folder / f"serving{suffix}.nnef.tgz"
    seconds = (0.0 if args.session_archive == "serving" else convert(args.checkpoint, plain, False, options),
               convert(args.checkpoint, served, True, options))
    if args.session_archive == "serving":
        plain = served
    print(f"converted in {seconds[0]:.0f} s (plain) and {seconds[1]:.0f} s (--serving)", flush=True)
    rng = np.random.default_rng(0)
    prompts = [tuple(int(t) for t in rng.integers(0, vocab, args.prompt)) for _ in range(max(counts))]
    warm_up = tuple(int(t) for t in rng.integers(0, vocab, args.prompt))  # a whole piece: first calls are slower

    slots = max(counts)
    workers = min(args.workers, slots)
    weights = weight_bytes(served)
    bound = 1.5 * weights + GIB
    common = dict(prompts=prompts, warm_up=warm_up, new=args.new, counts=counts)
    configurations = {"sequential": dict(kind="session", archive=str(plain), **common)}
    for kind in plans:
        for piece in args.prefill_piece.split(","):
            for prefill_rows in args.prefill_rows.split(","):
                name = f"{kind} {piece} x {prefill_rows}"
                configurations[name] = dict(kind="serve" if kind == "serve" else "engine", archive=str(served),
                                            slots=slots, workers=workers, piece=int(piece), rows=int(prefill_rows),
                                            one_plan=kind != "per-batch", **common)
    runs: dict[str, list[dict]] = {name: [] for name in configurations}
    for round_ in range(args.rounds):
        order = list(configurations) if round_ % 2 == 0 else list(reversed(configurations))
        for name in order:
            print(f"round {round_ + 1}, {name} (load average {os.getloadavg()[0]:.1f}):", flush=True)
            runs[name].append(in_child(configurations[name]))

    def median_seconds(name: str, n: int) -> float:
        return float(np.median([run["results"][n]["seconds"] for run in runs[name]]))

    def cpu_rate(name: str, n: int) -> float | None:
        """Tokens per CPU second (the process's, every thread): what a step costs, whatever share of the cores the
        run got on a shared machine."""
        cpus = [run["results"][n]["cpu"] for run in runs[name]]
        return None if None in cpus else n * args.new / float(np.median(cpus))

    if args.json:
        args.json.write_text(json.dumps(runs))

    def pooled(name: str, n: int, key: str) -> list[float]:
        return [value for run in runs[name] for value in run["results"][n][key]]

    planned = {name: runs[name][0]["planned"] for name in configurations if name != "sequential"}
    print(f"\n{args.checkpoint.name} {fmt}: prompt {args.prompt}, {args.new} new tokens each; Engine with {workers} "
          f"workers and {slots} slots (plans: {planned}); sequential: one Session, one request at a time, on the "
          f"{args.session_archive} archive; {args.rounds} round(s), interleaved, medians; the serving archive's "
          f"weights {weights / 1e9:.2f} GB, bound 1.5x + 1 GiB = {bound / 1e9:.2f} GB; peak RSS of each run's "
          f"process (VmHWM); x seq: tokens/s over the sequential run's at the same N; tok / CPU s: tokens per CPU "
          f"second of the run's process (x seq: over the sequential run's); pinned to "
          f"{sorted(os.sched_getaffinity(0))}, load average {os.getloadavg()[0]:.1f} at the end")
    print("| run | N | tok/s | x seq | tok / CPU s (x seq) | TTFT p50 / p99 s | ITL p50 / p99 ms | same tokens | "
          "peak RSS GB | x weights | within bound |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name in configurations:
        peak = max(run["peak_rss"] for run in runs[name])
        for n in counts:
            ours, theirs = n * args.new / median_seconds(name, n), n * args.new / median_seconds("sequential", n)
            ttft, itl = pooled(name, n, "ttft"), pooled(name, n, "itl")
            tokens = [run["results"][n]["tokens"] for run in runs[name]]
            same = ("n/a" if tokens[0] is None else
                    all(t == runs["sequential"][0]["results"][n]["tokens"] for t in tokens))
            timing = (f"{percentile(ttft, 50):.2f} / {percentile(ttft, 99):.2f} | "
                      f"{1e3 * percentile(itl, 50):.0f} / {1e3 * percentile(itl, 99):.0f}" if ttft else "- | -")
            rate, base = cpu_rate(name, n), cpu_rate("sequential", n)
            per_cpu = "-" if rate is None else f"{rate:.1f} ({rate / base:.2f}x)"
            print(f"| {name} | {n} | {ours:.1f} | {ours / theirs:.2f}x | {per_cpu} | {timing} | {same} | "
                  f"{peak / 1e9:.2f} | "
                  f"{peak / weights:.2f}x | {'yes' if peak <= bound else 'no'} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
