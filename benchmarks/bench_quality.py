"""Quality per format on a trained model and real text: gdn_export against llama.cpp, one run (issue 24 item 4).

    python benchmarks/bench_quality.py [--checkpoint fixtures/qwen3_5_trained] [--text heldout.txt] [--ctx 256]
                                       [--llama-cpp DIR] [--calibration-tokens 8192] [--workdir DIR] [--markdown]

What it does, in this order, all in one run:

1. The calibration text: files of the trained model's TRAINING split (``fixtures/train_qwen3_5.py``'s corpus rule:
   the standard library's modules, less the held-out and validation ones), every 7th file in path order, until
   ``--calibration-bytes``; never ``heldout.txt``. Both engines calibrate on this one file: gdn_export's
   ``--calibration`` reads its first ``--calibration-tokens`` tokens in windows of 512, llama-imatrix reads it in
   windows of 512 (``-c 512 --chunks`` tokens / 512): the same tokens up to the two tokenizers' agreement.
2. gdn_export: ``gdn-export convert`` (check on: tract against transformers with the same weights) of each format:
   f32, f16, q4_0 with ``--q4-rule nearest`` (llama.cpp's plain rule), q4_0 (the default scale search), q4_0
   ``--calibration`` (the weighted search, scales folded into norms), the same with ``--q4-rule gptq``; int8 when
   this tree's ``--quantize`` offers it. Then ``gdn-export perplexity ARCHIVE TEXT
   --ctx CTX --reference CHECKPOINT --json``: perplexity, and against transformers' float32 model on the same
   windows the mean KL divergence of the next-token distribution and top-1 agreement.
3. llama.cpp (``--llama-cpp``): ``convert_hf_to_gguf.py`` F32 and F16 of the same checkpoint (through
   bench_vs_llamacpp.py's wrapper: the trained tokenizer's pre-tokenizer hash is unknown to the converter, which
   then gets ``--gguf-pre``, Qwen2's split regex as the trained tokenizer has), ``llama-quantize`` Q8_0 and Q4_0 of
   the F32 GGUF (its default recipe: the table names the head's type), ``llama-imatrix`` on the calibration text then
   ``llama-quantize --imatrix`` Q4_0; the same ``--pure`` (every tensor Q4_0, as gdn_export's q4_0 has its head).
   ``llama-perplexity -c CTX`` on the same text, F32 with ``--kl-divergence-base``, the others against it with
   ``--kl-divergence``: perplexity, mean KL against F32, same top-1.
4. Greedy text: the first tokens of a held-out function as the prompt, ``--greedy-tokens`` new tokens, per format
   (gdn_export ``generate --temperature 0``; llama.cpp ``llama-completion --temp 0``).
5. Prints one table (file size, perplexity, mean KL against f32, top-1 against f32) and the greedy lines, plus the
   ratios of the issue's "Done when": q4_0 default and calibrated KL over nearest's, calibrated over llama.cpp's
   Q4_0 with the importance matrix.

Both engines score the second half of each window of CTX tokens (llama-perplexity's rule, ``gdn-export
perplexity``'s); each engine's KL is against its own float32 run (transformers' for gdn_export: tract's f32
equals it within 1e-4, see the f32 row).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "fixtures"))

GDN_FORMATS = {
    "f32": ["--dtype", "float32"],
    "f16": ["--dtype", "float16"],
    "q4_0 nearest": ["--quantize", "q4_0", "--q4-rule", "nearest"],
    "q4_0 search (the default)": ["--quantize", "q4_0"],
    "q4_0 --calibration (GPTQ)": ["--quantize", "q4_0", "--calibration", "{calibration}",
                                  "--calibration-tokens", "{tokens}"],
    "q4_0 --calibration --q4-rule search": ["--quantize", "q4_0", "--q4-rule", "search", "--calibration",
                                            "{calibration}", "--calibration-tokens", "{tokens}"],
}
START = time.perf_counter()


def log(message: str) -> None:
    print(f"[{time.perf_counter() - START:7.1f}s] {message}", file=sys.stderr, flush=True)


def call(command: list[str], env: dict | None = None, stdout_only: bool = False) -> str:
    """Run ``command``; its stdout+stderr (or stdout alone), or a RuntimeError with the end of them."""
    result = subprocess.run([str(c) for c in command], capture_output=True, text=True,
                            env={**os.environ, **(env or {})})
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, command[:4]))} ... failed ({result.returncode}):\n"
                           f"{(result.stdout + result.stderr)[-4000:]}")
    return result.stdout if stdout_only else result.stdout + result.stderr


def calibration_text(out: Path, size: int) -> str:
    """Training-split text of the trained model's corpus: the first 1200 bytes of every 5th training file in path
    order, until ``size`` bytes (many modules, not a few whole ones: measured, 8192 tokens of two whole modules made
    GPTQ worse than the plain search, of 36 modules' openings 0.73x nearest's KL)."""
    import train_qwen3_5 as recipe

    lib = recipe.stdlib_dir()
    files = [p for p in recipe.corpus_files(lib) if recipe.split_of(p.relative_to(lib)) == "train"]
    picked, parts, total = [], [], 0
    for path in files[::5]:
        text = path.read_text(encoding="utf-8")[:1200]
        parts.append(text)
        picked.append(path.relative_to(lib).as_posix())
        total += len(text)
        if total >= size:
            break
    out.write_text("\n\n".join(parts), encoding="utf-8")
    return f"the openings of {len(picked)} training-split files ({picked[0]} ... {picked[-1]}), {total:,} characters"


def held_out_prompt(text: str, chars: int = 160) -> str:
    """The start of the first function definition after the first tenth of the text: code the model never saw."""
    match = re.search(r"\ndef \w+\(", text[len(text) // 10:])
    start = len(text) // 10 + (match.start() + 1 if match else 0)
    return text[start:start + chars].rsplit("\n", 1)[0] + "\n"


def gdn_quantize_choices() -> list[str]:
    from gdn_export.weights.formats import names

    return list(names())


def gdn_row(name: str, archive: Path, text: Path, ctx: int, checkpoint: Path, prompt: str, greedy: int,
            figures: dict | None = None, windows: int | None = None) -> dict:
    """The figures of one archive (``gdn-export perplexity``, or ``figures`` computed in process) and, when
    ``greedy`` > 0, its greedy continuation of ``prompt``."""
    if figures is None:
        out = call([sys.executable, "-m", "gdn_export.cli", "perplexity", archive, text, "--ctx", ctx,
                    "--reference", checkpoint, "--json", "--quiet", *(["--chunks", windows] if windows else [])])
        figures = json.loads(out.strip().splitlines()[-1])
    generated = call([sys.executable, "-m", "gdn_export.cli", "generate", archive, "--prompt", prompt,
                      "--max-new-tokens", greedy, "--temperature", "0", "--ignore-eos"], stdout_only=True) \
        if greedy else ""
    return {"engine": "gdn_export (tract)", "format": name, "bytes": archive.stat().st_size, "ppl": figures["ppl"],
            "kl": figures["kld_mean"], "top1": figures["top1"], "ref_ppl": figures.get("ref_ppl"),
            "text": generated}


def has_perplexity_command() -> bool:
    out = subprocess.run([sys.executable, "-m", "gdn_export.cli", "--help"], capture_output=True, text=True)
    return "perplexity" in out.stdout


def in_process_figures(archives: dict[str, Path], checkpoint: Path, text: Path, ctx: int, windows_limit: int | None,
                       batch: int = 8) -> dict[str, dict]:
    """Without ``gdn-export perplexity`` (older trees): the same rule in this process. Every archive through
    ``gdn_export.Session`` (tract) and transformers' float32 model on the same windows of ``ctx`` tokens of the
    text (non-overlapping, the logits at ctx/2 .. ctx-2 predicting the next token): perplexity, mean KL(P_ref || P)
    and top-1 agreement against transformers, a batch of windows at a time."""
    import numpy as np
    import torch
    from tokenizers import Tokenizer

    from gdn_export.hf.checkpoint import load_model
    from gdn_export.run.session import Session

    ids = np.asarray(Tokenizer.from_file(str(checkpoint / "tokenizer.json")).encode(
        text.read_text(encoding="utf-8"), add_special_tokens=False).ids, np.int64)
    windows = ids[:len(ids) // ctx * ctx].reshape(-1, ctx)[:windows_limit]
    reference = load_model(checkpoint)
    sessions = {name: Session(path) for name, path in archives.items()}
    sums = {name: {"nll": 0.0, "kl": 0.0, "top1": 0} for name in ["reference", *archives]}
    count = 0
    for start in range(0, len(windows), batch):
        x = windows[start:start + batch]
        targets = torch.from_numpy(x[:, ctx // 2 + 1:])
        with torch.no_grad():
            ref = torch.log_softmax(reference(input_ids=torch.from_numpy(x), use_cache=False).logits[:, ctx // 2:-1]
                                    .double(), -1)
        sums["reference"]["nll"] -= float(ref.gather(-1, targets[..., None]).sum())
        for name, session in sessions.items():
            session.reset()
            got = torch.log_softmax(torch.from_numpy(session.prefill(x))[:, ctx // 2:-1].double(), -1)
            sums[name]["nll"] -= float(got.gather(-1, targets[..., None]).sum())
            sums[name]["kl"] += float((ref.exp() * (ref - got)).sum())
            sums[name]["top1"] += int((ref.argmax(-1) == got.argmax(-1)).sum())
        count += targets.numel()
    return {name: {"ppl": float(np.exp(v["nll"] / count)), "kld_mean": v["kl"] / count, "top1": v["top1"] / count,
                   "ref_ppl": float(np.exp(sums["reference"]["nll"] / count))}
            for name, v in sums.items() if name != "reference"}


def parse_llama_perplexity(out: str, base: bool) -> dict:
    if base:
        return {"ppl": float(re.search(r"Final estimate: PPL = ([\d.]+)", out).group(1)), "kl": 0.0, "top1": 1.0}
    return {"ppl": float(re.search(r"Mean PPL\(Q\)\s*:\s*([\d.]+)", out).group(1)),
            "kl": float(re.search(r"Mean\s+KLD:\s*(-?[\d.]+)", out).group(1)),
            "top1": float(re.search(r"Same top p:\s*([\d.]+)", out).group(1)) / 100}


def llama_rows(tree: Path, checkpoint: Path, work: Path, text: Path, calibration: Path, ctx: int, tokens: int,
               prompt: str, greedy: int, pre: str, windows: int | None, wanted=lambda name: True,
               build: Path | None = None) -> list[dict]:
    from bench_vs_llamacpp import LlamaCpp

    llama = LlamaCpp(tree, work, build)
    bin_ = llama.bin
    env = {"GDN_GGUF_PRE": pre}
    f32 = work / "model-f32.gguf"
    ggufs = {}
    log("llama.cpp: convert_hf_to_gguf F32, F16")
    call([sys.executable, llama.wrapper, llama.tree, checkpoint, "--outtype", "f32", "--no-mtp", "--outfile", f32],
         env)
    ggufs["F32"] = f32
    ggufs["F16"] = work / "model-f16.gguf"
    call([sys.executable, llama.wrapper, llama.tree, checkpoint, "--outtype", "f16", "--no-mtp", "--outfile",
          ggufs["F16"]], env)
    imatrix = work / "imatrix.gguf"
    log(f"llama.cpp: llama-imatrix on the calibration text ({tokens} tokens in windows of 512)")
    call([bin_ / "llama-imatrix", "-m", f32, "-f", calibration, "-c", "512", "--chunks", max(1, tokens // 512),
          "-o", imatrix, "-t", "2"])
    for label, extra in [("Q8_0", ["Q8_0"]), ("Q4_0", ["Q4_0"]), ("Q4_0 + imatrix", ["--imatrix", imatrix, "Q4_0"]),
                         ("Q4_0 --pure", ["--pure", "Q4_0"]),
                         ("Q4_0 --pure + imatrix", ["--pure", "--imatrix", imatrix, "Q4_0"])]:
        out = work / f"model-{label.replace(' ', '').replace('+', '-')}.gguf"
        *options, kind = extra
        call([bin_ / "llama-quantize", *options, f32, out, kind, "2"])
        ggufs[label] = out
    base = work / "f32.kld"
    rows = []
    for label, gguf in ggufs.items():
        log(f"llama.cpp {label}: llama-perplexity -c {ctx}")
        command = [bin_ / "llama-perplexity", "-m", gguf, "-f", text, "-c", ctx, "-t", "2", "--kl-divergence-base",
                   base, *(["--chunks", windows] if windows else [])]
        figures = parse_llama_perplexity(call(command if label == "F32" else command + ["--kl-divergence"]),
                                         base=label == "F32")
        types = llama.tensor_types(gguf)
        head = types.get("output.weight", types.get("token_embd.weight", "?"))
        generated = llama_greedy(llama, gguf, checkpoint, prompt, greedy, work) if wanted(label) else ""
        rows.append({"engine": "llama.cpp", "format": f"{label} (head {head})", "bytes": gguf.stat().st_size,
                     **figures, "text": generated})
    return rows


def llama_greedy(llama, gguf: Path, checkpoint: Path, prompt: str, count: int, work: Path) -> str:
    """Greedy continuation by llama.cpp: the prompt's token ids (the checkpoint's tokenizer, as gdn_export reads it)
    through bench_vs_llamacpp.py's logits program (llama.cpp's public C API), the argmax appended, ``count`` times
    (this build has no raw-completion tool: its llama-cli is chat only)."""
    import numpy as np
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    ids = tokenizer.encode(prompt, add_special_tokens=False).ids
    start = len(ids)
    tokens_path, out = work / "greedy.i32", work / "greedy.f32"
    for _ in range(count):
        np.asarray(ids, np.int32).tofile(tokens_path)
        ids.append(int(llama.logits(gguf, tokens_path, out, 0)[-1].argmax()))
    return prompt + tokenizer.decode(ids[start:])


def print_table(rows: list[dict], prompt: str, markdown: bool) -> None:
    header = ["engine", "format", "file MB", "perplexity", "mean KL vs f32 (nats)", "top-1 vs f32"]
    lines = [[r["engine"], r["format"], f"{r['bytes'] / 1e6:.2f}", f"{r['ppl']:.4f}", f"{r['kl']:.5f}",
              f"{100 * r['top1']:.2f}%"] for r in rows]
    if markdown:
        print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
        for line in lines:
            print("| " + " | ".join(line) + " |")
    else:
        widths = [max(len(x) for x in column) for column in zip(header, *lines)]
        for line in [header, *lines]:
            print("  ".join(c.ljust(w) for c, w in zip(line, widths)))
    kl = {r["format"]: r["kl"] for r in rows if r["engine"].startswith("gdn")}
    nearest = kl.get("q4_0 nearest")
    if nearest:
        for name, target in (("q4_0 search (the default)", 0.9), ("q4_0 --calibration (GPTQ)", 0.75),
                             ("q4_0 --calibration --q4-rule search", 0.75)):
            if name in kl:
                print(f"{name} / nearest: {kl[name] / nearest:.3f} (target <= {target})")
                for r in rows:
                    if r["engine"] == "llama.cpp" and "imatrix" in r["format"]:
                        print(f"{name} / llama.cpp {r['format']}: {kl[name] / r['kl']:.3f} (target <= 1)")
    print(f"\nGreedy continuations of a held-out prompt:\n```\n{prompt}```")
    for r in rows:
        if r.get("text"):
            print(f"\n{r['engine']} {r['format']}:\n```\n{r['text'].strip()[:600]}\n```")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, default=ROOT / "fixtures" / "qwen3_5_trained")
    parser.add_argument("--text", type=Path, default=None, help="default: the checkpoint's heldout.txt")
    parser.add_argument("--ctx", type=int, default=256)
    parser.add_argument("--windows", type=int, default=None,
                        help="score the first N windows only (both engines; llama-perplexity --chunks N)")
    from bench_vs_llamacpp import add_llama_cpp_options

    add_llama_cpp_options(parser)
    parser.add_argument("--gguf-pre", default="qwen2", help="llama.cpp pre-tokenizer for the unknown hash")
    parser.add_argument("--calibration-tokens", type=int, default=8192)
    parser.add_argument("--calibration-bytes", type=int, default=40_000)
    parser.add_argument("--greedy-tokens", type=int, default=48)
    parser.add_argument("--formats", default=None, help="comma-separated gdn_export formats (default: all)")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--no-check", dest="check", action="store_false",
                        help="convert with --no-check (the f32 row's perplexity against transformers' still shows "
                             "the export exact; tests/test_quantized.py checks the quantized graphs)")
    parser.add_argument("--greedy-formats", default="f32,q4_0 nearest,q4_0 --calibration (GPTQ),F32,Q4_0,"
                        "Q4_0 + imatrix",
                        help="the formats whose greedy text is printed (comma-separated; 'all')")
    args = parser.parse_args(argv)
    text = args.text or args.checkpoint / "heldout.txt"
    work = Path(tempfile.mkdtemp(prefix="bench_quality_", dir=args.workdir))
    try:
        calibration = work / "calibration.txt"
        print(f"calibration text: {calibration_text(calibration, args.calibration_bytes)}")
        prompt = held_out_prompt(text.read_text(encoding="utf-8"))
        formats = dict(GDN_FORMATS)
        if "int8" in gdn_quantize_choices():
            formats["int8"] = ["--quantize", "int8"]
            formats["int8 --int8-passes 2"] = ["--quantize", "int8", "--int8-passes", "2"]
        if args.formats:
            formats = {k: v for k, v in formats.items() if k in args.formats.split(",")}
        rows, archives = [], {}
        wanted = lambda name: args.greedy_formats == "all" or name in args.greedy_formats.split(",")  # noqa: E731
        for name, options in formats.items():
            archive = archives[name] = work / f"{re.sub(r'[^a-z0-9]+', '_', name)}.nnef.tgz"
            options = [o.format(calibration=calibration, tokens=args.calibration_tokens) for o in options]
            log(f"gdn_export {name}: convert {' '.join(options)}")
            start = time.perf_counter()
            call([sys.executable, "-m", "gdn_export.cli", "convert", args.checkpoint, "-o", archive, *options,
                  *([] if args.check else ["--no-check"])])
            log(f"gdn_export {name}: converted and checked in {time.perf_counter() - start:.0f} s")
        figures = None if has_perplexity_command() else \
            in_process_figures(archives, args.checkpoint, text, args.ctx, args.windows)
        for name, archive in archives.items():
            log(f"gdn_export {name}: perplexity, greedy text")
            rows.append(gdn_row(name, archive, text, args.ctx, args.checkpoint, prompt,
                                args.greedy_tokens if wanted(name) else 0, None if figures is None else figures[name],
                                args.windows))
        if args.llama_cpp is not None:
            rows += llama_rows(args.llama_cpp.resolve(), args.checkpoint.resolve(), work, text, calibration, args.ctx,
                               args.calibration_tokens, prompt, args.greedy_tokens, args.gguf_pre, args.windows,
                               build=args.llama_cpp_build)
        scope = f"the first {args.windows} windows" if args.windows else "every window"
        print(f"\n{args.checkpoint.name} on {text.name}, {scope} of {args.ctx} tokens (second half scored); "
              f"{machine_line()}")
        print_table(rows, prompt, args.markdown)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def machine_line() -> str:
    try:
        model = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("model name"))
    except (OSError, StopIteration):
        model = "?"
    return f"{model}, {os.cpu_count()} cores"


if __name__ == "__main__":
    sys.exit(main())
