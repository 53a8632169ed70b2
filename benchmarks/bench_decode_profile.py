"""Where one decode step's (or prefill piece's) time goes, per op kind, for archives side by side (before / after).

    python benchmarks/bench_decode_profile.py A.nnef.tgz [B.nnef.tgz ...] [--labels before,after] [--past 128]
                                               [--rounds 5] [--steps 8] [--cpu 0] [--markdown]
    python benchmarks/bench_decode_profile.py A.nnef.tgz [B.nnef.tgz ...] --prefill 128 [--prompt 512] ...

Each archive runs in a ``Session`` (one tract thread, the plan ``Session`` decodes with: B = 1, S symbolic), prefills
``--past`` random tokens (the same for every archive), then:
- **profile**: tract's ``Runnable.profile_json`` of the next decode step (tract runs the step repeatedly and reports
  each top-level node's mean time per run; a scan's body is timed as its ``Scan`` node). Nodes are grouped by op kind
  (``OptMatMul``, ``Mul``, ``Scan``, ...) and by the part of the model their name says they belong to (the GDN
  core, the short conv, the MLP, attention, the head); "matmuls" are tract's matrix-product nodes and their operand
  packings (``OptMatMul``, ``OptMatMulPack``, ``EinSum``, ``MatMul``), "outside the matmuls" everything else. The
  profiled step is slower than an unprofiled one (a clock read per node): compare its rows across archives, and
  the whole step from the timing below.
- **timing**: decode tokens/s, ``--steps`` decode steps a round, ``--rounds`` rounds interleaved across the archives
  (so that a slow spell of a shared machine hits every archive alike); the median round, and the ratio to the
  first archive.

With ``--prefill N`` the profiled call is instead one prefill piece of N tokens from the empty state (the Session's
pieces are 128 tokens), and the timing is prefill tokens/s of a ``--prompt``-token prompt (``--rounds`` interleaved
rounds, the Session's own pieces).

Pin it (``taskset -c N``, or ``--cpu N``, which re-executes itself under taskset) and keep the archives of one
comparison in one run: only ratios measured side by side mean anything on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gdn_export.run.session import Session  # noqa: E402

MATMUL_OPS = re.compile(r"^(OptMatMul|OptMatMulPack|EinSum|MatMul|MatMulUnary|QMatMul|Lir)")
# what a node's name says it belongs to (gdn_export's lowerings and torch-to-nnef's names of Qwen3.5's modules)
PARTS = [
    ("GDN core (delta rule)", re.compile(r"^(core|cumsum)")),
    ("short conv", re.compile(r"^(convolved|conv)")),
    ("GDN projections, gate, norm", re.compile(r"^(in_proj|out_proj|norm|gate|z_|a_|b_|beta|g_|dt|A_log)")),
    ("MLP", re.compile(r"^mlp")),
    ("attention", re.compile(r"^(q_proj|k_proj|v_proj|o_proj|key|value|query|softmax|attn|rotary|cos|sin|q_|k_)")),
    ("head (logits)", re.compile(r"^logits")),
    ("unnamed products (attention scores, a tied head's halves)", re.compile(r"^matmul")),
    ("layer norms, residuals", re.compile(r"^(input_layernorm|post_attention_layernorm|x_add|x_|hidden)")),
]


def part_of(name: str) -> str:
    for part, pattern in PARTS:
        if pattern.search(name):
            return part
    return "other"


def is_matmul(op: str) -> bool:
    return bool(MATMUL_OPS.match(op))


def profile(session: Session, token: np.ndarray) -> dict:
    """One decode step's profile: {"ops": {op: s}, "parts": {part: [matmul s, outside s]}, "step": s}."""
    runnable = session._runnable(token.shape[0])
    states = session._states if session._states is not None else session._initial_states(token.shape[0])
    inputs = [token] + list(states)
    if session.takes_past_len or session.serving:
        raise SystemExit(f"{session.path}: a serving archive (past_len / seq_len inputs); profile an ordinary one")
    data = json.loads(runnable.profile_json(inputs))
    ops: dict[str, float] = defaultdict(float)
    parts: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for node in data["nodes"]:
        if node["qualified_id"][0]:  # inside a scan body: counted in its Scan node
            continue
        seconds = node.get("secs_per_iter") or 0.0
        ops[node["op_name"]] += seconds
        parts[part_of(node["node_name"])][0 if is_matmul(node["op_name"]) else 1] += seconds
    return {"ops": dict(ops), "parts": dict(parts), "step": data["profiling_info"]["secs_per_iter"],
            "iterations": data["profiling_info"]["iterations"]}


def prefill_timing(sessions: list[Session], tokens: np.ndarray, prompt: int, rounds: int) -> list[list[float]]:
    """Prefill tokens/s of every session on the same ``prompt`` tokens, ``rounds`` rounds, interleaved."""
    speeds = [[] for _ in sessions]
    for _ in range(rounds):
        for index, session in enumerate(sessions):
            session.reset()
            start = time.perf_counter()
            session.prefill(tokens[:, :prompt])
            speeds[index].append(prompt / (time.perf_counter() - start))
    return speeds


def timing(sessions: list[Session], tokens: np.ndarray, past: int, steps: int, rounds: int) -> list[list[float]]:
    """Decode tokens/s of every session, ``rounds`` rounds of ``steps`` steps, interleaved."""
    speeds = [[] for _ in sessions]
    position = past
    for _ in range(rounds):
        for index, session in enumerate(sessions):
            start = time.perf_counter()
            for t in range(position, position + steps):
                session.decode(tokens[:, t:t + 1])
            speeds[index].append(steps / (time.perf_counter() - start))
        position += steps
    return speeds


def table(headers: list[str], rows: list[list[str]], markdown: bool) -> str:
    if markdown:
        lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        return "\n".join(lines)
    widths = [max(len(str(x)) for x in column) for column in zip(headers, *rows)]

    def fmt(row: list[str]) -> str:  # the first column left-aligned, the numbers right-aligned
        return "  ".join(str(x).rjust(w) if i else str(x).ljust(w) for i, (x, w) in enumerate(zip(row, widths)))

    return "\n".join([fmt(headers), fmt(["-" * w for w in widths])] + [fmt(row) for row in rows])


def ratio(value: float, first: float) -> str:
    return f"{first / value:.2f}x" if value > 0 else "-"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("archives", nargs="+", type=Path)
    parser.add_argument("--labels", help="comma-separated names of the archives (default: their file names)")
    parser.add_argument("--past", type=int, default=128, help="tokens prefilled before the profiled step")
    parser.add_argument("--steps", type=int, default=8, help="decode steps per timing round")
    parser.add_argument("--rounds", type=int, default=5, help="timing rounds, interleaved across the archives")
    parser.add_argument("--prefill", type=int, help="profile one prefill piece of this many tokens from the empty "
                        "state instead of a decode step; time prefill of --prompt tokens")
    parser.add_argument("--prompt", type=int, default=512, help="with --prefill: the timed prompt's tokens")
    parser.add_argument("--tokens", type=int, default=1, help="profile a call of this many tokens after --past (a "
                        "speculative verify call) instead of one; the timing stays decode steps")
    parser.add_argument("--min-ms", type=float, default=0.05, help="op kinds under this in every archive are summed "
                        "into one 'other ops' row")
    parser.add_argument("--cpu", type=int, help="re-run pinned to this core (taskset -c)")
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args(argv)
    if args.cpu is not None and os.environ.get("GDN_PROFILE_PINNED") != "1":
        os.environ["GDN_PROFILE_PINNED"] = "1"
        argv_out = [a for a in (argv if argv is not None else sys.argv[1:])]
        os.execvp("taskset", ["taskset", "-c", str(args.cpu), sys.executable, __file__, *argv_out])
    labels = args.labels.split(",") if args.labels else [p.name.removesuffix(".nnef.tgz") for p in args.archives]
    if len(labels) != len(args.archives):
        parser.error("--labels: one name per archive")

    length = max(args.past + max(1 + args.steps * args.rounds, args.tokens), args.prompt, args.prefill or 0)
    tokens = np.random.default_rng(0).integers(0, 1000, (1, length)).astype(np.int64)
    sessions, profiles = [], []
    for path in args.archives:
        session = Session(path)
        if args.prefill:
            session.prefill(tokens[:, :8])  # warm-up: the plan for batch 1, then profile from the empty state
            session.reset()  # (the profile reads the initial states: nothing prefilled)
            profiles.append(profile(session, tokens[:, :args.prefill]))
        else:
            session.prefill(tokens[:, :args.past])
            profiles.append(profile(session, tokens[:, args.past:args.past + args.tokens]))
        sessions.append(session)
    if args.prefill:
        speeds = prefill_timing(sessions, tokens, args.prompt, args.rounds)
    else:
        speeds = timing(sessions, tokens, args.past, args.steps, args.rounds)
    load = os.getloadavg()[0]

    ms = lambda s: f"{1e3 * s:.2f}"  # noqa: E731
    what = f"One prefill piece of {args.prefill} tokens from the empty state" if args.prefill else \
        f"One call of {args.tokens} tokens after {args.past} tokens" if args.tokens > 1 else \
        f"One decode step after {args.past} tokens"
    print(f"{what}, B = 1, one tract thread; profile: tract's per-node mean over its "
          f"own runs (ms); load average {load:.2f} ({os.cpu_count()} cores)\n")
    kinds = sorted({op for p in profiles for op in p["ops"]},
                   key=lambda op: (not is_matmul(op), -max(p["ops"].get(op, 0.0) for p in profiles)))
    rows, small = [], [0.0] * len(profiles)
    for op in kinds:
        values = [p["ops"].get(op, 0.0) for p in profiles]
        if not is_matmul(op) and max(values) * 1e3 < args.min_ms:
            small = [a + b for a, b in zip(small, values)]
            continue
        rows.append([op + (" (matmul)" if is_matmul(op) else "")] + [ms(v) for v in values])
    rows.append([f"other ops (each < {args.min_ms} ms)"] + [ms(v) for v in small])
    matmul = [sum(v for op, v in p["ops"].items() if is_matmul(op)) for p in profiles]
    outside = [sum(v for op, v in p["ops"].items() if not is_matmul(op)) for p in profiles]
    rows.append(["**matmuls**"] + [ms(v) for v in matmul])
    rows.append(["**outside the matmuls**"] + [f"{ms(v)} ({ratio(v, outside[0])})" for v in outside])
    rows.append(["**profiled step**"] + [ms(p["step"]) for p in profiles])
    print(table(["op kind"] + labels, rows, args.markdown))

    print("\nBy part of the model (ms: matmuls / outside the matmuls):\n")
    names = [part for part, _ in PARTS] + ["other"]
    rows = [[part] + [f"{ms(p['parts'].get(part, [0, 0])[0])} / {ms(p['parts'].get(part, [0, 0])[1])}"
                      for p in profiles] for part in names if any(part in p["parts"] for p in profiles)]
    print(table(["part"] + labels, rows, args.markdown))

    medians = [statistics.median(s) for s in speeds]
    timed = f"Prefill tokens/s of {args.prompt} tokens ({args.rounds} interleaved rounds" if args.prefill else \
        f"Decode tokens/s ({args.rounds} interleaved rounds of {args.steps} steps"
    print(f"\n{timed}; median, ratio to {labels[0]}; load average {os.getloadavg()[0]:.2f}):\n")
    rows = [[label, f"{m:.2f}", f"{m / medians[0]:.2f}x", " ".join(f"{x:.2f}" for x in s)]
            for label, m, s in zip(labels, medians, speeds)]
    print(table(["archive", "tok/s", "x", "rounds"], rows, args.markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
