"""Issue 37 item 2, a prototype measured: the GDN core in a "delayed commit" form, against the form archives have.

    python benchmarks/bench_delayed_commit.py [--heads 16] [--width 128] [--reps 200]

What it answers: can a call return "the state after each of its positions, or an equivalent" (so that a
speculative step that keeps j of its k tokens commits them without running them again) at (almost) no cost to a
plain decode step? The chunk form's corrected values Delta of a chunk are prefix-consistent (its triangular solve is
causal), so the state after position j of a chunk that starts from S_b is (docs/MATH.md, the chunked form)

    S_j = exp(gamma_j) S_b + sum_{i <= j} exp(gamma_j - gamma_i) k_i Delta_i^T

The delayed form's tail body therefore does not apply its own chunk's update at its end: it carries (S_b, k,
exp(gamma_C - gamma) Delta, exp(gamma_C)) to the next chunk, which applies them first (the same matmul-plus-add the
old body ends with, so the same passes over the state), and the graph returns the state at the start of its last
short chunk plus that chunk's factors (k, Delta, gamma: <= TAIL_CHUNK positions). The next call takes them and a
choice of j (a one-hot row and a log-mask: how many of those positions to keep; all for plain decoding) and its
tail scan applies them as its first op.

The prototype is the core alone (one ``gated_delta_rule`` node, seq-major, symbolic S, the chunked lowering with its
tail in short chunks of 4, as ``convert`` writes it), made by rewriting the exported graph's tail scan: it covers
calls of S < 64 tokens (decode and verify calls; a long prompt's chunk scan would need the pending factors applied
before it, which it does not write) and left-aligned padding (the accepted prefix must end in the last short chunk:
a call of k <= 4 tokens). Both graphs are checked against the float64 oracle (tests/oracle.py) first: the old
form's state after k tokens, the new form's state after j kept tokens of a call of k (recovered in the next call).
Then, one thread, the two graphs' calls interleaved, median of ``--reps``: a decode step (S = 1, the previous
call's outputs fed back as tract tensors, as Session does) and calls of k = 2..5 tokens.
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))

import gdn_export  # noqa: E402
from bench_lowerings import NAMES, Rule, inputs  # noqa: E402
from gdn_export.run.runtime import load_tract_model, run_tract_tensors  # noqa: E402
from oracle import gated_delta_seq_major  # noqa: E402

TAIL = 4


def export_old(folder: Path, heads: int, width: int) -> None:
    path = folder.with_suffix(".nnef.tgz")
    gdn_export.export(Rule(), inputs(2, heads, width), path, lowering="chunked", tail_chunk=TAIL, input_names=NAMES,
                      output_names=["o", "state"], dynamic_axes={name: {1: "S"} for name in NAMES[:5]})
    with tarfile.open(path) as archive:
        archive.extractall(folder, filter="data")


def block(text: str, header: str) -> tuple[int, int]:
    """Start and end (after its closing brace line) of the fragment whose first line starts with ``header``."""
    start = text.index(header)
    return start, text.index("\n}\n", start) + 3


def rewrite(old: Path, new: Path, heads: int, width: int, lean: bool = False) -> None:
    """The delayed-commit form of ``old``'s graph (see the module doc) into ``new``; ``lean``: the graph takes the
    weighted factors (the choice of j applied to them by the caller, ``lean_inputs``) instead of j."""
    shutil.copytree(old, new)
    text = (old / "graph.nnef").read_text()
    step_name = re.search(r"fragment (\S+_last_step)\(", text).group(1)
    scan_name = step_name.removesuffix("_step") + "_scan"
    # the step: apply the carried factors first (same form as the old body's last line), keep no update at the end
    start, end = block(text, f"fragment {step_name}(")
    step = text[start:end]
    step = step.replace("    s_prev: tensor<scalar>,",
                        "    s_prev: tensor<scalar>, kf_prev: tensor<scalar>, wdf_prev: tensor<scalar>, "
                        "w0_prev: tensor<scalar>,")
    step = step.replace("-> ( s_t: tensor<scalar>, y_t: tensor<scalar> )",
                        "-> ( s_t: tensor<scalar>, kf_t: tensor<scalar>, wdf_t: tensor<scalar>, w0_t: tensor<scalar>, "
                        "y_t: tensor<scalar>, d_t: tensor<scalar>, g_t: tensor<scalar> )")
    lines = step.split("\n")
    body_start = next(i for i, line in enumerate(lines) if line.startswith("    x0 = "))
    update = next(i for i, line in enumerate(lines) if line.startswith("    s_t = "))
    # the old end: x44 = exp(end_t); x45 = s_prev * x44; x46 = einsum(k, scaled delta); s_t = x46 + x45
    scaled = re.search(r"einsum\(\[(x\d+), (x\d+)\]", lines[update - 1])
    key, weighted = scaled.group(1), scaled.group(2)
    delta_line = [ln for ln in lines if ln.startswith(f"    {weighted} = ")][0]
    delta, factor = re.match(rf"    {weighted} = (x\d+) \* (x\d+);", delta_line).groups()
    factor_line = [ln for ln in lines if ln.startswith(f"    {factor} = ")][0]
    root = float(re.match(rf"    {factor} = x\d+ \* ([0-9.e-]+);", factor_line).group(1))
    applied = ["    xa = tract_core_einsum([kf_prev, wdf_prev], expr = \"bchk,zbhgcv->zbhgkv\", acc = \"f32\");",
               "    xb = s_prev * w0_prev;",
               "    s_t = xa + xb;"]
    kept = lines[body_start:update - 3] + lines[update + 1:]
    kept = [re.sub(r"\bs_prev\b", "s_t", line) for line in kept]
    kept = [re.sub(rf"\b{key}\b", "kf_t", line) for line in kept]
    kept = [re.sub(rf"\b{weighted}\b", "wdf_t", line) for line in kept]
    tail = [i for i, line in enumerate(kept) if line.startswith("}")][-1]
    kept[tail:tail] = ["    w0_t = exp(end_t);", f"    d_t = {delta} * {root!r};", "    g_t = gamma_t + 0.0;"]
    step = "\n".join(lines[:body_start] + applied + kept)
    text = text[:start] + step + text[end:]
    # the scan: three more carried states, two more outputs (lean: the carried ones leave too)
    start, end = block(text, f"fragment {scan_name}(")
    scan = text[start:end]
    leaving = ["kf", "wdf", "w0", "d", "g"] if lean else ["kf", "d", "g"]
    scan = scan.replace("s_init: tensor<scalar>\n", "s_init: tensor<scalar>, kf_init: tensor<scalar>, "
                        "wdf_init: tensor<scalar>, w0_init: tensor<scalar>\n")
    scan = scan.replace("-> ( y: tensor<scalar>, states: tensor<scalar> )",
                        "-> ( y: tensor<scalar>, states: tensor<scalar>, "
                        + ", ".join(f"{name}: tensor<scalar>" for name in leaving) + " )")
    scan = scan.replace("(y, states) = tract_core_scan(", "(y, states, kf, wdf, w0, d, g) = tract_core_scan(")
    scan = scan.replace('state = [("s_prev", s_init, "s_t")]',
                        'state = [("s_prev", s_init, "s_t"), ("kf_prev", kf_init, "kf_t"), '
                        '("wdf_prev", wdf_init, "wdf_t"), ("w0_prev", w0_init, "w0_t")]')
    scan = scan.replace('("s_t", "last", 0, 1)]', '("s_t", "last", 0, 1), ("kf_t", "last", 0, 1), '
                        '("wdf_t", "last", 0, 1), ("w0_t", "last", 0, 1), ("d_t", "last", 0, 1), '
                        '("g_t", "last", 0, 1)]')
    text = text[:start] + scan + text[end:]
    # the graph: the previous call's factors in (with the choice of j: in the graph, or applied by the caller to
    # the weights, lean), this call's factors out
    outs = ", ".join(f"{name}_out" for name in leaving)
    ins = "kf, wdf, w0" if lean else "kf, df, gp, sel, keep"
    text = text.replace("graph network(q, k, v, g, beta, s0) -> (o, state)",
                        f"graph network(q, k, v, g, beta, s0, {ins}) -> (o, state, {outs})")
    externals = f"    kf = tract_core_external(shape = [1, {TAIL}, {heads}, {width}], datum_type = 'f32');\n"
    if lean:
        factor = f"[1, 1, {heads}, 1, {TAIL}, {width}]"
        externals += (f"    wdf = tract_core_external(shape = {factor}, datum_type = 'f32');\n"
                      f"    w0 = tract_core_external(shape = [1, 1, {heads}, 1, 1, 1], datum_type = 'f32');\n")
    else:
        factor = f"[1, 1, {heads}, 1, {TAIL}, {width}]"
        externals += (f"    df = tract_core_external(shape = {factor}, datum_type = 'f32');\n"
                      f"    gp = tract_core_external(shape = [1, 1, {heads}, 1, {TAIL}, 1], datum_type = 'f32');\n"
                      f"    sel = tract_core_external(shape = [1, 1, 1, 1, 1, {TAIL}], datum_type = 'f32');\n"
                      f"    keep = tract_core_external(shape = [1, 1, 1, 1, {TAIL}, 1], datum_type = 'f32');\n"
                      "    gj = matmul(sel, gp, transposeA = false, transposeB = false);\n"
                      "    wdf = df * exp(gj - gp + keep);\n"
                      "    w0 = exp(gj);\n")
    anchor = text.index("    o_0_head, o_1_tail = ")
    text = text[:anchor] + externals + text[anchor:]
    call = re.search(rf"    (o_\d+_chunk_y), (o_\d+_chunk_states) = {scan_name}\((.*)\);", text)
    text = text.replace(call.group(0), f"    {call.group(1)}, {call.group(2)}, {outs} = {scan_name}("
                                       f"{call.group(3)}, kf, wdf, w0);")
    (new / "graph.nnef").write_text(text)


def pending_inputs(factors, keep: int | None, heads: int, width: int):
    """The next call's extra inputs from the previous call's factors (None: an empty pending chunk), keeping its
    first ``keep`` positions (TAIL: all, plain decoding)."""
    if factors is None:
        kf = np.zeros((1, TAIL, heads, width), np.float32)
        df = np.zeros((1, 1, heads, 1, TAIL, width), np.float32)
        gp = np.zeros((1, 1, heads, 1, TAIL, 1), np.float32)
    else:
        kf, df, gp = factors
    sel = np.zeros((1, 1, 1, 1, 1, TAIL), np.float32)
    if keep:
        sel[..., keep - 1] = 1.0
    mask = np.where(np.arange(TAIL) < keep, 0.0, -1e30).astype(np.float32).reshape(1, 1, 1, 1, TAIL, 1)
    return [kf, df, gp, sel, mask]


def lean_inputs(factors, keep: int, heads: int, width: int):
    """The lean form's extra inputs: the previous call's (k, weighted Delta, exp(gamma_C)) as they are when all its
    positions are kept (plain decoding: no work), else the weights of its first ``keep`` positions made here from
    its unweighted Delta and gamma (masked before exp, as the chunk body does)."""
    if factors is None:
        return [np.zeros((1, TAIL, heads, width), np.float32), np.zeros((1, 1, heads, 1, TAIL, width), np.float32),
                np.ones((1, 1, heads, 1, 1, 1), np.float32)]
    kf, wdf, w0, d, g = factors
    if keep == TAIL:
        return [kf, wdf, w0]
    d, g = (np.asarray(x.to_numpy() if hasattr(x, "to_numpy") else x) for x in (d, g))
    last = g[..., keep - 1:keep, :] if keep else np.zeros_like(g[..., :1, :])
    kept = (np.arange(TAIL) < keep).reshape(1, 1, 1, 1, TAIL, 1)
    weights = np.exp(np.where(kept, last - g, -1e30)).astype(np.float32)
    return [kf, (d * weights).astype(np.float32), np.exp(last).astype(np.float32)]


FORMS = ("old", "delayed, j in the graph", "delayed, j on the host (lean)")


def extra_inputs(form: str, factors, keep: int, heads: int, width: int) -> list:
    if form == FORMS[0]:
        return []
    if form == FORMS[1]:
        return pending_inputs(None if factors is None else factors[:3], keep, heads, width)
    return lean_inputs(factors, keep, heads, width)


def check(runnables: dict, heads: int, width: int) -> dict[str, float]:
    """Per form, the worst error, relative to the largest value, against the float64 oracle: the old form's
    outputs and state after k tokens; a delayed form's outputs, and the state after j of k tokens (read back from
    a next call of one token that keeps j: its state output, and its output for that token)."""
    worst = dict.fromkeys(runnables, 0.0)
    error = lambda a, b: float(np.abs(a - b).max() / np.abs(b).max())  # noqa: E731
    for k in range(1, TAIL + 1):
        xs = [x.numpy() for x in inputs(k + 1, heads, width, seed=k)]
        first = [np.ascontiguousarray(x[:, :k]) for x in xs[:5]] + [xs[5]]
        y_ref, s_ref = gated_delta_seq_major(*first[:5], first[5], use_qk_l2norm=True)
        for form, runnable in runnables.items():
            out = [t.to_numpy() for t in run_tract_tensors(runnable, first + extra_inputs(form, None, 0, heads, width))]
            worst[form] = max(worst[form], error(out[0], y_ref))
            if form == FORMS[0]:
                worst[form] = max(worst[form], error(out[1], s_ref))
                continue
            for j in range(1, k + 1):
                nxt = [np.ascontiguousarray(x[:, k:k + 1]) for x in xs[:5]]
                after = [t.to_numpy() for t in run_tract_tensors(
                    runnable, nxt + [out[1]] + extra_inputs(form, out[2:], j, heads, width))]
                kept = [np.concatenate([x[:, :j], x[:, k:k + 1]], axis=1) for x in xs[:5]]
                y_kept, _ = gated_delta_seq_major(*kept, xs[5], use_qk_l2norm=True)
                _, s_kept = gated_delta_seq_major(*(x[:, :j] for x in xs[:5]), xs[5], use_qk_l2norm=True)
                worst[form] = max(worst[form], error(after[0][:, -1], y_kept[:, -1]), error(after[1], s_kept))
    return worst


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--gdn-layers", type=int, default=18, help="GDN layers of the model the totals are for")
    args = parser.parse_args()
    torch.set_num_threads(1)
    h, w = args.heads, args.width
    with tempfile.TemporaryDirectory() as tmp:
        export_old(Path(tmp) / "old", h, w)
        rewrite(Path(tmp) / "old", Path(tmp) / "new", h, w)
        rewrite(Path(tmp) / "old", Path(tmp) / "lean", h, w, lean=True)
        runnables = {form: load_tract_model(Path(tmp) / name) for form, name in zip(FORMS, ("old", "new", "lean"))}
    for form, worst in check(runnables, h, w).items():
        print(f"{form}: worst error against the float64 oracle (relative to the largest value) {worst:.2e}")
    import tract

    xs = [x.numpy() for x in inputs(8, h, w, seed=0)]
    calls = ("decode",) + tuple(range(2, 6))
    times = {(form, k): [] for form in FORMS for k in calls}
    states = dict.fromkeys(FORMS, xs[5])
    # what a plain decode step feeds the next one, as tract tensors (Session's way); the choice of j, where the
    # graph takes it, is a pair of tiny inputs every layer of a model would share: made once
    fed = {form: [tract.Tensor.from_numpy(x) for x in extra_inputs(form, None, TAIL, h, w)] for form in FORMS}
    for rep in range(args.reps + 1):
        for k in calls:
            tokens = [np.ascontiguousarray(x[:, :1 if k == "decode" else k]) for x in xs[:5]]
            for form, runnable in runnables.items():
                start = time.perf_counter()
                out = run_tract_tensors(runnable, tokens + [states[form]] + fed[form])
                if k == "decode":
                    states[form] = out[1]
                    if form == FORMS[1]:
                        fed[form] = out[2:5] + fed[form][3:]
                    elif form == FORMS[2]:
                        fed[form] = out[2:5]
                elapsed = time.perf_counter() - start
                if rep:
                    times[form, k].append(elapsed)
    print(f"\nGDN core alone, H={h}, K=V={w}, B=1, one thread, median of {args.reps} (ms; the forms' calls "
          "interleaved; x: over the old form)\n")
    print("| call | " + " | ".join(FORMS) + " |")
    print("|---|" + "---|" * len(FORMS))
    for k in calls:
        base = statistics.median(times[FORMS[0], k])
        cells = [f"{statistics.median(times[form, k]) * 1e3:.3f} ms ({statistics.median(times[form, k]) / base:.3f}x)"
                 for form in FORMS]
        print(f"| {'decode step (S = 1)' if k == 'decode' else f'k = {k}'} | " + " | ".join(cells) + " |")
    for form in FORMS[1:]:
        extra = statistics.median(times[form, "decode"]) - statistics.median(times[FORMS[0], "decode"])
        print(f"\n{form}: {extra * 1e3:+.3f} ms a decode step per GDN layer, {extra * 1e3 * args.gdn_layers:+.2f} ms "
              f"for the {args.gdn_layers} GDN layers of the 0.8B shape")
    cut = cache_cut_ms(args.reps)
    print(f"\nA partial accept with per-position states must also cut the attention caches by length, on the host "
          f"for a Session's graph (its caches grow by concat in the graph): the 0.8B shape's 6 attention layers' "
          "K and V "
          f"([1, 2, L, 256] float32, L = 384) out of tract, sliced, back in: {cut:.2f} ms (median of {args.reps}); "
          "going back to the states before the call, as commit does today, costs nothing (the tensors are kept)")
    return 0


def cache_cut_ms(reps: int, context: int = 384, layers: int = 6, drop: int = 2) -> float:
    """Milliseconds to cut ``layers`` attention layers' K and V caches ``[1, 2, context + 5, 256]`` by ``drop``
    positions through numpy (tract tensors out, sliced, in), median of ``reps``."""
    import tract

    rng = np.random.default_rng(0)
    caches = [tract.Tensor.from_numpy(rng.standard_normal((1, 2, context + 5, 256)).astype(np.float32))
              for _ in range(2 * layers)]
    times = []
    for _ in range(reps + 1):
        start = time.perf_counter()
        cut = [tract.Tensor.from_numpy(np.ascontiguousarray(t.to_numpy()[:, :, :-drop])) for t in caches]
        times.append(time.perf_counter() - start)
        del cut
    return statistics.median(times[1:]) * 1e3


if __name__ == "__main__":
    sys.exit(main())
