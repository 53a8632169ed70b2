"""Conversion time and tract speed of converted models, against transformers' eager model on the same threads.

    python benchmarks/bench_convert.py [--fixtures] [--realistic [--onnx-threads 1 2]] [--threads 1] [--prompt 128]
                                       [--decode 16]
    python benchmarks/bench_convert.py --large [--size-gb 3.2] [--keep DIR] [--dtype float32|float16]
                                       [--check none|auto] [--layers N] [--hidden H] [--vocab V] [--build-only]

For each bundled fixture (--fixtures) and for one model of realistic size built from a real Qwen3.5
config with random weights (--realistic: hidden 1024, 24 layers, 3 GDN layers per full-attention layer,
K = V = 128; vocab cut to 32000 to keep the file small), it reports: conversion time (export +
check), tract prefill tokens/s at S=--prompt and decode tokens/s (one token per call, states carried),
and transformers' eager model doing the same with its own cache, with tract/transformers ratios measured
in the same run. tract runs on one thread; torch uses --threads. --onnx-threads adds rows for the realistic model
exported to ONNX (gdn-export convert --format onnx, checked) and run in onnxruntime on each thread count.

--large: conversion memory on a checkpoint of real size. large_checkpoint.py writes a Qwen3.5-text checkpoint of
at least --size-gb GB of random bf16 weights (hidden 2048, vocab 151936, untied, as many 3:1 layers as the size
needs; --layers / --hidden / --vocab shrink it; --experts E makes it Qwen3.5-MoE with per-expert tensors, as
published) shard by shard, in a temp dir or --keep DIR (reused there when it matches). `gdn-export convert` then runs under /usr/bin/time -v while a thread reads the converter's
/proc/PID/status every 50 ms: one table of sizes, wall and stage seconds (the report's "time:" line), peak RSS
(time -v), peak RssAnon (what the conversion holds) and RssFile (the checkpoint's mapped pages), and the two
targets, judged on RssAnon: < 1.5 GB and < a quarter of the float32 model. --quantize q4_0 converts with it. GB = 1e9 bytes throughout.
--build-only writes (and, without --keep, deletes) the checkpoint and reports the builder's own peak RSS.
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gdn_export.hf.check import sample_tokens, session_logits, transformers_logits  # noqa: E402
from gdn_export.hf.checkpoint import load_model, read_config  # noqa: E402
from gdn_export.pipeline.convert import convert  # noqa: E402
from gdn_export.hf.families import all_families, family_for  # noqa: E402
from gdn_export.run.session import Session  # noqa: E402
from bench_lowerings import add_allocator_option, apply_allocator_option  # noqa: E402
import large_checkpoint  # noqa: E402

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


CONVERTED: dict = {}  # out path -> (report, seconds)


def measure(name: str, checkpoint: Path, out: Path, prompt: int, decode: int, onnx_threads: int | None = None) -> dict:
    """Convert (and check) ``checkpoint`` into ``out``, then tokens/s of tract (or, with ``onnx_threads``, of the ONNX
    export in onnxruntime on that many threads) and of transformers' eager model on the same tokens."""
    if out in CONVERTED:  # an ONNX file measured again on another thread count
        report, convert_s = CONVERTED[out]
    else:
        start = time.perf_counter()
        report = convert(checkpoint, out, force=True, check=True, prompt_len=8, decode_steps=2,
                         **({"format": "onnx"} if onnx_threads else {}))
        convert_s = time.perf_counter() - start
        CONVERTED[out] = report, convert_s
    config = read_config(checkpoint)
    hf_model = load_model(checkpoint, family_for(config["model_type"]), config)
    if onnx_threads:
        from gdn_export.backends.onnx import OnnxSession

        session = OnnxSession(out, "onnxruntime", threads=onnx_threads)
    else:
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


PEAK_TARGET_BYTES = 1.5e9  # the converter's peak RssAnon: < 1.5 GB ...
FLOAT32_FRACTION = 0.25  # ... and < a quarter of the model in float32
STATUS_FIELDS = ("VmRSS", "RssAnon", "RssFile")
SAMPLE_SECONDS = 0.05


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``, from /proc/PID/task/*/children (or the PPid fields of /proc when absent)."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        kids = _children(parent)
        found += kids
        todo += kids
    return found


def _children(pid: int) -> list[int]:
    tasks = list(Path(f"/proc/{pid}/task").glob("*/children"))
    if tasks:
        kids = []
        for path in tasks:
            try:
                kids += [int(k) for k in path.read_text().split()]
            except OSError:  # the task ended
                pass
        return kids
    kids = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = _status_fields(status.read_text(), ("PPid",))
        except OSError:
            continue
        if fields.get("PPid") == pid:
            kids.append(int(status.parent.name))
    return kids


def _status_fields(text: str, names: tuple[str, ...]) -> dict[str, int]:
    """Integer fields of /proc/PID/status: memory in bytes (the file says kB), PPid as is."""
    values = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in names:
            number, *unit = rest.split()
            values[key] = int(number) * (1024 if unit == ["kB"] else 1)
    return values


class MemorySampler(threading.Thread):
    """Peak VmRSS, RssAnon and RssFile of the processes below ``pid`` (summed over them), every 50 ms."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.peaks, self.samples = pid, dict.fromkeys(STATUS_FIELDS, 0), 0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            self.sample()
            self.done.wait(SAMPLE_SECONDS)

    def sample(self) -> None:
        totals = dict.fromkeys(STATUS_FIELDS, 0)
        for pid in descendants(self.pid):
            try:
                fields = _status_fields(Path(f"/proc/{pid}/status").read_text(), STATUS_FIELDS)
            except OSError:  # ended between the listing and the read
                continue
            for key in STATUS_FIELDS:
                totals[key] += fields.get(key, 0)
        if totals["VmRSS"]:
            self.samples += 1
        for key in STATUS_FIELDS:
            self.peaks[key] = max(self.peaks[key], totals[key])

    def stop(self) -> dict[str, int]:
        self.done.set()
        self.join()
        return self.peaks


def stage_seconds(report: str) -> dict[str, float]:
    """``name N.Ns`` pairs of the report's ``  time:`` line, whatever the stages are called."""
    for line in report.splitlines():
        if line.startswith("  time:"):
            return {name: float(value) for name, value in re.findall(r"([A-Za-z_][\w-]*) (\d+(?:\.\d+)?)s\b", line)}
    return {}


def time_max_rss(text: str) -> int:
    """``Maximum resident set size (kbytes)`` of /usr/bin/time -v, in bytes (0 when absent)."""
    match = re.search(r"Maximum resident set size \(kbytes\): (\d+)", text)
    return int(match.group(1)) * 1024 if match else 0


def gdn_export_command() -> list[str]:
    script = Path(sys.executable).with_name("gdn-export")
    return [str(script)] if script.is_file() else [shutil.which("gdn-export") or "gdn-export"]


def convert_measured(checkpoint: Path, out: Path, dtype: str, check: str, quantize: str | None = None) -> dict:
    """`gdn-export convert` under /usr/bin/time -v, sampled; its report's stdout is echoed."""
    timing = out.with_suffix(".time-v.txt")
    command = ["/usr/bin/time", "-v", "-o", str(timing), *gdn_export_command(), "convert", str(checkpoint),
               "-o", str(out), "--force", "--dtype", dtype] + (["--no-check"] if check == "none" else []) + (
               ["--quantize", quantize] if quantize else [])
    print("$ " + " ".join(command), file=sys.stderr, flush=True)
    start = time.perf_counter()
    child = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    sampler = MemorySampler(child.pid)
    sampler.start()
    stdout, _ = child.communicate()
    wall = time.perf_counter() - start
    peaks = sampler.stop()
    sys.stderr.write(stdout)
    if child.returncode != 0:
        raise SystemExit(f"gdn-export convert failed with status {child.returncode}")
    return {"wall_s": wall, "stages": stage_seconds(stdout), "time_rss": time_max_rss(timing.read_text()),
            "rss": peaks["VmRSS"], "anon": peaks["RssAnon"], "file": peaks["RssFile"], "samples": sampler.samples,
            "archive": out.stat().st_size}


def large_table(built: large_checkpoint.Built, dtype: str, row: dict) -> str:
    gb = large_checkpoint.GB
    quarter = FLOAT32_FRACTION * built.float32_bytes
    stages = list(row["stages"])
    head = (["checkpoint GB (bf16)", "float32 GB", "export dtype", "archive GB", "wall s"] + [f"{s} s" for s in stages]
            + ["peak RSS GB (time -v)", "peak RssAnon GB", "peak RssFile GB",
               f"RssAnon < {PEAK_TARGET_BYTES / gb:.1f} GB", f"RssAnon < float32/4 ({quarter / gb:.2f} GB)"])
    cells = ([f"{built.bytes / gb:.2f}", f"{built.float32_bytes / gb:.2f}", dtype, f"{row['archive'] / gb:.2f}",
              f"{row['wall_s']:.1f}"] + [f"{row['stages'][s]:.1f}" for s in stages]
             + [f"{row['time_rss'] / gb:.2f}", f"{row['anon'] / gb:.2f}", f"{row['file'] / gb:.2f}",
                _verdict(row["anon"] < PEAK_TARGET_BYTES), _verdict(row["anon"] < quarter)])
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head), "| " + " | ".join(cells) + " |"])


def _verdict(ok: bool) -> str:
    return "pass" if ok else "FAIL"


def run_large(args: argparse.Namespace) -> None:
    config = large_checkpoint.config_from_args(args)
    with tempfile.TemporaryDirectory(prefix="gdn_large_") as tmp:
        folder = args.keep or Path(tmp) / "qwen3_5_large"
        if args.keep and large_checkpoint.matches(folder, config):
            built = large_checkpoint.existing(folder, config)
            print(f"reusing {built}", file=sys.stderr)
        else:
            print(f"building {config.num_hidden_layers} layers (hidden {config.hidden_size}, "
                  f"vocab {config.vocab_size}) in {folder}", file=sys.stderr, flush=True)
            built = large_checkpoint.build(folder, config, args.shard_gb, args.seed,
                                           log=lambda m: print(m, file=sys.stderr, flush=True))
        print(f"checkpoint: {built}; {large_checkpoint.disk_bytes(folder) / large_checkpoint.GB:.2f} GB of files; "
              f"this process's peak RSS so far {large_checkpoint.peak_rss_bytes() / large_checkpoint.GB:.2f} GB")
        if args.build_only:
            return
        row = convert_measured(folder, Path(tmp) / "large.nnef.tgz", args.dtype, args.check, args.quantize)
    print(f"\ngdn-export convert --dtype {args.dtype}" + (" --no-check" if args.check == "none" else "")
          + (f" --quantize {args.quantize}" if args.quantize else "")
          + f"; {config.num_hidden_layers} layers, hidden {config.hidden_size}, vocab {config.vocab_size}; "
          f"GB = 1e9 bytes; {row['samples']} samples of /proc/PID/status every {SAMPLE_SECONDS * 1000:.0f} ms\n")
    print(large_table(built, args.dtype, row))
    print(f"\npass/fail is judged on the sampled peak RssAnon (anonymous memory: what the conversion itself holds); "
          f"peak RSS and RssFile also count file pages (the memory-mapped checkpoint, shared libraries); sampled "
          f"peak VmRSS {row['rss'] / large_checkpoint.GB:.2f} GB.")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fixtures", action="store_true", help="bench every bundled fixture")
    parser.add_argument("--realistic", action="store_true", help="bench the realistic-size Qwen3.5")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--decode", type=int, default=16)
    parser.add_argument("--onnx-threads", type=int, nargs="*", default=None,
                        help="with --realistic: also the ONNX export in onnxruntime on these thread counts (1 2)")
    large = parser.add_argument_group("--large", "conversion memory on a checkpoint of real size")
    large.add_argument("--large", action="store_true", help="build a large bf16 checkpoint and measure its conversion")
    large_checkpoint.add_shape_options(large)
    large.add_argument("--keep", type=Path, default=None, help="build the checkpoint in DIR and keep it (reused)")
    large.add_argument("--dtype", choices=["float32", "float16"], default="float32", help="export dtype")
    large.add_argument("--quantize", choices=["q4_0"], default=None, help="convert with --quantize")
    large.add_argument("--check", choices=["none", "auto"], default="none",
                       help="none: --no-check; auto: the converter's own check")
    large.add_argument("--build-only", action="store_true", help="only build the checkpoint (deleted unless --keep)")
    add_allocator_option(parser)
    args = parser.parse_args(argv)
    if args.large or args.build_only:
        run_large(args)
        return
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
            for threads in args.onnx_threads if args.onnx_threads is not None else []:
                rows.append(measure(f"the same, ONNX in onnxruntime ({threads} thr)", checkpoint,
                                    tmp / "real.onnx", args.prompt, args.decode, onnx_threads=threads))
    print(f"tract 1 thread, torch {args.threads} thread(s); prefill S={args.prompt}, decode {args.decode} tokens; "
          "tokens/s (x = tract / transformers in the same run)\n")
    print("| model | GDN lowering | convert s | prefill tract (onnxruntime) | prefill transformers | decode tract "
          "(onnxruntime) | decode transformers | max logit err |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['name']} | {','.join(r['lowerings'])} | {r['convert_s']:.1f} | {r['tract_prefill']:.0f} "
              f"({r['tract_prefill'] / r['torch_prefill']:.2f}x) | {r['torch_prefill']:.0f} | {r['tract_decode']:.1f} "
              f"({r['tract_decode'] / r['torch_decode']:.2f}x) | {r['torch_decode']:.1f} | {r['max_logit_error']:.1e} |")


if __name__ == "__main__":
    main()
