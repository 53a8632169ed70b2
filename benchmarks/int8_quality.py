"""Quality of ``--quantize int8`` against llama.cpp's Q8_0 on the checkpoint of ``bench_vs_llamacpp.py``, where
tract's int8 matmuls are too slow to run the archive (a CPU without int8 dot-product instructions).

    python benchmarks/int8_quality.py --llama-cpp DIR [--layers 24] [--prompt 512] [--decode 64] [--passes 1 2]
                                      [--workdir DIR]

The int8 numbers come from transformers' own model computing exactly what the int8 graph computes: every linear
weight through ``gdn_export.weights.int8.round_trip`` (codes and per-channel scales), the embedding table too (the
archive's int8 table), and each linear layer's input rounded per row as the graph rounds it (``reference_hooks``):
the reference the int8 check judges tract against (tests/test_int8.py; equal to tract up to rounding flips). Both
sides are compared with transformers' float32 model on the same token ids, at the positions generation reads (the
prompt's last and each decode step's): max |logit difference|, mean KL (nats), top-1 agreement, as
``bench_vs_llamacpp.py`` prints them.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_vs_llamacpp as bench  # noqa: E402


def int8_logits(checkpoint: Path, tokens: np.ndarray, passes: int = 1) -> np.ndarray:
    import torch
    import transformers
    from torch import nn

    from gdn_export.weights import int8

    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    linear = []
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)) and module.weight.dim() == 2:
                module.weight = nn.Parameter(int8.round_trip(module.weight), requires_grad=False)  # unties the head
                if isinstance(module, nn.Linear):
                    linear.append(name)
        int8.reference_hooks(model, frozenset(linear), passes=passes)
        return model(torch.from_numpy(tokens.astype(np.int64))[None]).logits[0].float().numpy()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bench.add_llama_cpp_options(parser, required=True)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--decode", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cpu", type=int, default=0)
    parser.add_argument("--passes", type=int, nargs="+", default=[1, 2], help="int8 input rounding passes to score "
                        "(--int8-passes of convert)")
    parser.add_argument("--workdir", type=Path)
    args = parser.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="int8_quality_"))
    workdir.mkdir(parents=True, exist_ok=True)
    llama = bench.LlamaCpp(args.llama_cpp, workdir, args.llama_cpp_build)
    checkpoint = workdir / "checkpoint"
    built = bench.build_checkpoint(checkpoint, args.layers, args.seed)
    tokens = np.random.default_rng(args.seed).integers(0, bench.TOKENIZER_SIZE, args.prompt + args.decode,
                                                       dtype=np.int32)
    tokens_path = workdir / "tokens.i32"
    tokens.tofile(tokens_path)
    bench.run_worker(["reference", str(checkpoint), str(tokens_path), str(workdir / "reference.npy")], None)
    judged = slice(args.prompt - 1, args.prompt + args.decode)
    reference = np.load(workdir / "reference.npy")[judged]
    ours = {p: bench.compare(reference, int8_logits(checkpoint, tokens, p)[judged]) for p in args.passes}
    f32, q8 = workdir / "model-F32.gguf", workdir / "model-Q8_0.gguf"
    llama.convert(checkpoint, f32, "f32")
    llama.quantize(f32, q8, "Q8_0")
    f32.unlink()
    theirs = bench.compare(reference, llama.logits(q8, tokens_path, workdir / "logits.f32", args.cpu)[judged])
    q8.unlink()
    print(f"Qwen3.5 0.8B text shape, {args.layers} layers, random weights ({built.parameters / 1e9:.3f} B), "
          f"{args.decode + 1} positions against transformers float32")
    print("| engine | format | max logit err | mean KL (nats) | top-1 agree |")
    print("|---|---|---|---|---|")
    rows = [("gdn_export (torch emulation of the graph)", f"int8 --int8-passes {p}", r) for p, r in ours.items()]
    for engine, label, r in rows + [("llama.cpp", "Q8_0", theirs)]:
        print(f"| {engine} | {label} | {r['max_err']:.2e} | {r['kl']:.2e} | {100 * r['top1']:.1f}% |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
