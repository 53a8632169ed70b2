"""How fast can tract run one decode step of the GDN core? Exported graphs against hand-written floors.

    python benchmarks/bench_decode_floor.py [--heads 16] [--width 128] [--budget 2]

One token, B=1, H heads of a KxK f32 state, one tract thread, all measured side by side in one run
(ratios against the fused op of the same run):
- the exported graphs (one symbolic-S graph each, as gdn_export writes them): fused op, portable scan,
  chunked (its per-token tail is what runs for one token); the scan and chunked ones also planned with S = 1
  (``load_tract_model(path, {"S": 1})``, as ``gdn_export.Engine`` plans its decode steps: tract then inlines
  the one-step scan and drops the empty chunk part);
- hand-written NNEF graphs of one step with static shapes, no scan, no S: the cheapest forms tract can run,
  i.e. what a dedicated decode graph could reach: elementwise (decay, erase, write, readout as broadcasts
  and reductions), and matmul reads (``[e; q] S``, the decay moved onto what is read: ``w = u - d e^T S``,
  ``y = d q^T S + (q . k) w``) with the rank-1 update as an einsum or as one elementwise pass
  (``S' = d S + k w^T``);
- a single pass over the state (``S * decay``), the cost of touching the state once;
- torch eager on the same step (gdn_export's reference, one thread).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import gdn_export  # noqa: E402
import gdn_export.run.runtime  # noqa: E402,F401  (load_tract_model; not imported by the facade)
from bench_lowerings import NAMES, Rule, add_allocator_option, apply_allocator_option, inputs, median_ms  # noqa: E402

STEP_BODIES = {
    "one step, elementwise (static, no scan)": """
    sd = s * decay;
    r = sum_reduce(sd * transpose(e, axes = [0, 1, 3, 2]), axes = [2]);
    s_new = sd + transpose(k, axes = [0, 1, 3, 2]) * (u - r);
    y = sum_reduce(s_new * transpose(q, axes = [0, 1, 3, 2]), axes = [2]);
""",
    "one step, matmul reads + einsum update (static, no scan)": """
    rr = matmul(concat([e, q], axis = 2), s);
    w = u - slice(rr, axes = [2], begin = [0], end = [1]) * decay;
    s_new = s * decay + tract_core_einsum([k, w], expr = "bhik,bhiv->bhkv", acc = "f32");
    y = slice(rr, axes = [2], begin = [1], end = [2]) * decay + sum_reduce(q * k, axes = [3]) * w;
""",
    "one step, matmul reads + elementwise update (static, no scan)": """
    rr = matmul(concat([e, q], axis = 2), s);
    w = u - slice(rr, axes = [2], begin = [0], end = [1]) * decay;
    s_new = s * decay + transpose(k, axes = [0, 1, 3, 2]) * w;
    y = slice(rr, axes = [2], begin = [1], end = [2]) * decay + sum_reduce(q * k, axes = [3]) * w;
""",
    "one pass over the state only (S * decay)": """
    s_new = s * decay;
    y = u * decay;
""",
}


def step_graph(body: str, heads: int, width: int) -> str:
    row = f"[1, {heads}, 1, {width}]"
    return f"""version 1.0;
extension tract_registry tract_core;
graph step(q, e, k, u, decay, s) -> (y, s_new) {{
    q = external<scalar>(shape = {row});
    e = external<scalar>(shape = {row});
    k = external<scalar>(shape = {row});
    u = external<scalar>(shape = {row});
    decay = external<scalar>(shape = [1, {heads}, 1, 1]);
    s = external<scalar>(shape = [1, {heads}, {width}, {width}]);
{body}
}}
"""


def step_reference(q, e, k, u, decay, s):
    """The per-token step of docs/MATH.md with q, k normalized and e = beta k, u = beta v given; float64."""
    q, e, k, u, decay, s = (np.asarray(x, np.float64) for x in (q, e, k, u, decay, s))
    sd = s * decay
    s_new = sd + np.swapaxes(k, 2, 3) * (u - e @ sd)
    return q @ s_new, s_new


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--budget", type=float, default=2.0, help="seconds of timing per row")
    parser.add_argument("--rounds", type=int, default=4, help="interleaved rounds; a row's time is its fastest "
                        "round's median")
    add_allocator_option(parser)
    args = parser.parse_args(argv)
    apply_allocator_option(args)
    torch.set_num_threads(1)
    import tract

    h, w = args.heads, args.width
    rows: dict[str, callable] = {}
    with tempfile.TemporaryDirectory() as tmp:
        dynamic = {name: {1: "S"} for name in NAMES[:5]}
        token = [x.numpy() for x in inputs(1, h, w)]
        for lowering, label in (("native", "exported: fused op"), ("scan", "exported: portable scan"),
                                ("chunked", "exported: chunked (per-token tail)")):
            path = Path(tmp) / f"{lowering}.nnef.tgz"
            gdn_export.export(Rule(), inputs(2, h, w), path, lowering=lowering, input_names=NAMES,
                              output_names=["o", "state"], dynamic_axes=dynamic, check=False)
            runnable = gdn_export.run.runtime.load_tract_model(path)
            rows[label] = lambda r=runnable: r.run(token)
            if lowering != "native":  # the same archive planned for one token (Engine's decode plans): S = 1 known
                planned = gdn_export.run.runtime.load_tract_model(path, {"S": 1})
                rows[f"{label}, planned with S = 1"] = lambda r=planned: r.run(token)
        gen = np.random.default_rng(0)
        operands = [(gen.standard_normal((1, h, 1, w)) / np.sqrt(w)).astype(np.float32) for _ in range(4)]
        operands += [gen.random((1, h, 1, 1)).astype(np.float32), gen.standard_normal((1, h, w, w)).astype(np.float32)]
        expected = step_reference(*operands)
        for index, (label, body) in enumerate(STEP_BODIES.items()):
            folder = Path(tmp) / f"step{index}"
            folder.mkdir()
            (folder / "graph.nnef").write_text(step_graph(body, h, w))
            runnable = tract.nnef().with_tract_transformers().load(str(folder)).into_runnable()
            if "only" not in label:  # the floors compute the real step: check them
                got = [o.to_numpy() for o in runnable.run(operands)]
                for value, want in zip(got, expected):
                    err = np.abs(value - want).max() / np.abs(want).max()
                    assert err < 1e-5, f"{label}: error {err:.1e}"
            rows[label] = lambda r=runnable: r.run(operands)
        torch_token = inputs(1, h, w)
        rows["torch eager reference (1 thread)"] = lambda: Rule()(*torch_token)
        rounds = {label: [] for label in rows}
        for _ in range(args.rounds):  # interleaved, so that a slow spell of the machine hits every row alike
            for label, fn in rows.items():
                rounds[label].append(median_ms(fn, args.budget / args.rounds, max_runs=2000))
        timed = {label: min(times) for label, times in rounds.items()}
    fused = timed["exported: fused op"]
    print(f"One decode step, H={h}, K=V={w}, B=1, f32, tract 1 thread; ms: the fastest of {args.rounds} interleaved "
          f"rounds' medians (x = fused op / row, same run)\n")
    print("| graph | ms | x |\n|---|---|---|")
    for label, ms in timed.items():
        print(f"| {label} | {ms:.3f} | {fused / ms:.2f}x |")


if __name__ == "__main__":
    main()
