"""Q4_0 quantization time by rule on Qwen3.5 0.8B's linear-layer shapes: nearest, search, search with importance,
GPTQ (with random full-rank second moments).

    python benchmarks/bench_q4_rules.py [--vocab 151936] [--markdown]

Quantizes one random matrix (Gaussian, float32) of each of the shapes of Qwen3.5 0.8B's text model's Q4_0 weights
(24 layers: 18 gated delta-rule, 6 attention; MLP 3584; the tied head's Q4_0 copy, ``--vocab`` rows) with each rule,
through ``q4_0.write_nnef`` (the converter's streaming path, slices as in a conversion) into /dev/null, the rules
back to back per shape (timings on a shared machine: read the ratios), and prints per shape the seconds of each
rule and the model's total (each shape's time times its count), plus each rule's relative squared error.
"""

from __future__ import annotations

import argparse
import platform
import time

import numpy as np

from gdn_export.weights import q4_0

LAYERS, GDN, ATTENTION = 24, 18, 6


def shapes(vocab: int) -> list[tuple[str, tuple[int, int], int]]:
    """(name, shape, count in the model) of Qwen3.5 0.8B's Q4_0 weights (hidden 1024, 16 linear heads of K = V = 128,
    8 gated attention heads of 256 with 2 kv heads)."""
    return [("linear_attn.in_proj_qkv", (6144, 1024), GDN), ("linear_attn.in_proj_z", (2048, 1024), GDN),
            ("linear_attn.in_proj_b / _a", (16, 1024), 2 * GDN), ("linear_attn.out_proj", (1024, 2048), GDN),
            ("self_attn.q_proj", (4096, 1024), ATTENTION), ("self_attn.k_proj / v_proj", (512, 1024), 2 * ATTENTION),
            ("self_attn.o_proj", (1024, 2048), ATTENTION), ("mlp.gate_proj / up_proj", (3584, 1024), 2 * LAYERS),
            ("mlp.down_proj", (1024, 3584), LAYERS), ("lm_head (tied: a Q4_0 copy)", (vocab, 1024), 1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    rules = [("nearest", "nearest", False), ("search", "search", False), ("search + importance", "search", True),
             ("gptq", "gptq", True)]
    totals = {label: 0.0 for label, _, _ in rules}
    errors = {r[0]: [0.0, 0.0] for r in rules}
    rows = []
    with open("/dev/null", "wb") as sink:  # the first call imports torch-to-nnef's header writer: not timed
        q4_0.write_nnef(sink, (32, 32), lambda a, b: np.ones((b - a, 32), np.float32))
    for name, shape, count in shapes(args.vocab):
        x = (rng.standard_normal(shape) * 0.02).astype(np.float32)
        importance = rng.lognormal(0, 1, shape[1]).astype(np.float32)
        mixing = rng.standard_normal((256, shape[1])).astype(np.float32) * np.sqrt(importance)
        gram = (mixing.T @ mixing / 256 + np.diag(importance)).astype(np.float32)  # full rank, correlated
        seconds = {}
        for label, rule, weighted in rules:
            weights = importance if weighted else None
            with open("/dev/null", "wb") as sink:
                start = time.perf_counter()
                q4_0.write_nnef(sink, shape, lambda a, b: x[a:b], rule, weights, gram if rule == "gptq" else None)
                seconds[label] = time.perf_counter() - start
            totals[label] += seconds[label] * count
            if shape[0] <= 8192:
                back = q4_0.dequantize(q4_0.quantize(x, rule, weights, gram if rule == "gptq" else None), shape)
                errors[label][0] += float(np.square(back - x).sum()) * count
                errors[label][1] += float(np.square(x).sum()) * count
        rows.append((name, shape, count, seconds))
    header = ["weight", "shape", "count"] + [f"{label} s" for label, _, _ in rules]
    lines = [header] + [[name, "x".join(map(str, shape)), str(count)] + [f"{s[label]:.3f}" for label, _, _ in rules]
                        for name, shape, count, s in rows]
    lines.append(["model total", "", ""] + [f"{totals[label]:.1f}" for label, _, _ in rules])
    lines.append(["x nearest", "", ""] + [f"{totals[label] / totals['nearest']:.1f}" for label, _, _ in rules])
    lines.append(["rel. squared error (layers; unweighted)", "", ""] + [f"{e[0] / e[1]:.5f}" for e in errors.values()])
    print(f"Q4_0 rules on Qwen3.5 0.8B shapes (vocab {args.vocab}), {platform.processor() or platform.machine()}; "
          "one process, rules back to back per shape")
    if args.markdown:
        print("| " + " | ".join(lines[0]) + " |\n|" + "---|" * len(lines[0]))
        for line in lines[1:]:
            print("| " + " | ".join(line) + " |")
    else:
        for line in lines:
            print("  ".join(f"{c:>14}" for c in line))


if __name__ == "__main__":
    main()
