"""One MoE feed-forward in tract: the sparse ``tract_moe_ffn`` against the dense form, side by side in one run.

    python benchmarks/bench_moe.py [--experts 64] [--top-k 8] [--hidden 2048] [--inner 512] [--tokens 1 128]
                                   [--dtype float32] [--budget 3] [--routing softmax_topk]

The layer is what the Qwen families export for their routed experts (``gdn_export.models.blocks.routed_moe``:
softmax top-k routing renormalized, SwiGLU experts as ``moe_ffn`` takes them: ``gate_proj``/``up_proj [E, I, D]``,
``down_proj [E, D, I]``; the shared expert, the same in both forms, is left out). It is exported twice
through ``gdn_export.export``: ``runtime="cpu"`` writes ``tract_moe_ffn`` (only the top-k experts of a token run),
``runtime="any"`` the dense form (every expert on every token, mixed by the routing weights: what every MoE family
ran before, and what a refused node still gets). ``--routing grouped_sigmoid`` routes as Kimi Linear / DeepSeek-V3
instead (``blocks.grouped_sigmoid_routing``: 8 groups, the best 4, a score bias, scaling 2.5), which tract has no
gate mode for: the sparse form is then ``tract_moe_ffn`` gate 'raw' over ``[x | routing]`` with the stacks widened
by E zero columns (gdn_export/ops/moe_ffn/op.py), the routing computed in the graph. With ``--dtype float32`` (and
inner sizes of whole 32-blocks) a third form is timed: the sparse archive with its three expert stacks in tract's
Q4_0 (what ``gdn-export convert --quantize q4_0`` writes for them: the same graph, the stacks' ``.dat`` files
re-encoded here), its error given against the f32 sparse output. The graphs are planned for the token count N
(tract's symbol fixed), run on one tract thread (``RAYON_NUM_THREADS=1`` unless set: tract's fused op otherwise spreads over every
core; CPU time / wall time is printed to show it), timed as a median, and compared with
each other and with the op's torch kernel. Random weights, N(0, 1/fan_in).
"""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

# tract's OptMoeFfn runs its experts on rayon's pool (all cores; CPU/wall 1.8 on 2 cores) while its matmuls and
# the dense form run on one: one thread for both unless the caller says otherwise
os.environ.setdefault("RAYON_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import gdn_export  # noqa: E402
from gdn_export.models import blocks  # noqa: E402
from gdn_export.ops.moe_ffn.op import QUALNAME, widening  # noqa: E402
from gdn_export.run.runtime import load_tract_model, steady_allocator  # noqa: E402
from gdn_export.weights import q4_0  # noqa: E402


class RoutedExperts(torch.nn.Module):
    """x [N, D] -> the routed experts' output [N, D] (Qwen3-Next / Qwen3.5-MoE routing, norm_topk_prob)."""

    def __init__(self, experts: int, hidden: int, inner: int, top_k: int, dtype: torch.dtype,
                 routing: str = "softmax_topk") -> None:
        super().__init__()
        self.routing = routing
        self.register_buffer("score_bias", torch.linspace(-0.1, 0.1, experts))
        gen = torch.Generator().manual_seed(0)
        self.router = torch.nn.Parameter(torch.randn(experts, hidden, generator=gen).to(dtype) / hidden ** 0.5)
        gate_up = (torch.randn(experts, 2 * inner, hidden, generator=gen) / hidden ** 0.5).to(dtype)
        down = (torch.randn(experts, hidden, inner, generator=gen) / inner ** 0.5).to(dtype)
        extra = widening(routing, experts)  # a given routing's stacks come widened by E zeros (ops/moe_ffn.py)
        gate_up = torch.nn.functional.pad(gate_up, (0, extra))
        self.gate_proj, self.up_proj = (torch.nn.Parameter(half.contiguous()) for half in gate_up.chunk(2, dim=1))
        self.down_proj = torch.nn.Parameter(torch.nn.functional.pad(down, (0, 0, 0, extra)))
        self.top_k = top_k

    def forward(self, x):
        if self.routing == "grouped_sigmoid":  # the router in f32 whatever the dtype, as Kimi Linear runs it
            logits = x.float() @ self.router.float().T
            groups = 8 if self.router.shape[0] % 8 == 0 else 1
            routing = blocks.grouped_sigmoid_routing(logits, self.score_bias, top_k=self.top_k, groups=groups,
                                                     top_groups=max(1, groups // 2), normalize=True, scaling=2.5)
        else:
            routing = blocks.top_k_routing(x @ self.router.T, self.top_k, True)
        return blocks.routed_moe(x, routing, self.router, self.gate_proj, self.up_proj, self.down_proj, self.top_k,
                                 self.routing)


STACKS = ("gate_proj", "up_proj", "down_proj")


def with_q4_0_stacks(archive: Path, out: Path) -> None:
    """``archive`` with the float32 ``.dat`` of each expert stack re-encoded in tract's Q4_0 (the graph unchanged)."""
    with tarfile.open(archive) as tar, tarfile.open(out, "w:gz") as new:
        for member in tar.getmembers():
            data = tar.extractfile(member).read()
            if Path(member.name).name.removesuffix(".dat") in STACKS:
                header = np.frombuffer(data[:128], np.uint32)  # NNEF: rank at byte 8, the extents from byte 12
                shape = tuple(int(d) for d in header[3:3 + header[2]])
                value = np.frombuffer(data[128:], np.float32).reshape(shape)
                buffer = io.BytesIO()
                q4_0.write_nnef(buffer, shape, lambda start, stop: value[start:stop])
                data = buffer.getvalue()
                member.size = len(data)
            new.addfile(member, io.BytesIO(data))


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown CPU"
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")),
                "unknown CPU")


def timed(runnable, x: np.ndarray, budget_s: float, min_runs: int = 5) -> tuple[float, float, np.ndarray]:
    """(median ms, CPU time / wall time over the timed runs, output)."""
    out = runnable.run([x])[0].to_numpy()  # warm-up
    times = []
    cpu0, wall0 = time.process_time(), time.perf_counter()
    while len(times) < min_runs or time.perf_counter() - wall0 < budget_s:
        t0 = time.perf_counter()
        runnable.run([x])
        times.append(time.perf_counter() - t0)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    return 1e3 * float(np.median(times)), cpu / wall, out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--inner", type=int, default=512, help="expert intermediate width")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 128], help="N: 1 is a decode step")
    parser.add_argument("--dtype", choices=["float32", "float16"], default="float32")
    parser.add_argument("--budget", type=float, default=3.0, help="seconds of timing per cell")
    parser.add_argument("--routing", choices=["softmax_topk", "grouped_sigmoid"], default="softmax_topk",
                        help="Qwen's softmax top-k, or Kimi Linear's DeepSeek-V3 grouped sigmoid")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    steady_allocator()
    dtype = getattr(torch, args.dtype)
    module = RoutedExperts(args.experts, args.hidden, args.inner, args.top_k, dtype, args.routing).eval()
    weight_mb = sum(p.numel() * p.element_size() for p in module.parameters()) / 1e6
    x_example = torch.randn(3, args.hidden).to(dtype)

    with tempfile.TemporaryDirectory() as folder:
        paths, reasons = {}, {}
        for form, runtime in (("sparse", "cpu"), ("dense", "any")):
            paths[form] = Path(folder) / f"{form}.nnef.tgz"
            t0 = time.perf_counter()
            report = gdn_export.export(module, (x_example,), paths[form], input_names=["x"], output_names=["y"],
                                       dynamic_axes={"x": {0: "N"}}, runtime=runtime, check=False)
            (decision,) = [d for d in report.decisions if d.entry == QUALNAME]
            reasons[form] = f"{decision.lowering} - {decision.reason}"
            print(f"exported {form} ({time.perf_counter() - t0:.0f} s): {reasons[form]}", flush=True)
        forms = ["sparse", "dense"]
        if dtype == torch.float32 and all(q4_0.quantizable(tuple(getattr(module, s).shape)) for s in STACKS):
            paths["q4_0"] = Path(folder) / "q4_0.nnef.tgz"
            with_q4_0_stacks(paths["sparse"], paths["q4_0"])
            forms.insert(1, "q4_0")
        print(f"\nOne MoE layer ({args.routing} routing): {args.experts} experts, top-{args.top_k}, hidden "
              f"{args.hidden}, expert width "
              f"{args.inner}, {args.dtype} ({weight_mb:.0f} MB of expert weights), tract "
              f"{gdn_export.run.runtime.tract_version()}, RAYON_NUM_THREADS={os.environ['RAYON_NUM_THREADS']}, "
              f"{cpu_name()}\n")
        quantized = "q4_0" in forms
        header = ("| tokens N | sparse tract_moe_ffn ms | " + ("sparse, Q4_0 stacks ms | " if quantized else "") +
                  "dense ms | dense / sparse | " + ("sparse / Q4_0 | " if quantized else "") + "sparse tokens/s | "
                  "CPU/wall sparse, dense | max rel. diff sparse vs dense | vs torch |" +
                  (" Q4_0 vs sparse (rel. L2) |" if quantized else ""))
        print(header)
        print("|---" * (header.count("|") - 1) + "|")
        gen = torch.Generator().manual_seed(1)
        for tokens in args.tokens:
            x = torch.randn(tokens, args.hidden, generator=gen).to(dtype)
            results = {}
            for form in forms:
                runnable = load_tract_model(paths[form], {"N": tokens})
                results[form] = timed(runnable, x.numpy(), args.budget)
                del runnable
            with torch.no_grad():
                expected = module(x.float() if dtype == torch.float32 else x).double().numpy()
            sparse, dense = results["sparse"][2].astype(np.float64), results["dense"][2].astype(np.float64)
            scale = np.abs(expected).max()
            q4 = f"{results['q4_0'][0]:.2f} | " if quantized else ""
            q4_ratio = f"{results['sparse'][0] / results['q4_0'][0]:.2f}x | " if quantized else ""
            q4_error = (f" {np.linalg.norm(results['q4_0'][2] - sparse) / np.linalg.norm(sparse):.3f} |"
                        if quantized else "")
            print(f"| {tokens} | {results['sparse'][0]:.2f} | {q4}{results['dense'][0]:.2f} | "
                  f"{results['dense'][0] / results['sparse'][0]:.1f}x | {q4_ratio}"
                  f"{1e3 * tokens / results['sparse'][0]:.0f} | "
                  f"{results['sparse'][1]:.2f}, {results['dense'][1]:.2f} | "
                  f"{np.abs(sparse - dense).max() / scale:.1e} | {np.abs(sparse - expected).max() / scale:.1e} |"
                  f"{q4_error}", flush=True)


if __name__ == "__main__":
    main()
