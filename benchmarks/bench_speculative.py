"""Speculative decoding (issue 37): what a verify call costs, what drafts are kept, what it gives, in one run.

    python benchmarks/bench_speculative.py [--curve ARCHIVE]... [--trained ARCHIVE] [--prose ARCHIVE --prose-text
                                           TEXT] [--methods all|defaults] [--prompts 8]
                                           [--new-tokens 128] [--reps 5] [--markdown]

1. The verify cost curve (``--curve``, repeatable: e.g. the 0.8B Qwen3.5 shape in int8, f16, f32, or one archive
   before and after a change): after a context of 128 tokens, one ``Session.verify`` call of k = 1..16 tokens, then
   ``commit(0)`` (the states go back: every call starts from the same context), median of ``--reps``, the archives'
   calls interleaved; each k's time over k = 1's (what k tokens in one call cost against one token). A call of k
   tokens is what a step with k - 1 drafts runs.
2. On the trained fixture (``--trained``: its archive, every position's logits), held-out continuations: ``--prompts``
   prompts of 256 tokens cut from ``heldout.txt`` (the code the model never saw in training) at evenly spaced line
   starts, ``--new-tokens`` new tokens each, per method (plain decoding; prompt lookup with K = 2, 4, 8 drafts of
   n-grams of 1-3 tokens, and K = 2, 3, 4 of n-grams of 2-3 tokens, K = 4 the default): greedy, sampled (temperature
   0.7, the fixture's top-k 20 and top-p 0.8, seeded), and the first 32 greedy tokens
   (before the repetition loops the small model falls into). Per method: tokens per model call after the first
   token (the mean accepted length: 1 for plain decoding), the drafts kept over the drafts made, tokens/s after the
   first token and its ratio to plain decoding measured in the same run, and whether the greedy tokens equal plain
   decoding's (they must). The fixture's calls cost little next to Python's per-step work, so its tokens/s say
   little about a large model: the last column projects the 0.8B shape from the curve of step 1 (the first
   ``--curve`` archive): every call the method made on the fixture (its token count: kept tokens recomputed, the
   sampled one, the drafts) priced at that curve's time for as many tokens, against one one-token call per token;
   and priced as if the kept tokens of a step whose drafts were not all kept ran at once in a call of their own
   (the simplest rollback) instead of with the next call (what ``Session.commit`` does), and as if they never ran
   again (every call returning the states after each of its positions: what such states could save at most).
   "recomputed per token": the kept tokens run a second time, per token generated; "steps partly kept per token":
   the calls that ran such tokens (each one a step whose drafts were not all kept), per token generated.
   ``--prose ARCHIVE --prose-text TEXT``: the same table for a model of the trained fixture's shape and recipe
   trained on English prose (``fixtures/train_qwen3_5.py prepare --corpus prose``), on prompts cut by the same rule
   from its held-out documents: whether a method that gains on code also never loses on prose (what a default needs).
   ``--methods defaults``: plain decoding and each drafter at its default settings (and MTP with K = 1, 2) only.
3. The MTP step (``--mtp-shape CHECKPOINT``: a Qwen3.5-shape checkpoint folder, e.g. the 0.8B one of
   ``large_checkpoint.py``): an MTP head of that config (its embedding table and head from the folder, seeded random
   ``mtp.*``: its cost does not depend on the values) exported as ``convert`` exports it, in float32 and in the
   weight formats ``--quantize`` writes it in (f16, int8, q4_0), then one call of its graph after 128 positions of
   its cache, of 1 position (a chained draft) and of 2 (the catch-up after a step that kept one draft), median of
   ``--reps``, and the peak RSS of a process that loads and calls it (over one that loads nothing), each in a
   process of its own; and its ratio to the first ``--curve`` archive's one-token call. Acceptance needs a trained
   head: where the ``--trained`` archive carries an MTP head (the trained fixture's, issue 37), the table of step 2
   gains ``mtp K=1, 2, 4`` rows, their projection adding one MTP call per draft at the price of the head in
   ``--mtp-price``'s format (default int8: the head an int8 archive carries).
4. llama.cpp beside it (``--llama-cpp DIR``, ``--llama-cpp-build DIR`` or $LLAMA_CPP_DIR / $LLAMA_CPP_BUILD; docs/
   PERFORMANCE.md says how to build one): ``--gguf-curve GGUF`` (repeatable: the same 0.8B shape's GGUF, e.g. Q8_0
   beside int8) gives llama.cpp's verify cost curve, ``llama-bench -p 1,...,16 -n 0 -d 128 -t 1`` (a batch of k
   tokens after 128 of context, median of ``--reps``; its seconds are k over its tokens/s); and the trained fixture,
   converted to an F32 GGUF with its MTP head (``convert_hf_to_gguf.py`` through bench_vs_llamacpp.py's wrapper,
   pre-tokenizer ``qwen2``, without ``--no-mtp``: ``mtp.*`` becomes ``blk.8.nextn.*``), runs
   ``llama-speculative-simple`` (one thread, a context of 1024) on the same held-out prompts' text (the prompt's
   token ids decoded; llama.cpp tokenizes it again) in each of llama.cpp's speculative modes that need no draft
   model (plain decoding as ``ngram-simple`` with an n-gram of 1024 that never matches: ``--spec-type none`` does
   not start; ``ngram-simple`` with n-grams of 3 and drafts of 4 (ours' nearest) and its defaults (12 and 48),
   ``ngram-map-k``, ``ngram-mod``, ``ngram-cache``) and ``draft-mtp`` with K = 1, 2, 4 drafts a step (the
   fixture's own head, ours' ``mtp K`` rows), greedy, sampled and over the first 32 tokens: per mode, tokens per
   target call (where llama.cpp keeps a recurrent state per draft position, as draft-mtp does: its ngram modes
   verify with checkpoints and count only the last pass, so "-"), drafts kept over drafts made, tokens per second
   of its decode loop (its own "decoded N tokens in T seconds" line), its ratio to plain in the same run; then the
   MTP rows of both engines side by side.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

sys.path.insert(0, str(ROOT / "benchmarks"))

from gdn_export.run.generation import SpeculativeConfig, generate  # noqa: E402
from gdn_export.run.session import Session  # noqa: E402

METHODS = {"plain": None,
           "ngram K=2, n 1-3": SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_min=1),
           "ngram K=4, n 1-3": SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1),
           "ngram K=8, n 1-3": SpeculativeConfig(num_speculative_tokens=8, prompt_lookup_min=1),
           "ngram K=2, n 2-3": SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_min=2),
           "ngram K=3, n 2-3": SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=2),
           "ngram K=4, n 2-3 (default)": SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=2)}
# --methods defaults: plain decoding and each drafter at SpeculativeConfig's defaults (K = 3, n-grams of 2-3), MTP
# with fewer drafts too (a chained draft is kept less often than the first)
DEFAULT_METHODS = {"plain": None, "ngram (defaults: K=3, n 2-3)": SpeculativeConfig("ngram"),
                   "mtp K=1": SpeculativeConfig("mtp", 1), "mtp K=2": SpeculativeConfig("mtp", 2),
                   "mtp (default K=3)": SpeculativeConfig("mtp")}


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def verify_curves(paths: list[Path], reps: int, context: int = 128, longest: int = 16) -> dict[str, dict[int, float]]:
    """Per archive, seconds of one verify call of k tokens after ``context`` tokens, median of ``reps`` (k =
    1..``longest``); the archives' calls interleaved (every k of every archive in each round), so that a slow spell
    of a shared machine hits them alike."""
    sessions = [Session(path) for path in paths]
    rng = np.random.default_rng(0)
    vocab = sessions[0].metadata["vocab_size"]
    context_ids = rng.integers(0, vocab, (1, context))
    for session in sessions:
        session.prefill(context_ids)
    times = [{k: [] for k in range(1, longest + 1)} for _ in sessions]
    for k in range(1, longest + 1):  # one warm-up call per size (tract's first call of a shape allocates)
        for session in sessions:
            session.verify(rng.integers(0, vocab, (1, k)))
            session.commit(0)
    for _ in range(reps):
        for k in range(1, longest + 1):
            ids = rng.integers(0, vocab, (1, k))
            for session, found in zip(sessions, times):
                start = time.perf_counter()
                session.verify(ids)
                found[k].append(time.perf_counter() - start)
                session.commit(0)
    return {path.name: {k: statistics.median(v) for k, v in found.items()} for path, found in zip(paths, times)}


class CountingSession(Session):
    """A Session that records every call it runs: (tokens, of which pending: kept tokens run again)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[tuple[int, int]] = []

    def prefill(self, input_ids):
        self.calls.append((np.asarray(input_ids).shape[1] + self.pending, self.pending))
        return super().prefill(input_ids)


def held_out_prompts(session: Session, text: str, count: int, length: int = 256) -> list[list[int]]:
    lines = np.cumsum([0] + [len(line) for line in text.splitlines(keepends=True)])
    prompts = []
    for i in range(count):
        start = int(lines[np.searchsorted(lines, len(text) * i // count)])
        ids = session.tokenizer.encode(text[start:start + length * 8]).ids
        prompts.append(ids[:length])
    return prompts


def run_method(session: CountingSession, prompts, spec, new_tokens: int, **sampling) -> dict:
    """Every prompt continued with ``spec``: tokens, calls after the first token, drafted/kept, decode seconds."""
    out = {"tokens": [], "calls": [], "drafted": 0, "accepted": 0, "seconds": 0.0, "count": 0}
    for i, prompt in enumerate(prompts):
        session.calls = []
        tokens = generate(session, prompt, new_tokens, stop_token_ids=[], speculative=spec,
                          **{k: (v + i if k == "seed" else v) for k, v in sampling.items()})
        ids, first = [], None
        for token in tokens:
            if first is None:
                first, session.calls = time.perf_counter(), []
            ids.append(token.token_id)
        out["seconds"] += time.perf_counter() - first
        out["count"] += len(ids) - 1
        out["tokens"].append(ids)
        out["calls"].extend(session.calls)
        out["drafted"] += tokens.generation.drafted
        out["accepted"] += tokens.generation.accepted
    return out


def projected_cost(calls: list[tuple[int, int]], curve: dict[int, float], rerun: str = "next") -> float:
    """Seconds the calls take at the curve's prices (beyond its longest k: its last step's slope). ``rerun``: how
    the kept tokens of a step that went back run again: with the next call (``"next"``, what ``Session.commit``
    does), at once in a call of their own (``"eager"``, ``commit(j, recompute=True)``), or never (``"never"``: as
    if every call returned the states after each of its positions, issue 37 item 2; the bound of what those
    states could save)."""
    longest = max(curve)
    slope = curve[longest] - curve[longest - 1]

    def price(k: int) -> float:
        return curve[k] if k in curve else curve[longest] + (k - longest) * slope

    if rerun == "next":
        return sum(price(k) for k, _ in calls)
    if rerun == "never":
        return sum(price(k - pending) for k, pending in calls)
    return sum(price(k - pending) + (price(pending) if pending else 0.0) for k, pending in calls)


# the MTP heads measured: (name, export dtype, --quantize), each exported as convert exports it
MTP_FORMATS = (("float32", "float32", None), ("f16 weights", "float32", "f16"), ("int8", "float32", "int8"),
               ("q4_0", "float32", "q4_0"))


def mtp_step_cost(folder: Path, reps: int, context: int = 128, keep: Path | None = None) -> dict[str, dict]:
    """Per weight format (``MTP_FORMATS``): seconds of one MTP graph call of S = 1 and 2 positions after ``context``
    cached ones, and the peak RSS of a process that loads the head and makes those calls (``mtp_child``, one child
    per format, after a child that loads nothing: ``rss_base``), for an MTP head of ``folder``'s config (random
    seeded ``mtp.*``, the folder's embedding table and head) exported by ``pipeline.mtp.export_head`` with that
    weight format (unchecked: its cost does not depend on the values). ``keep``: a folder where the exported heads
    are kept and, when already there, reused (export once, time under a lock later)."""
    import json
    import subprocess
    import tempfile

    import torch

    from gdn_export.hf.checkpoint import read_config
    from gdn_export.hf.layout import resolve_layout
    from gdn_export.hf.tensors import TensorIndex
    from gdn_export.models.mtp import MTPConfig, MTPHead, init_random
    from gdn_export.pipeline.mtp import MEMBER, export_head

    layout = resolve_layout(read_config(folder))
    config = MTPConfig.from_config({**layout.config, "mtp_num_hidden_layers": 1})
    index = TensorIndex(folder)
    names = {layout.model_name(n): e for n, e in index.entries.items()}
    costs = {}

    def child(*options) -> dict:
        out = subprocess.run([sys.executable, __file__, "--mtp-child", *map(str, options)], capture_output=True,
                             text=True, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])

    base = child("-", config.hidden_size, config.vocab_size, context, reps)["rss"]
    for name, dtype, quantize in MTP_FORMATS:
        with tempfile.TemporaryDirectory() as tmp:  # TMPDIR: where the exported heads go (without keep)
            path = (keep or Path(tmp)) / f"{name.replace(' ', '_')}.{MEMBER}"
            if not path.is_file():
                head = MTPHead(config, names["model.embed_tokens.weight"].read(),
                               None if config.tie_word_embeddings else names["lm_head.weight"].read())
                init_random(head, torch.Generator().manual_seed(0))
                log(f"MTP head ({name}) exported to {path}")
                export_head(head.to(getattr(torch, dtype)), path, tract_version=None, runtime="cpu", check=False,
                            quantize=quantize)
                del head
            measured = child(path, config.hidden_size, config.vocab_size, context, reps)
            costs[name] = {1: measured["times"]["1"], 2: measured["times"]["2"], "rss": measured["rss"] - base,
                           "bytes": path.stat().st_size}
    return costs


def mtp_child(path: str, hidden_size: int, vocab: int, context: int, reps: int) -> dict:
    """``--mtp-child``: the exported head at ``path`` loaded and called as ``mtp_step_cost`` says (``-``: nothing
    loaded, the baseline RSS); its median seconds of 1 and 2 positions and the process's peak RSS in bytes."""
    from gdn_export.run.mtp import OUTPUTS, MTPRunner
    from gdn_export.run.reading import read_metadata
    from gdn_export.run.runtime import load_tract_model

    import tract

    tract.nnef().with_tract_transformers()  # the library loaded in the baseline too
    times = {1: [], 2: []}
    if path != "-":
        recorded = read_metadata(Path(path))
        metadata = {"outputs": ["hidden"], "mtp": {"member": "mtp.nnef.tgz", "dtype": recorded["dtype"],
                                                   "num_key_value_heads": recorded["states"][0]["shape"][1],
                                                   "head_dim": recorded["states"][0]["shape"][3]}}
        runner = MTPRunner(Path(path), metadata, plan=load_tract_model(path, {"B": 1}, expect_outputs=OUTPUTS))
        rng = np.random.default_rng(0)
        hidden = rng.standard_normal((context + 64, hidden_size)).astype(np.float32)
        ids = rng.integers(0, vocab, context + 64)
        for rep in range(reps + 1):  # the first round warms up
            for k in times:
                runner.reset()
                runner.run(hidden[:context], ids[:context])
                start = time.perf_counter()
                runner.run(hidden[context:context + k], ids[context:context + k])
                if rep:
                    times[k].append(time.perf_counter() - start)
    # VmHWM, not getrusage's ru_maxrss: Linux carries ru_maxrss over an exec (the parent's peak at the fork)
    peak = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("VmHWM:"))
    return {"times": {str(k): statistics.median(v) if v else None for k, v in times.items()},
            "rss": int(peak.split()[1]) * 1024}


# llama.cpp's modes that run without a draft model: (name, --spec-type and its options)
# plain decoding in the same program: ``--spec-type none`` stops it ("failed to initialize speculative decoding"), so
# ngram-simple looking for a 1024-token n-gram, which never matches (no draft is ever made)
LLAMA_MODES = {"plain (ngram-simple, n 1024: no drafts)": ["--spec-type", "ngram-simple",
                                                           "--spec-ngram-simple-size-n", "1024"],
               "ngram-simple n 3, m 4": ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3",
                                         "--spec-ngram-simple-size-m", "4"],
               "ngram-simple (defaults: n 12, m 48)": ["--spec-type", "ngram-simple"],
               "ngram-map-k (defaults)": ["--spec-type", "ngram-map-k"],
               "ngram-mod (defaults)": ["--spec-type", "ngram-mod"],
               "ngram-cache (defaults)": ["--spec-type", "ngram-cache"]}
# llama.cpp's own MTP drafting on the same GGUF (the fixture's mtp.* as its blk.<n_layer>.nextn.* layer): K drafts a
# step as ours' mtp K rows (--spec-draft-n-max; its --spec-draft-p-min stays 0, every step drafts K)
LLAMA_MTP_KS = (1, 2, 4)
LLAMA_MTP_MODES = {f"draft-mtp K={k}": ["--spec-type", "draft-mtp", "--spec-draft-n-max", str(k)]
                   for k in LLAMA_MTP_KS}


def llama_verify_curve(llama, gguf: Path, reps: int, context: int = 128, longest: int = 16) -> dict[int, float]:
    """llama.cpp's seconds for one batch of k tokens after ``context`` (llama-bench -p k -d context, one thread)."""
    import json
    import subprocess

    command = [str(llama.bin / "llama-bench"), "-m", str(gguf), "-t", "1", "-r", str(reps), "-o", "json", "-n", "0",
               "-d", str(context), "-p", ",".join(str(k) for k in range(1, longest + 1))]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    return {test["n_prompt"]: test["n_prompt"] / statistics.median(test["samples_ts"])
            for test in json.loads(done.stdout)}


def llama_speculative(llama, gguf: Path, prompts: list[str], work: Path, count: int, options: list[str],
                      sampling: list[str]) -> dict:
    """``llama-speculative-simple`` over every prompt: decoded tokens, seconds, drafts made and kept (its own
    counters), or the error of the first prompt that failed."""
    import re
    import subprocess

    out = {"tokens": 0, "seconds": 0.0, "drafted": 0, "accepted": 0, "error": None, "checkpoints": False}
    for i, prompt in enumerate(prompts):
        path = work / f"prompt{i}.txt"
        path.write_text(prompt, encoding="utf-8")
        command = [str(llama.bin / "llama-speculative-simple"), "-m", str(gguf), "-f", str(path), "-n", str(count),
                   "-t", "1", "-tb", "1", "-c", "1024", "--ignore-eos", *sampling, *options]
        for attempt in range(3):  # its last log lines are now and then missing (its logger thread at exit): again
            with open(work / "speculative.log", "w+b") as output:  # a file: through pipes they went missing more
                done = subprocess.run(command, stdout=output, stderr=subprocess.STDOUT)
                output.seek(0)
                text = output.read().decode("utf-8", "replace")
            decoded = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", text)
            drafted, accepted = (re.search(rf"{key}\s*=\s*(\d+)", text) for key in ("n_drafted", "n_accept"))
            if done.returncode != 0 or None not in (decoded, drafted, accepted):
                break
        if done.returncode != 0 or None in (decoded, drafted, accepted):
            lines = [line.split(" ", 2)[-1] for line in text.splitlines()  # its warnings and errors (not the text)
                     if re.match(r"\d+\.\d+\.\d+\.\d+ [WE] ", line)]
            out["error"] = f"exit {done.returncode}: " + " / ".join((lines or text.splitlines()[-3:])[-3:])
            log(f"llama-speculative-simple failed on prompt {i} ({' '.join(command[5:])}):\n{text[-2000:]}")
            return out
        out["checkpoints"] |= "will use checkpoints" in text
        out["tokens"] += int(decoded.group(1))
        out["seconds"] += float(decoded.group(2))
        out["drafted"] += int(drafted.group(1))
        out["accepted"] += int(accepted.group(1))
    return out


def llama_section(args, prompts: list[str], curve_rows: dict[str, dict[int, float]], ours: dict | None = None) -> None:
    """Step 4: llama.cpp's verify curve and speculative modes, printed as tables (its files in a temporary folder,
    removed after); ``ours``: this run's rows of step 2 (``(mode, method) -> row``) for the side-by-side table."""
    import shutil
    import tempfile

    from bench_vs_llamacpp import LlamaCpp

    work = Path(tempfile.mkdtemp(prefix="bench_speculative_llama_"))
    try:
        llama_tables(args, prompts, curve_rows, LlamaCpp(args.llama_cpp, work, args.llama_cpp_build), work, ours or {})
    finally:
        shutil.rmtree(work, ignore_errors=True)


def llama_gguf(llama, checkpoint: Path, out: Path) -> None:
    """The trained checkpoint as an F32 GGUF with its MTP head (``convert_hf_to_gguf.py`` without ``--no-mtp``:
    ``mtp.*`` becomes the layer after the last, ``blk.<n_layer>.nextn.*`` and its attention and MLP, with
    ``qwen35.nextn_predict_layers`` 1, what ``--spec-type draft-mtp`` loads); pre-tokenizer ``qwen2`` (the fixture's
    tokenizer splits as Qwen2's)."""
    import os
    import subprocess

    subprocess.run([sys.executable, str(llama.wrapper), str(llama.tree), str(checkpoint), "--outtype", "f32",
                    "--outfile", str(out)], check=True, capture_output=True, env={**os.environ, "GDN_GGUF_PRE": "qwen2"})


def llama_per_call(result: dict) -> float | None:
    """Tokens per target call of a llama-speculative-simple run: each step is one call yielding its kept drafts and
    one token (``decoded`` = steps + kept), unless it verified with checkpoints (a step whose drafts were not all
    kept restores its state and runs the kept tokens again, and its counters count that last pass only): None."""
    if result["checkpoints"] or result["tokens"] <= result["accepted"]:
        return None
    return result["tokens"] / (result["tokens"] - result["accepted"])


def llama_tables(args, prompts: list[str], curve_rows: dict[str, dict[int, float]], llama, work: Path,
                 ours: dict) -> None:
    for gguf in args.gguf_curve:
        log(f"llama.cpp verify cost curve of {gguf}")
        curve_rows[f"{gguf.name} (llama.cpp)"] = llama_verify_curve(llama, gguf, args.reps)
    if curve_rows:
        print("\n## llama.cpp's batch of k tokens after 128 of context (llama-bench -p k -d 128 -t 1; ms, ratio to "
              "k = 1)\n")
        names = list(curve_rows)
        print("| k | " + " | ".join(f"{n} ms | x k=1" for n in names) + " |")
        print("|---|" + "---|---|" * len(names))
        for k in range(1, 17):
            print(f"| {k} | " + " | ".join(f"{curve_rows[n][k] * 1e3:.1f} | {curve_rows[n][k] / curve_rows[n][1]:.2f}x"
                                            for n in names) + " |")
    if not prompts:
        return
    gguf = work / "trained-mtp-f32.gguf"
    log("llama.cpp: the trained fixture (with its MTP head) to an F32 GGUF")
    llama_gguf(llama, args.trained_checkpoint, gguf)
    modes = {"greedy": (args.new_tokens, ["--temp", "0", "--top-k", "1"]),
             "sampled T=0.7": (args.new_tokens, ["--temp", "0.7", "--top-k", "20", "--top-p", "0.8", "--seed", "0"]),
             "greedy, first 32": (32, ["--temp", "0", "--top-k", "1"])}
    print(f"\n## llama.cpp's speculative modes on the trained fixture's F32 GGUF with its MTP head ({len(prompts)} "
          "prompts, llama-speculative-simple, one thread)\n")
    print("| mode | llama.cpp method | tokens per call | drafts kept | tokens/s | x plain |")
    print("|---|---|---|---|---|---|")
    theirs = {}
    for mode, (count, sampling) in modes.items():
        plain = None
        for name, options in {**LLAMA_MODES, **LLAMA_MTP_MODES}.items():
            log(f"llama.cpp {mode}: {name}")
            result = llama_speculative(llama, gguf, prompts, work, count, options, sampling)
            if result["error"]:
                print(f"| {mode} | {name} | - | failed: {result['error']} | - | - |", flush=True)
                continue
            rate = result["tokens"] / result["seconds"]
            plain = plain or rate
            per_call = llama_per_call(result)
            theirs[(mode, name)] = dict(result, rate=rate, ratio=rate / plain, per_call=per_call)
            kept = f"{result['accepted']}/{result['drafted']}" if not name.startswith("plain") else "-"
            print(f"| {mode} | {name} | {'-' if per_call is None else f'{per_call:.2f}'} | {kept} | {rate:.1f} | "
                  f"{rate / plain:.2f}x |", flush=True)
    mtp_side_by_side(ours, theirs, list(modes))


def mtp_side_by_side(ours: dict, theirs: dict, modes: list[str]) -> None:
    """The same head drafting in both engines: per mode and K, ours' ``mtp K`` row beside llama.cpp's ``draft-mtp
    K`` row (tokens per target call, drafts kept, tokens/s over plain decoding of the same engine in the same run)."""
    if not any(name.startswith("mtp K=") for _, name in ours):
        return
    print("\n## MTP drafting, gdn_export against llama.cpp (the same trained head; x plain: over the same engine's "
          "plain decoding in this run)\n")
    print("| mode | K | gdn_export tokens per call | kept / made | x plain | llama.cpp tokens per call | kept / made "
          "| x plain |")
    print("|---|---|---|---|---|---|---|---|")
    for mode in modes:
        for k in LLAMA_MTP_KS:
            mine, other = ours.get((mode, f"mtp K={k}")), theirs.get((mode, f"draft-mtp K={k}"))
            cells = [f"{mine['per_call']:.2f} | {mine['accepted']}/{mine['drafted']} | {mine['ratio']:.2f}x"
                     if mine else "- | - | -",
                     f"{other['per_call']:.2f} | {other['accepted']}/{other['drafted']} | {other['ratio']:.2f}x"
                     if other and other["per_call"] is not None else "- | - | -"]
            print(f"| {mode} | {k} | {cells[0]} | {cells[1]} |")


def methods_for(session: Session, which: str) -> dict:
    """The methods a table runs: ``"all"`` (``METHODS``, and ``mtp K=1, 2, 4`` where the archive carries an MTP head)
    or ``"defaults"`` (``DEFAULT_METHODS``: plain decoding and each method at its default settings, and MTP with
    K = 1 and 2; the question a default answers)."""
    if which == "defaults":
        methods = dict(DEFAULT_METHODS)
        if session.mtp is None:
            methods = {name: spec for name, spec in methods.items() if spec is None or spec.method != "mtp"}
        return methods
    methods = dict(METHODS)
    if session.mtp is not None:  # a trained MTP head (issue 37's trained fixture): its acceptance and speed
        methods.update({f"mtp K={k}": SpeculativeConfig("mtp", k) for k in (1, 2, 4)})
    return methods


def continuation_table(session: CountingSession, prompts: list[list[int]], title: str, methods: dict,
                       new_tokens: int, curve: dict[int, float] | None, curve_name: str | None,
                       mtp_cost: float | None) -> dict:
    """Step 2's table for one archive and its held-out prompts: every method greedy, sampled at T = 0.7 and over the
    first 32 greedy tokens, each against plain decoding in the same run; returns ``(mode, method) -> result``."""
    list(generate(session, prompts[0], 4))  # plan before anything is timed
    modes = {"greedy": (new_tokens, dict(temperature=0.0)),
             "sampled T=0.7": (new_tokens, dict(temperature=0.7, top_k=20, top_p=0.8, seed=0)),
             "greedy, first 32": (32, dict(temperature=0.0))}
    print(f"\n## {title}\n")
    head = ("| mode | method | tokens per call | drafts kept | recomputed per token | steps partly kept per token | "
            "tokens/s | x plain | same tokens |")
    if curve:
        head += (f" 0.8B projection ({curve_name}) | the same, kept tokens rerun at once |"
                 " the same, kept tokens never rerun (per-position states) |")
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    results = {}
    for mode, (count, sampling) in modes.items():
        plain = None
        for name, spec in methods.items():
            log(f"{mode}: {name}")
            result = run_method(session, prompts, spec, count, **sampling)
            rate = result["count"] / result["seconds"]
            if plain is None:
                plain = dict(result, rate=rate)
            per_call = result["count"] / max(1, len(result["calls"]))
            kept = f"{result['accepted']}/{result['drafted']}" if spec else "-"
            same = ("yes" if result["tokens"] == plain["tokens"] else "NO") if sampling["temperature"] == 0 else "n/a"
            recomputed = sum(pending for _, pending in result["calls"]) / result["count"]
            partly = sum(1 for _, pending in result["calls"] if pending) / result["count"]
            row = (f"| {mode} | {name} | {per_call:.2f} | {kept} | {recomputed:.2f} | {partly:.3f} | {rate:.1f} | "
                   f"{rate / plain['rate']:.2f}x | {same} |")
            if curve:
                plain_cost = result["count"] * curve[1]
                # an MTP method also pays its head (--mtp-price's): one call per draft (the catch-up priced as one
                # position: the member projects the last position's logits only)
                drafting = result["drafted"] * mtp_cost if spec is not None and spec.method == "mtp" and mtp_cost else 0.0
                row += "".join(f" {plain_cost / (projected_cost(result['calls'], curve, rerun) + drafting):.2f}x |"
                               for rerun in ("next", "eager", "never"))
            print(row, flush=True)
            results[(mode, name)] = dict(result, per_call=per_call, ratio=rate / plain["rate"])
    return results


# ---------------------------------------------------------------- prose (issue 37: is there a default that never loses)

def prose_section(args, curve: dict[int, float] | None, curve_name: str | None, mtp_cost: float | None) -> dict:
    """Step 2 on prose (``--prose``): the same table for a model of the trained fixture's shape and recipe trained on
    English prose (``fixtures/train_qwen3_5.py --corpus prose``), prompts cut from its held-out documents
    (``--prose-text``) by the same rule; with the code table above, whether a method gains on both."""
    session = CountingSession(args.prose)
    prompts = held_out_prompts(session, args.prose_text.read_text(encoding="utf-8"), args.prompts)
    return continuation_table(session, prompts, f"Held-out continuations of the prose model ({args.prompts} prompts "
                              "of 256 tokens of held-out documentation)", methods_for(session, args.methods),
                              args.new_tokens, curve, curve_name, mtp_cost)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--curve", type=Path, action="append", default=[],
                        help="an archive whose verify cost curve is measured (repeatable)")
    parser.add_argument("--trained", type=Path, default=None,
                        help="the trained fixture's archive (gdn-export convert fixtures/qwen3_5_trained)")
    parser.add_argument("--text", type=Path, default=ROOT / "fixtures" / "qwen3_5_trained" / "heldout.txt")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--mtp-shape", type=Path, default=None,
                        help="a Qwen3.5-shape checkpoint folder: the cost of an MTP step of its config")
    parser.add_argument("--gguf-curve", type=Path, action="append", default=[],
                        help="with --llama-cpp: a GGUF whose batch cost curve llama-bench measures (repeatable)")
    parser.add_argument("--trained-checkpoint", type=Path, default=ROOT / "fixtures" / "qwen3_5_trained",
                        help="with --llama-cpp and --trained: the checkpoint the trained archive was converted from")
    from bench_vs_llamacpp import add_llama_cpp_options

    add_llama_cpp_options(parser)
    parser.add_argument("--mtp-price", default="int8", choices=[name for name, _, _ in MTP_FORMATS],
                        help="with --mtp-shape: the MTP head whose step prices the projection of the mtp rows")
    parser.add_argument("--mtp-dir", type=Path, default=None,
                        help="with --mtp-shape: keep the exported heads there, and reuse those already there")
    parser.add_argument("--prose", type=Path, default=None,
                        help="a prose model's archive (train_qwen3_5.py --corpus prose): step 2 on prose as well")
    parser.add_argument("--prose-text", type=Path, default=None, help="with --prose: its held-out text (heldout.txt)")
    parser.add_argument("--curve-ms", default=None, metavar="MS,...",
                        help="instead of --curve: a recorded verify cost curve, milliseconds of k = 1..16 (e.g. a "
                        "quiet machine's run in RESULTS.md), for the projections of a run where timing is not clean")
    parser.add_argument("--mtp-step-ms", type=float, default=None,
                        help="instead of --mtp-shape: a recorded MTP step's milliseconds, for the mtp rows' projection")
    parser.add_argument("--methods", choices=["all", "defaults"], default="all",
                        help="step 2's methods: all (the ngram settings and mtp K=1, 2, 4) or defaults (plain, each "
                        "method's default settings, mtp K=1 and 2)")
    parser.add_argument("--mtp-child", nargs=5, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mtp_child is not None:  # one measurement of mtp_step_cost, in a process of its own
        import json

        path, hidden, vocab, context, reps = args.mtp_child
        print(json.dumps(mtp_child(path, int(hidden), int(vocab), int(context), int(reps))))
        return 0

    curves = {}
    if args.curve:
        log(f"verify cost curves of {', '.join(str(path) for path in args.curve)} (interleaved)")
        curves = verify_curves(args.curve, args.reps)
    if curves:
        print("\n## Verify cost: one call of k tokens after 128 of context (median; ratio to k = 1)\n")
        names = list(curves)
        print("| k | " + " | ".join(f"{n} ms | x k=1" for n in names) + " |")
        print("|---|" + "---|---|" * len(names))
        for k in range(1, 17):
            cells = [f"{curves[n][k] * 1e3:.1f} | {curves[n][k] / curves[n][1]:.2f}x" for n in names]
            print(f"| {k} | " + " | ".join(cells) + " |")

    if args.curve_ms is not None:  # a recorded curve: priced, not measured (named "recorded" in the table)
        recorded = [float(v) / 1e3 for v in args.curve_ms.split(",")]
        if len(recorded) != 16:
            parser.error(f"--curve-ms takes 16 values (k = 1..16), got {len(recorded)}")
        curves = {"recorded": dict(enumerate(recorded, start=1)), **curves}
    mtp_cost = None if args.mtp_step_ms is None else args.mtp_step_ms / 1e3
    if args.mtp_shape is not None:
        costs = mtp_step_cost(args.mtp_shape, args.reps, keep=args.mtp_dir)
        mtp_cost = costs[args.mtp_price][1]
        base = curves[next(iter(curves))][1] if curves else None
        print(f"\n## The MTP step ({args.mtp_shape.name}'s config, after 128 cached positions; median; RSS: a "
              "process's peak over one that loads nothing)\n")
        print("| MTP weights | member MB | peak RSS MB | 1 position ms | 2 positions ms |"
              + (f" 1 position / {next(iter(curves))} k=1 |" if base else ""))
        print("|---|---|---|---|---|" + ("---|" if base else ""))
        for name, cost in costs.items():
            print(f"| {name} | {cost['bytes'] / 1e6:.0f} | {cost['rss'] / 1e6:.0f} | {cost[1] * 1e3:.1f} | "
                  f"{cost[2] * 1e3:.1f} |" + (f" {cost[1] / base:.2f}x |" if base else ""))

    if args.prose is not None and args.prose_text is None:
        parser.error("--prose needs --prose-text (the prose model's held-out text)")
    curve_name = next(iter(curves)) if curves else None
    curve, prompts, ours = curves.get(curve_name), [], {}
    if args.trained is not None:
        session = CountingSession(args.trained)
        prompts = held_out_prompts(session, args.text.read_text(encoding="utf-8"), args.prompts)
        ours = continuation_table(session, prompts, f"Held-out continuations of the trained fixture ({args.prompts} "
                                  "prompts of 256 tokens)", methods_for(session, args.methods), args.new_tokens,
                                  curve, curve_name, mtp_cost)
        prompts = [session.tokenizer.decode(ids) for ids in prompts]
    if args.prose is not None:
        prose_section(args, curve, curve_name, mtp_cost)
    if args.llama_cpp is not None:
        llama_section(args, prompts, {}, ours)
    return 0


if __name__ == "__main__":
    sys.exit(main())
