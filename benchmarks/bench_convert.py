"""Conversion time and tract speed of converted models, against transformers' eager model on the same threads.

    python benchmarks/bench_convert.py [--fixtures] [--realistic] [--threads 1] [--prompt 128] [--decode 16]

For each bundled fixture (--fixtures) and for one model of realistic size built from a real Qwen3.5
config with random weights (--realistic: hidden 1024, 24 layers, 3 GDN layers per full-attention layer,
K = V = 128; vocab cut to 32000 to keep the file small), it reports: conversion time (export +
check), tract prefill tokens/s at S=--prompt and decode tokens/s (one token per call, states carried),
and transformers' eager model doing the same with its own cache, with tract/transformers ratios measured
in the same run. tract runs on one thread; torch uses --threads.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gdn_export.hf.check import sample_tokens, session_logits, transformers_logits  # noqa: E402
from gdn_export.hf.checkpoint import load_model, read_config  # noqa: E402
from gdn_export.hf.convert import convert  # noqa: E402
from gdn_export.hf.families import all_families, family_for  # noqa: E402
from gdn_export.session import Session  # noqa: E402
from bench_lowerings import add_allocator_option, apply_allocator_option  # noqa: E402

REALISTIC_QWEN3_5 = dict(
    vocab_size=32000, hidden_size=1024, intermediate_size=3584, num_hidden_layers=24, num_attention_heads=8,
    num_key_value_heads=2, head_dim=256, max_position_embeddings=4096, rms_norm_eps=1e-6,
    layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 6, linear_conv_kernel_dim=4,
    linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=16,
)


def realistic_checkpoint(folder: Path) -> Path:
    import transformers

    config = transformers.Qwen3_5TextConfig(**REALISTIC_QWEN3_5)
    torch.manual_seed(0)
    model = transformers.Qwen3_5ForCausalLM(config).eval()
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def tokens_per_second(fn, tokens: int, budget: float = 3.0, min_runs: int = 2) -> float:
    fn()  # warm-up
    runs, start = 0, time.perf_counter()
    while runs < min_runs or time.perf_counter() - start < budget:
        fn()
        runs += 1
    return tokens * runs / (time.perf_counter() - start)


def measure(name: str, checkpoint: Path, out: Path, prompt: int, decode: int) -> dict:
    start = time.perf_counter()
    report = convert(checkpoint, out, force=True, check=True, prompt_len=8, decode_steps=2)
    convert_s = time.perf_counter() - start
    config = read_config(checkpoint)
    hf_model = load_model(checkpoint, family_for(config["model_type"]), config)
    session = Session(out, steady_allocator=False)  # main() applied --glibc-default-allocator
    tokens = sample_tokens(hf_model.config.vocab_size, 1, prompt + decode)
    ids = torch.from_numpy(tokens)

    def tract_prefill():
        session.reset()
        session.prefill(tokens[:, :prompt])

    def torch_prefill():
        with torch.no_grad():
            hf_model(input_ids=ids[:, :prompt], use_cache=True)

    row = {"name": name, "convert_s": convert_s, "lowerings": sorted({l.lowering for l in report.layers if l.lowering != "-"})}
    row["tract_prefill"] = tokens_per_second(tract_prefill, prompt)
    row["torch_prefill"] = tokens_per_second(torch_prefill, prompt)
    # prefill then one token per call with the states / cache carried (the check's loops); the decode loop is timed
    for side, loop, model in (("tract", session_logits, session), ("torch", transformers_logits, hf_model)):
        seconds: list[float] = []
        loop(model, tokens, prompt)  # warm-up
        while len(seconds) < 3:
            loop(model, tokens, prompt, decode_seconds=seconds)
        row[f"{side}_decode"] = decode / statistics.median(seconds)
    row["max_logit_error"] = report.check.max_abs_error if report.check else float("nan")
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fixtures", action="store_true", help="bench every bundled fixture")
    parser.add_argument("--realistic", action="store_true", help="bench the realistic-size Qwen3.5")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--decode", type=int, default=16)
    add_allocator_option(parser)
    args = parser.parse_args(argv)
    apply_allocator_option(args)
    if not (args.fixtures or args.realistic):
        args.fixtures = True
    torch.set_num_threads(args.threads)
    supported = {t for f in all_families() for t in f.model_types}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if args.fixtures:
            for folder in sorted((ROOT / "fixtures").iterdir()):
                if (folder / "config.json").is_file() and read_config(folder)["model_type"] in supported:
                    rows.append(measure(folder.name, folder, tmp / f"{folder.name}.nnef.tgz", args.prompt, args.decode))
                    print(f"done {folder.name}", file=sys.stderr)
        if args.realistic:
            checkpoint = realistic_checkpoint(tmp / "qwen3_5_realistic")
            rows.append(measure("Qwen3.5 hidden 1024 x 24 layers (random)", checkpoint, tmp / "real.nnef.tgz",
                                args.prompt, args.decode))
    print(f"tract 1 thread, torch {args.threads} thread(s); prefill S={args.prompt}, decode {args.decode} tokens; "
          "tokens/s (x = tract / transformers in the same run)\n")
    print("| model | GDN lowering | convert s | prefill tract | prefill transformers | decode tract | decode transformers | max logit err |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['name']} | {','.join(r['lowerings'])} | {r['convert_s']:.1f} | {r['tract_prefill']:.0f} "
              f"({r['tract_prefill'] / r['torch_prefill']:.2f}x) | {r['torch_prefill']:.0f} | {r['tract_decode']:.0f} "
              f"({r['tract_decode'] / r['torch_decode']:.2f}x) | {r['torch_decode']:.0f} | {r['max_logit_error']:.1e} |")


if __name__ == "__main__":
    main()
