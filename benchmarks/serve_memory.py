"""When `gdn-export serve`'s resident memory peaks: its VmRSS sampled over time while it loads and plans, answers a
warm-up request, then N requests at once (issue 23: peak RSS at most 1.5x the archive's weights + 1 GiB).

    python benchmarks/serve_memory.py ARCHIVE [--requests 8] [--prompt 64] [--new 16] [--slots 8] [--workers 2]
                                      [-- SERVE OPTIONS...]

ARCHIVE: a serving archive (``gdn-export convert --serving``), e.g. the one ``bench_serving.py --keep DIR`` writes.
The server is ``gdn-export serve ARCHIVE --slots S --workers W`` (its own process; pin the whole run with taskset),
fed ``--requests`` ``/v1/completions`` of random token ids at once (greedy, ``ignore_eos``). Printed: the peak RSS
(``VmHWM``) against the bound, tokens/s and tokens per CPU second of the server over the N requests (on a shared
machine the steadier figure), then per phase (load and planning, the warm-up request, the N requests) the largest
sampled RSS (its anonymous and file-backed parts) and when, and a coarse trace. Peak RSS of one configuration
against another: run each in turn, interleaved (A B B A), and compare within the run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from server_bounds import request  # noqa: E402

GIB = 1 << 30


def status(pid: int) -> dict[str, float]:
    """VmRSS, VmHWM, RssAnon, RssFile of ``pid`` in GB."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key = line.split(":")[0]
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            fields[key] = int(line.split()[1]) * 1024 / 1e9
    return fields


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` (every thread)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("archive", type=Path)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--new", type=int, default=16)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("serve_options", nargs="*", help="more `gdn-export serve` options (after --)")
    args = parser.parse_args(argv)
    with tarfile.open(args.archive) as tar:
        weights = sum(member.size for member in tar if member.name.endswith(".dat"))
    vocab = json.loads(tarfile.open(args.archive).extractfile("gdn_export.json").read())["vocab_size"]
    bound = 1.5 * weights + GIB

    samples: list[tuple[float, dict]] = []
    stop = threading.Event()
    log = Path(tempfile.mkdtemp(prefix="gdn_serve_memory_")) / "serve.log"
    start = time.perf_counter()
    with open(log, "w") as err:
        process = subprocess.Popen([sys.executable, "-m", "gdn_export.cli", "serve", str(args.archive), "--slots",
                                    str(args.slots), "--workers", str(args.workers), *args.serve_options, "--port",
                                    "0"], stdout=subprocess.DEVNULL, stderr=err,
                                   env=dict(os.environ, PYTHONUNBUFFERED="1"))

    def sample() -> None:
        while not stop.is_set():
            try:
                samples.append((time.perf_counter() - start, status(process.pid)))
            except (OSError, ValueError):
                pass
            time.sleep(0.02)

    threading.Thread(target=sample, daemon=True).start()
    marks = []
    try:
        base = None
        while base is None:
            for line in log.read_text().splitlines():
                if " on http://127.0.0.1:" in line:
                    base = "http://127.0.0.1:" + line.split(" on http://127.0.0.1:")[1].split()[0]
            if process.poll() is not None:
                raise SystemExit(log.read_text())
            time.sleep(0.05)
        marks.append(("load and planning", time.perf_counter() - start))
        rng = np.random.default_rng(0)
        prompts = [[int(t) for t in rng.integers(0, vocab, args.prompt)] for _ in range(args.requests + 1)]

        def complete(prompt: list[int], new: int) -> None:
            code, answer = request(base, "POST", "/v1/completions", json.dumps(
                {"prompt": prompt, "max_tokens": new, "temperature": 0, "ignore_eos": True}))
            if code != 200:
                raise RuntimeError(f"the server answered {code}: {answer}")

        complete(prompts[-1], 2)
        marks.append(("warm-up request", time.perf_counter() - start))
        threads = [threading.Thread(target=complete, args=(prompts[i], args.new)) for i in range(args.requests)]
        cpu, begin = cpu_seconds(process.pid), time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        seconds, cpu = time.perf_counter() - begin, cpu_seconds(process.pid) - cpu
        marks.append((f"{args.requests} requests at once", time.perf_counter() - start))
        time.sleep(0.1)
        final = status(process.pid)
    finally:
        process.terminate()
        process.wait(60)
        stop.set()
    tokens = args.requests * args.new
    print(f"{args.archive.name}: weights {weights / 1e9:.3f} GB, bound 1.5x + 1 GiB = {bound / 1e9:.3f} GB; peak RSS "
          f"(VmHWM) {final['VmHWM']:.3f} GB ({'within' if final['VmHWM'] * 1e9 <= bound else 'over'}); "
          f"{args.requests} requests of {args.prompt} + {args.new} tokens: {tokens / seconds:.2f} tok/s, "
          f"{tokens / cpu:.2f} tok per CPU s of the server; load average {os.getloadavg()[0]:.1f}")
    begin = 0.0
    for name, end in marks:
        phase = [(t, s) for t, s in samples if begin <= t <= end]
        if phase:
            when, peak = max(phase, key=lambda item: item[1]["VmRSS"])
            print(f"  {name} ({begin:.1f}-{end:.1f} s): largest RSS {peak['VmRSS']:.3f} GB (anonymous "
                  f"{peak['RssAnon']:.3f}, file {peak['RssFile']:.3f}) at {when:.1f} s; {phase[-1][1]['VmRSS']:.3f} "
                  "GB at its end")
        begin = end
    step = max(1, len(samples) // 40)
    print("  trace (s: RSS GB): " + " ".join(f"{t:.0f}:{s['VmRSS']:.2f}" for t, s in samples[::step]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
