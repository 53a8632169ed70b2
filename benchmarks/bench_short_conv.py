"""The GDN short conv (causal depthwise conv1d of width W + SiLU, with its carried state) in tract: NNEF forms side by side.

    python benchmarks/bench_short_conv.py [--channels 6144] [--seqs 1,128] [--budget 4] [--cpu 1]

Each form is a hand-written NNEF graph with S symbolic and B = 1 (the plan ``Session`` prefills and decodes with), fed
as the model feeds the op: the input projection's output ``[1, S, C]`` transposed to ``[1, C, S]``, the output
transposed back; the weight is a variable (as in an archive). Every form is checked against a float64 numpy oracle
(the op's reference: W shifted multiply-adds), then timed in interleaved rounds (one tract thread):
- ``fused``: tract's ``tract_transformers_causal_conv1d_update`` (gdn_export's "native" lowering);
- ``depthwise conv``: NNEF ``conv`` with one group per channel over ``state[:, :, 1:] ++ x`` ("portable");
- ``taps, channels last``: ``state[:, :, 1:] ++ x`` transposed to ``[1, S + W - 1, C]``, then W slices along the
  sequence axis, each times its tap's ``[1, 1, C]`` weights, summed; the transposes cancel the model's own;
- ``taps, channels first``: the same W products over ``[1, C, S + W - 1]`` with ``[1, C, 1]`` weights;
- ``scan per token``: a ``tract_core_scan`` over single tokens carrying the window ``[1, W, C]``;
- ``taps stacked, summed over W``: the W slices stacked ``[1, S, W, C]``, times ``[1, 1, W, C]``, ``sum_reduce``;
- ``chunks of K``: gdn_export's lowering (``gdn_export/ops/causal_conv1d/nnef.py``), a scan over chunks of K tokens;
- with ``--dtype f16``: ``taps ... in f32``, an f16 graph's taps computed in f32 between two casts.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

WIDTH = 4

SCAN_FRAGMENTS = """
fragment conv_step(
    window_prev: tensor<scalar>, x_t: tensor<scalar>, w: tensor<scalar>
) -> ( window_t: tensor<scalar>, y_t: tensor<scalar> ) {{
    window_t = concat([slice(window_prev, axes = [1], begin = [1], end = [{w}]), x_t], axis = 1);
    acc = sum_reduce(window_t * w, axes = [1]);
    y_t = acc * sigmoid(acc);
}}
"""

HEAD = """version 1.0;
extension tract_registry tract_core;
extension tract_registry tract_transformers;
extension tract_symbol S;
{fragments}
graph g(xs, state) -> (y, st) {{
    xs = tract_core_external(shape = [1, S, {c}], datum_type = '{dt}');
    state = tract_core_external(shape = [1, {c}, {w}], datum_type = '{dt}');
    weight = variable<scalar>(label = 'weight', shape = [{c}, {w}]);
    x = transpose(xs, axes = [0, 2, 1]);
{body}
    y = transpose(y0, axes = [0, 2, 1]);
}}
"""

FUSED = "    y0, st = tract_transformers_causal_conv1d_update(x, weight, state);\n"

DEPTHWISE = """    tail = slice(state, axes = [2], begin = [1], end = [{w}]);
    full = concat([tail, x], axis = 2);
    total = conv(full, unsqueeze(weight, axes = [1]), 0.0, border = 'constant', padding = [(0, 0)], stride = [1],
                 dilation = [1], groups = 0);
    y0 = total * sigmoid(total);
    n = squeeze(slice(tract_core_shape_of(full), axes = [0], begin = [2], end = [3]), axes = [0]);
    st = slice(full, axes = [2], begin = [n - {w}], end = [n]);
"""


def shifted_products(axis: int, w: int) -> tuple[list[str], str]:
    """The lines ``t{i} = slice(full, i .. n - (w - 1 - i)) * weight tap i`` along ``axis``, and their sum's expression."""
    lines = [f"    t{i} = slice(full, axes = [{axis}], begin = [{i}], end = [n - {w - 1 - i}]) * "
             f"slice(wt, axes = [{axis}], begin = [{i}], end = [{i + 1}]);" for i in range(w)]
    total = "t0"
    for i in range(1, w):
        total = f"add({total}, t{i})"
    return lines, total


def taps_last(w: int, f32: bool = False) -> str:
    """``f32``: an f16 graph's taps computed in f32 (full and weight cast up, the output cast down once)."""
    up = (lambda t: f"tract_core_cast({t}, to = 'f32')") if f32 else (lambda t: t)
    lines = ["    xt = transpose(x, axes = [0, 2, 1]);",
             "    tail = slice(transpose(state, axes = [0, 2, 1]), axes = [1], begin = [1], end = [{w}]);",
             f"    full = {up('concat([tail, xt], axis = 1)')};",
             "    n = squeeze(slice(tract_core_shape_of(full), axes = [0], begin = [1], end = [2]), axes = [0]);",
             f"    wt = {up('unsqueeze(transpose(weight, axes = [1, 0]), axes = [0])')};"]
    products, total = shifted_products(1, w)
    lines += products
    down = (lambda t: f"tract_core_cast({t}, to = 'f16')") if f32 else (lambda t: t)
    lines += [f"    acc = {total};", f"    y0 = transpose({down('acc * sigmoid(acc)')}, axes = [0, 2, 1]);",
              f"    st = transpose({down('slice(full, axes = [1], begin = [n - {w}], end = [n])')}, axes = [0, 2, 1]);"]
    return "\n".join(lines) + "\n"


def taps_stacked(w: int) -> str:
    """The W shifted slices stacked on a new axis [1, S, W, C], times the weight [1, 1, W, C], summed over W."""
    lines = ["    xt = transpose(x, axes = [0, 2, 1]);",
             "    tail = slice(transpose(state, axes = [0, 2, 1]), axes = [1], begin = [1], end = [{w}]);",
             "    full = concat([tail, xt], axis = 1);",
             "    n = squeeze(slice(tract_core_shape_of(full), axes = [0], begin = [1], end = [2]), axes = [0]);",
             "    wt = unsqueeze(transpose(weight, axes = [1, 0]), axes = [0, 1]);"]
    taps = [f"unsqueeze(slice(full, axes = [1], begin = [{i}], end = [n - {w - 1 - i}]), axes = [2])" for i in range(w)]
    lines += [f"    stacked = concat([{', '.join(taps)}], axis = 2);",
              "    acc = squeeze(sum_reduce(stacked * wt, axes = [2]), axes = [2]);",
              "    y0 = transpose(acc * sigmoid(acc), axes = [0, 2, 1]);",
              "    st = transpose(slice(full, axes = [1], begin = [n - {w}], end = [n]), axes = [0, 2, 1]);"]
    return "\n".join(lines) + "\n"


def taps_first(w: int) -> str:
    lines = ["    tail = slice(state, axes = [2], begin = [1], end = [{w}]);",
             "    full = concat([tail, x], axis = 2);",
             "    n = squeeze(slice(tract_core_shape_of(full), axes = [0], begin = [2], end = [3]), axes = [0]);",
             "    wt = unsqueeze(weight, axes = [0]);"]
    products, total = shifted_products(2, w)
    lines += products
    lines += [f"    acc = {total};", "    y0 = acc * sigmoid(acc);",
              "    st = slice(full, axes = [2], begin = [n - {w}], end = [n]);"]
    return "\n".join(lines) + "\n"


SCAN = """    window = transpose(state, axes = [0, 2, 1]);
    wt = unsqueeze(transpose(weight, axes = [1, 0]), axes = [0]);
    (last, yt) = tract_core_scan(body = "conv_step", scan = [("x_t", transpose(x, axes = [0, 2, 1]), 1, 1)],
                                 full = [("w", wt)], state = [("window_prev", window, "window_t")],
                                 output = [("window_t", "last", 1, 1), ("y_t", "full", 1, 1)], skip = 0);
    st = transpose(last, axes = [0, 2, 1]);
    y0 = transpose(yt, axes = [0, 2, 1]);
"""


def chunks(chunk: int) -> str:
    """gdn_export's lowering (gdn_export/ops/causal_conv1d/nnef.py): a scan over chunks of ``chunk`` tokens."""
    return f"""    window = transpose(state, axes = [0, 2, 1]);
    wt = unsqueeze(transpose(weight, axes = [1, 0]), axes = [0]);
    (yt, last) = gdn_export_conv_w{{w}}_c{chunk}(transpose(x, axes = [0, 2, 1]), window, wt);
    st = transpose(last, axes = [0, 2, 1]);
    y0 = transpose(yt, axes = [0, 2, 1]);
"""


FORMS = {"fused": FUSED, "depthwise conv": DEPTHWISE, "taps, channels last": taps_last(WIDTH),
         "taps, channels first": taps_first(WIDTH), "taps stacked, summed over W": taps_stacked(WIDTH),
         "scan per token": SCAN, "chunks of 4 (gdn_export's lowering)": chunks(4), "chunks of 16": chunks(16),
         "taps, channels last, in f32 (f16 only)": taps_last(WIDTH, True)}


def reference(xs: np.ndarray, weight: np.ndarray, state: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float64: y [1, S, C] = silu(sum_i w[:, i] * full[:, i:i+S]), new state = the last W of full = state ++ x."""
    x = np.swapaxes(xs.astype(np.float64), 1, 2)
    full = np.concatenate([state.astype(np.float64), x], axis=2)
    seq, width = x.shape[2], weight.shape[1]
    out = sum(weight[None, :, i, None].astype(np.float64) * full[:, :, 1 + i:1 + i + seq] for i in range(width))
    y = out / (1 + np.exp(-out))
    return np.swapaxes(y, 1, 2), full[:, :, -width:]


def fragments(body: str, w: int) -> str:
    """The NNEF fragments a form's body calls."""
    called = re.search(r"gdn_export_conv_w\d+_c(\d+)\(", body)
    if called:
        from gdn_export.ops.causal_conv1d.nnef import fragment

        return fragment(w, int(called.group(1))).definition
    return SCAN_FRAGMENTS.format(w=w) if "tract_core_scan" in body else ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--channels", type=int, default=6144, help="C: the 0.8B shape's 2 * 16 * 128 + 16 * 128")
    parser.add_argument("--seqs", default="1,128", help="comma-separated S to time")
    parser.add_argument("--budget", type=float, default=4.0, help="seconds of timing per form and S")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--dtype", choices=["f32", "f16"], default="f32", help="activations, state and weight")
    parser.add_argument("--forms", help="semicolon-separated subset of: " + "; ".join(FORMS))
    parser.add_argument("--cpu", type=int, help="re-run pinned to this core (taskset -c)")
    args = parser.parse_args(argv)
    if args.cpu is not None and os.environ.get("GDN_BENCH_PINNED") != "1":
        os.environ["GDN_BENCH_PINNED"] = "1"
        os.execvp("taskset", ["taskset", "-c", str(args.cpu), sys.executable, __file__,
                              *(argv if argv is not None else sys.argv[1:])])
    import nnef
    import tract

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from gdn_export.run.runtime import steady_allocator

    steady_allocator()  # as a Session: tract's per-call buffers stay mapped (RESULTS.md, "Allocator")

    c, w = args.channels, WIDTH
    forms = {k: v for k, v in FORMS.items() if (not args.forms or k in args.forms.split(";"))
             and (args.dtype == "f16" or "f16 only" not in k)}
    gen = np.random.default_rng(0)
    dtype = np.float16 if args.dtype == "f16" else np.float32
    weight = (gen.standard_normal((c, w)) / 2).astype(dtype)
    seqs = [int(s) for s in args.seqs.split(",")]
    runnables = {}
    with tempfile.TemporaryDirectory() as tmp:
        for index, (label, body) in enumerate(forms.items()):
            folder = Path(tmp) / f"form{index}"
            folder.mkdir()
            (folder / "graph.nnef").write_text(HEAD.format(
                c=c, w=w, dt=args.dtype, body=body.format(w=w),
                fragments=fragments(body.format(w=w), w)))
            with open(folder / "weight.dat", "wb") as f:
                nnef.write_tensor(f, weight)
            runnables[label] = tract.nnef().with_tract_transformers().load(str(folder)).into_runnable()
    timed: dict[tuple[str, int], list[float]] = {}
    operands = {}
    for seq in seqs:
        xs = gen.standard_normal((1, seq, c)).astype(dtype)
        state = gen.standard_normal((1, c, w)).astype(dtype)
        operands[seq] = [xs, state]
        want_y, want_st = reference(xs, weight, state)
        for label, runnable in runnables.items():
            got_y, got_st = (o.to_numpy() for o in runnable.run([xs, state]))
            err = np.abs(got_y - want_y).max() / np.abs(want_y).max()
            limit = 1e-5 if dtype == np.float32 else 1e-2  # f16: each of the W products and sums rounds to 11 bits
            assert got_y.shape == want_y.shape and err < limit, f"{label}, S={seq}: y error {err:.1e}"
            assert np.array_equal(got_st, want_st.astype(dtype)), f"{label}, S={seq}: state differs"
    for _ in range(args.rounds):  # interleaved, so that a slow spell of the machine hits every form alike
        for seq in seqs:
            for label, runnable in runnables.items():
                times, start = [], time.perf_counter()
                while len(times) < 3 or time.perf_counter() - start < args.budget / args.rounds / len(seqs):
                    t0 = time.perf_counter()
                    runnable.run(operands[seq])
                    times.append(time.perf_counter() - t0)
                timed.setdefault((label, seq), []).append(1e3 * statistics.median(times))
    load = os.getloadavg()[0]
    print(f"Short conv, C={c}, W={w}, B=1, S symbolic, {args.dtype}, one tract thread; ms: the fastest of {args.rounds} "
          f"interleaved rounds' medians; x = fused / form; load average {load:.2f} ({os.cpu_count()} cores)\n")
    print("| form | " + " | ".join(f"S={s} ms | x" for s in seqs) + " |")
    print("|---|" + "---|---|" * len(seqs))
    for label in runnables:
        cells = []
        for seq in seqs:
            ms = min(timed[(label, seq)])
            cells += [f"{ms:.3f}", f"{min(timed[('fused', seq)]) / ms:.2f}x" if "fused" in runnables else "-"]
        print(f"| {label} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
