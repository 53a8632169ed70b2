"""The cost of a graph's contract, one tract call at a time: archives of one checkpoint side by side (an ordinary
graph against a serving graph, or serving graphs of two builds), in interleaved rounds of one run.

    python benchmarks/bench_serving_graph.py A.nnef.tgz B.nnef.tgz [...] [--prompt 128] [--past 128] [--rounds 5]
                                             [--batch 4]

Per archive, the calls a generation makes, timed alone (inputs built once: the values do not change tract's work):

- prefill: ``--prompt`` tokens at batch 1 from an empty past (a serving graph's caches hold one masked position);
- decode, B=1: one token at batch 1 after ``--past`` tokens (the plan with S symbolic, as ``Session`` and the
  Engine's one-row steps use);
- decode, B=``--batch``: one token per row after ``--past`` tokens, planned with S = 1 (the Engine's decode plans;
  serving archives only).

Median and fastest of ``--rounds`` rounds (each round calls every archive in turn), ms, and each archive's median
against the first's. Plans are built one kind at a time (each plan holds its own packed weights: the 580M shape is
~2.8 GB a plan in f32). One thread, as a ``Session``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gdn_export.run.reading import read_metadata  # noqa: E402
from gdn_export.run.runtime import load_tract_model, run_tract_tensors  # noqa: E402
from gdn_export.targets import numpy_dtype  # noqa: E402


def inputs_for(meta: dict, batch: int, tokens: int, past: int) -> list[np.ndarray]:
    """input_ids, a serving graph's past_len and seq_len, and states with ``past`` cached positions (a serving
    graph's at least one, masked)."""
    rng = np.random.default_rng(0)
    serving = "past_len" in meta["inputs"] or "seq_len" in meta["inputs"]
    cached = max(past, 1) if serving else past
    given = {"past_len": np.full(batch, past, np.int64), "seq_len": np.full(batch, tokens, np.int64)}
    inputs = [rng.integers(0, meta["vocab_size"], (batch, tokens)).astype(np.int64)]
    inputs += [given[name] for name in ("past_len", "seq_len") if name in meta["inputs"]]
    for spec in meta["states"]:
        shape = [batch if d == "B" else cached if d == "P" else d for d in spec["shape"]]
        inputs.append((0.1 * rng.standard_normal(shape)).astype(numpy_dtype(spec["dtype"])))
    return inputs


def timed(plans: dict, inputs: dict, rounds: int) -> dict[Path, list[float]]:
    times = {path: [] for path in plans}
    for path in plans:  # a first call each: tract's first run of a plan is slower
        run_tract_tensors(plans[path], inputs[path])
    for _ in range(rounds):
        for path, plan in plans.items():
            start = time.perf_counter()
            run_tract_tensors(plan, inputs[path])
            times[path].append(1e3 * (time.perf_counter() - start))
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("archives", type=Path, nargs="+")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--past", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    metas = {path: read_metadata(path) for path in args.archives}
    rows = []
    kinds = [("prefill", 1, args.prompt, 0, None), ("decode, B=1", 1, 1, args.past, None),
             (f"decode, B={args.batch}", args.batch, 1, args.past, 1)]
    for label, batch, tokens, past, s_fixed in kinds:
        paths = [p for p in args.archives if s_fixed is None or metas[p].get("serving")]
        if not paths:
            continue
        symbols = {"B": batch} if s_fixed is None else {"B": batch, "S": s_fixed}
        plans = {path: load_tract_model(path, symbols) for path in paths}
        inputs = {path: inputs_for(metas[path], batch, tokens, past) for path in paths}
        times = timed(plans, inputs, args.rounds)
        del plans
        first = statistics.median(times[paths[0]])
        for path in paths:
            median = statistics.median(times[path])
            rows.append((label, path.name, median, min(times[path]), median / first))
        print(f"{label}: done", flush=True)
    print(f"\n{args.rounds} rounds, prompt {args.prompt}, past {args.past}, one thread")
    print("| call | archive | median ms | fastest ms | x first |")
    print("|---|---|---|---|---|")
    for label, name, median, fastest, ratio in rows:
        print(f"| {label} | {name} | {median:.1f} | {fastest:.1f} | {ratio:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
