"""How long an archive takes to be ready: each stage of a start in a fresh process, medians of N (issue 36).

    python benchmarks/bench_load.py ARCHIVE [ARCHIVE ...] [--runs 5] [--cpu N] [--markdown]
    python benchmarks/bench_load.py --workdir DIR --layers 4,8,16,24,48 --formats int8[,f32,f16,q4_0]
                                    [--checkpoint 24=FOLDER] [--runs 3] [--cpu N] [--keep] [--markdown]

Per archive, ``--runs`` fresh processes (``python bench_load.py --worker ARCHIVE``; the archives' runs interleaved,
round by round, so a busy spell of a shared machine falls on all of them), each timing, in this order:

- ``read``: gunzip + untar of every member in Python, bytes dropped: what reading the file costs on its own (from
  the page cache after the first run), for scale; tract reads the archive again inside ``load``;
- ``load``: ``tract.nnef().with_tract_transformers().load(path)``: parsing, translating, decluttering;
- ``plan``: ``SetSymbols`` of the batch (as ``Session`` plans) and ``into_runnable``: optimizing, packing;
- ``first``: ``Session.prefill`` of one token on that plan (the first call: buffers, lazily packed constants; not
  run for a folder, which has no archive metadata for a ``Session``);
- ``ready``: load + plan + first, what a user waits before the first token; and the process's peak RSS.

The table gives the median of each stage over the runs (min-max of ``ready``), the archive's size and graph lines.

With ``--workdir`` it first makes the archives: per ``--layers`` count the 0.8B Qwen3.5 shape
(``large_checkpoint.py --layers L --hidden 1024 --intermediate 3584 --tied``; ``--checkpoint L=FOLDER`` reuses one
read-only), converted per ``--formats`` with ``gdn-export convert --no-check --logits last`` (f32 ``--dtype
float32``, f16 ``--quantize f16``, int8 ``--quantize int8``, q4_0 ``--quantize q4_0``: as bench_vs_llamacpp.py), each
conversion timed (wall seconds and the converter's own split, its ``time:`` line) in a process of its own: the
conversion time against the layer count. Archives are deleted afterwards unless ``--keep``.

With ``--llama-cpp DIR`` (and ``--llama-cpp-build DIR``, or $LLAMA_CPP_DIR / $LLAMA_CPP_BUILD; docs/PERFORMANCE.md
says how to build one), each checkpoint is also made into GGUFs as bench_vs_llamacpp.py makes them (its wrapper of
``convert_hf_to_gguf.py`` over a copy of the checkpoint folder with its synthetic tokenizer: F32 and F16 converted,
Q8_0 (beside int8) and Q4_0 by ``llama-quantize`` of the F32 one; a quantized GGUF's conversion time includes its F32
source's), and each GGUF timed in the same rounds as the archives, by a small C program against llama.cpp's public
API in a fresh process: ``load`` = ``llama_model_load_from_file`` (the library defaults: the file memory-mapped),
``plan`` = ``llama_init_from_model`` (a context of 512 tokens, one thread: buffers, the compute graph reserved),
``first`` = ``llama_decode`` of one token (the weights' pages read as they are first touched); ``read`` is the same
Python read of the file. ``--generate N`` adds the wall time of ``gdn-export generate --max-new-tokens 1`` on the int8
archive (fresh processes, a 4-token prompt of ids) and, with llama.cpp, of ``llama-simple -n 1`` on the Q8_0 GGUF.

``--segments 1,2`` times each archive once per segment count through the loader a Session uses
(``runtime.load_tract_model`` with ``GDN_EXPORT_SEGMENTS``; docs/PERFORMANCE.md "Planning in segments"): then ``load`` is
the whole of it (the integrity pass over the archive, which also writes the weights out for the segments, tract's
loads and plans side by side) and ``plan`` is 0; the first start of a graph records the facts of its cuts (under a
cache folder of the benchmark's own, made once before the rounds), so the rounds time what every later start does.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
GGUF_TYPES = {"f32": "F32", "f16": "F16", "int8": "Q8_0", "q4_0": "Q4_0"}  # the GGUF beside each format
LOAD_C = r'''/* One start of a GGUF by llama.cpp's public C API, each stage timed: written by gdn_export's bench_load.py.
   Usage: llama_load MODEL.gguf  -> prints {"load": s, "plan": s, "first": s, "peak_rss_gb": GB} */
#include "llama.h"
#include <stdio.h>
#include <string.h>
#include <time.h>

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
static void quiet(enum ggml_log_level level, const char * text, void * data) { (void) level; (void) text; (void) data; }

int main(int argc, char ** argv) {
    if (argc != 2) { fprintf(stderr, "usage: %s MODEL\n", argv[0]); return 2; }
    llama_log_set(quiet, NULL);
    double t0 = now();
    llama_backend_init();
    struct llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    struct llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) { fprintf(stderr, "cannot load %s\n", argv[1]); return 1; }
    double t1 = now();
    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = 512; cp.n_batch = 512; cp.n_ubatch = 512; cp.n_seq_max = 1; cp.n_threads = 1; cp.n_threads_batch = 1;
    struct llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) { fprintf(stderr, "cannot make a context\n"); return 1; }
    double t2 = now();
    llama_token token = 0;
    if (llama_decode(ctx, llama_batch_get_one(&token, 1)) != 0) { fprintf(stderr, "llama_decode failed\n"); return 1; }
    double t3 = now();
    long peak_kb = 0; char line[256];
    FILE * status = fopen("/proc/self/status", "r");
    while (status && fgets(line, sizeof line, status)) if (!strncmp(line, "VmHWM:", 6)) sscanf(line + 6, "%ld", &peak_kb);
    if (status) fclose(status);
    printf("{\"load\": %.6f, \"plan\": %.6f, \"first\": %.6f, \"peak_rss_gb\": %.6f}\n", t1 - t0, t2 - t1, t3 - t2,
           peak_kb * 1024 / 1e9);
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
'''
FORMATS = {"f32": ["--dtype", "float32"], "f16": ["--dtype", "float32", "--quantize", "f16"],
           "int8": ["--dtype", "float32", "--quantize", "int8"], "q4_0": ["--dtype", "float32", "--quantize", "q4_0"],
           # the same int8 archive with the per-token gated delta-rule lowering: what the chunked one costs to load
           "int8-recurrent": ["--dtype", "float32", "--quantize", "int8", "--lowering", "recurrent"]}
SHAPE = dict(hidden=1024, intermediate=3584, vocab=151936)  # Qwen3.5 0.8B's text model (tied)
STAGES = ("read", "load", "plan", "first")


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# --- the worker: one fresh process, one archive ------------------------------------------------------------------

def read_seconds(path: Path) -> float:
    """Seconds to gunzip and untar every member of ``path`` (a folder: read every file), bytes dropped."""
    start = time.perf_counter()
    if path.is_dir() or path.suffix == ".gguf":  # a folder's files, or a GGUF, read as they are
        for file in (path.rglob("*") if path.is_dir() else [path]):
            if file.is_file():
                with open(file, "rb") as f:
                    while f.read(1 << 24):
                        pass
    else:
        with tarfile.open(path, "r|*") as tar:
            for member in tar:
                data = tar.extractfile(member)
                if data is not None:
                    while data.read(1 << 24):
                        pass
    return time.perf_counter() - start


def worker(path: Path, segments: int | None = None) -> dict:
    """Each stage's seconds for one start of ``path`` in this (fresh) process, and the peak RSS; with ``segments``,
    through ``load_tract_model`` planning that many segments (``load`` its whole time, ``plan`` 0)."""
    import tract

    from gdn_export.run import session as session_module
    from gdn_export.run.session import Session

    times = {"read": read_seconds(path)}
    if segments is not None:
        if segments > 0:
            os.environ["GDN_EXPORT_SEGMENTS"] = str(segments)
        else:  # auto: the loader's own choice
            os.environ.pop("GDN_EXPORT_SEGMENTS", None)
        real_load = session_module.load_tract_model

        def timed_load(model_path, symbols=None, **options):
            start = time.perf_counter()
            runnable = real_load(model_path, symbols, **options)
            times["load"], times["plan"] = time.perf_counter() - start, 0.0
            return runnable

        session_module.load_tract_model = timed_load
        session = Session(path)
        start = time.perf_counter()
        session.prefill([[0]])
        times["first"] = time.perf_counter() - start - times["load"]
        times["ready"] = times["load"] + times["first"]
        times.update(speed(session))
        times["peak_rss_gb"] = peak_rss_bytes() / 1e9
        return times

    def staged_load(model_path, symbols=None, **_):  # Session's loader, split into tract's two stages
        start = time.perf_counter()
        model = tract.nnef().with_tract_transformers().load(str(model_path))
        times["load"] = time.perf_counter() - start
        start = time.perf_counter()
        if symbols:
            model.transform(tract.SetSymbols(symbols))
        runnable = model.into_runnable()
        times["plan"] = time.perf_counter() - start
        return runnable

    if path.is_dir():  # an unpacked archive (a hand-edited graph): no gdn_export.json for a Session to read
        staged_load(path, {"B": 1})
        times["first"] = 0.0
    else:
        session_module.load_tract_model = staged_load
        session = Session(path)
        start = time.perf_counter()
        session.prefill([[0]])
        times["first"] = time.perf_counter() - start - times["load"] - times["plan"]
        times.update(speed(session))
    times["ready"] = times["load"] + times["plan"] + times["first"]
    times["peak_rss_gb"] = peak_rss_bytes() / 1e9
    return times


SPEED_ENV = "BENCH_LOAD_SPEED"  # "P,D" (--speed): the worker also times a P-token prefill and D decode steps


def speed(session) -> dict:
    """With --speed P,D: tokens/s of a P-token prefill from an empty state and the median of D one-token decode
    steps after it, on the plan just made (the same runnable, whole or in segments)."""
    wanted = os.environ.get(SPEED_ENV)
    if not wanted:
        return {}
    prompt, steps = (int(n) for n in wanted.split(","))
    session.reset()
    start = time.perf_counter()
    session.prefill([[(7 * i) % 1000 for i in range(prompt)]])
    prefill = time.perf_counter() - start
    seconds = []
    for i in range(steps):
        start = time.perf_counter()
        session.prefill([[i % 1000]])
        seconds.append(time.perf_counter() - start)
    return {"prefill_tps": prompt / prefill, "decode_tps": 1 / statistics.median(seconds)}


def peak_rss_bytes() -> int:
    """This process's peak resident set (VmHWM: its own since exec; ``ru_maxrss`` keeps the parent's peak across
    fork + exec, which read the 2.4 GB of the parent that built checkpoints)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# --- the parent -------------------------------------------------------------------------------------------------

LLAMA_LOAD: Path | None = None  # the compiled LOAD_C program, once a llama.cpp build is given


SEGMENTS: dict[str, int] = {}  # an archive's label -> the segments it is planned in (--segments)


def one_start(path: Path, cpu: int | None, label: str | None = None) -> dict:
    """Each stage of one start of ``path`` in a fresh process: an archive by the worker above, a GGUF by LOAD_C."""
    if path.suffix == ".gguf":
        command = [str(LLAMA_LOAD), str(path)]
    else:
        command = [sys.executable, str(Path(__file__).resolve()), "--worker", str(path)]
        if label in SEGMENTS:
            command.append(str(SEGMENTS[label]))
    if cpu is not None:
        command = ["taskset", "-c", str(cpu), *command]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"the worker failed on {path}:\n{done.stderr[-3000:]}")
    times = json.loads(done.stdout.strip().splitlines()[-1])
    if path.suffix == ".gguf":
        times["read"] = read_seconds(path)
        times["ready"] = times["load"] + times["plan"] + times["first"]
    return times


def generate_seconds(command: list[str], cpu: int | None) -> float:
    """Wall seconds of ``command`` in a fresh process (pinned to ``cpu``)."""
    if cpu is not None:
        command = ["taskset", "-c", str(cpu), *command]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True)  # bytes: a synthetic tokenizer's text need not be UTF-8
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command[:6])} ... failed:\n{done.stderr[-3000:].decode(errors='replace')}")
    return seconds


def graph_lines(path: Path) -> int | None:
    try:
        if path.is_dir():
            return len((path / "graph.nnef").read_text().splitlines())
        with tarfile.open(path, "r|*") as tar:
            for member in tar:
                if member.name.lstrip("./") == "graph.nnef":
                    return len(tar.extractfile(member).read().splitlines())
    except (OSError, tarfile.TarError):
        return None
    return None


def measure(archives: list[tuple[str, Path]], runs: int, cpu: int | None) -> dict[str, list[dict]]:
    results: dict[str, list[dict]] = {label: [] for label, _ in archives}
    for round_ in range(runs):
        for label, path in archives:
            times = one_start(path, cpu, label)
            results[label].append(times)
            log(f"round {round_ + 1}/{runs} {label}: " + ", ".join(f"{k} {times[k]:.2f}" for k in (*STAGES, "ready"))
                + f" s, peak RSS {times['peak_rss_gb']:.2f} GB")
    return results


def convert(checkpoint: Path, fmt: str, out: Path, env: dict | None = None) -> dict:
    """Convert ``checkpoint`` to ``out`` in ``fmt`` in a process of its own (``env``: its environment, e.g. another
    tree's PYTHONPATH): wall seconds, CPU seconds and the report's split."""
    command = [sys.executable, "-m", "gdn_export.cli", "convert", str(checkpoint.resolve()), "-o", str(out.resolve()),
               "--force", "--no-check", "--logits", "last", *FORMATS[fmt]]
    start, cpu = time.perf_counter(), children_cpu()
    # run from the output's folder: ``python -m`` puts its working directory first on sys.path, before PYTHONPATH,
    # so run from a source tree it would convert with that tree whatever ``env`` names
    done = subprocess.run(["/usr/bin/time", "-f", "PEAK_RSS_KB %M", *command], capture_output=True, text=True,
                          env=env, cwd=out.resolve().parent)
    seconds, cpu = time.perf_counter() - start, children_cpu() - cpu
    if done.returncode != 0:
        raise SystemExit(f"converting {checkpoint} ({fmt}) failed:\n{done.stderr[-3000:]}")
    split = next((line.split("time:", 1)[1].strip() for line in done.stdout.splitlines() if "time:" in line), "")
    peak = next((int(line.split()[1]) * 1024 / 1e9 for line in done.stderr.splitlines()
                 if line.startswith("PEAK_RSS_KB")), float("nan"))
    return {"seconds": seconds, "split": split, "peak_rss_gb": peak, "cpu_seconds": cpu}


def children_cpu() -> float:
    """CPU seconds (user + system) of this process's ended children: a conversion's own work, which a busy shared
    machine stretches in wall time far less than its wall seconds."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def checkpoint_for(layers: int, workdir: Path, given: dict[int, Path]) -> Path:
    if layers in given:
        return given[layers]
    sys.path.insert(0, str(HERE))
    import large_checkpoint

    folder = workdir / f"qwen3_5_0p8b_shape_{layers}l"
    config = large_checkpoint.make_config(layers, SHAPE["hidden"], SHAPE["vocab"], SHAPE["intermediate"], tied=True)
    if large_checkpoint.matches(folder, config):
        return folder
    log(f"building the {layers}-layer checkpoint in {folder}")
    large_checkpoint.build(folder, config, shard_gb=2.0, seed=0, log=log)
    return folder


def machine() -> str:
    try:
        model = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        model = platform.processor()
    return f"{model}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}"


def print_table(archives: list[tuple[str, Path]], results: dict[str, list[dict]], conversions: dict[str, dict],
                markdown: bool, pairs: dict[str, str] | None = None) -> None:
    import tract

    print(f"\n{machine()}; tract {tract.version()}; medians of {len(next(iter(results.values())))} fresh processes "
          "(seconds)")
    head = ["archive", "GB", "graph lines", *STAGES, "ready (min-max)", "x first", "peak RSS GB"]
    timed_speed = all("decode_tps" in r for runs in results.values() for r in runs) and bool(results)
    if timed_speed:
        head += ["prefill tok/s", "decode tok/s"]
    pairs = pairs or {}
    if conversions:
        head += ["convert s", "converter's split"]
    if pairs:
        head += ["ready x llama.cpp", "convert x llama.cpp"]
    rows = []
    base = None
    medians = {label: {k: statistics.median(r[k] for r in results[label]) for k in (*STAGES, "ready", "peak_rss_gb")}
               for label, _ in archives}
    for label, path in archives:
        runs = results[label]
        med = medians[label]
        base = base or med["ready"]
        size = sum(f.stat().st_size for f in path.rglob("*")) if path.is_dir() else path.stat().st_size
        row = [label, f"{size / 1e9:.2f}", str(graph_lines(path) or "-"), *(f"{med[k]:.2f}" for k in STAGES),
               f"{med['ready']:.2f} ({min(r['ready'] for r in runs):.2f}-{max(r['ready'] for r in runs):.2f})",
               f"{med['ready'] / base:.2f}x", f"{med['peak_rss_gb']:.2f}"]
        if timed_speed:
            row += [f"{statistics.median(r['prefill_tps'] for r in runs):.1f}",
                    f"{statistics.median(r['decode_tps'] for r in runs):.2f}"]
        if conversions:
            made = conversions.get(label) or conversions.get(label.rsplit(" in ", 1)[0])  # --segments' labels
            row += [f"{made['seconds']:.1f}" if made else "-", made["split"] if made else "-"]
        if pairs:
            other = pairs.get(label)
            row += [f"{med['ready'] / medians[other]['ready']:.1f}x" if other else "-",
                    f"{conversions[label]['seconds'] / conversions[other]['seconds']:.2f}x"
                    if other and label in conversions and other in conversions else "-"]
        rows.append(row)
    table = [head, *rows]
    if markdown:
        print("\n".join("| " + " | ".join(cells) + " |" for cells in [head, ["---"] * len(head), *rows]))
    else:
        widths = [max(len(cells[i]) for cells in table) for i in range(len(head))]
        print("\n".join("  ".join(cell.ljust(w) for cell, w in zip(cells, widths)) for cells in table))


def gguf_source(checkpoint: Path, workdir: Path, layers: int) -> Path:
    """A folder of the (read-only) checkpoint's files, linked, plus bench_vs_llamacpp.py's synthetic tokenizer: what
    ``convert_hf_to_gguf.py`` reads (it needs a tokenizer; the random checkpoint has none)."""
    from bench_vs_llamacpp import write_tokenizer

    folder = workdir / f"gguf_source_{layers}l"
    folder.mkdir(exist_ok=True)
    for entry in checkpoint.iterdir():
        if entry.suffix in (".safetensors", ".json") and not (folder / entry.name).exists():
            (folder / entry.name).symlink_to(entry.resolve())
    if not (folder / "tokenizer.json").exists():
        write_tokenizer(folder)
    return folder


def make_ggufs(llama, checkpoint: Path, workdir: Path, layers: int, formats: list[str], reuse: bool,
               record: dict[str, dict]) -> list[tuple[str, str, Path]]:
    """The GGUF beside each format (``GGUF_TYPES``), each made timed into ``record`` (label -> seconds, split):
    (format, label, path) per format. F32 and F16 by the converter; Q8_0 and Q4_0 by ``llama-quantize`` of the F32
    GGUF, their time including its conversion's (made once per layer count, deleted unless f32 is measured)."""
    source, made, f32 = None, [], (workdir / f"{layers}l.F32.gguf", None)
    for fmt in sorted(formats, key=lambda f: f != "f32"):  # the F32 GGUF first: the quantized ones read it
        kind = GGUF_TYPES[fmt.split("-")[0]]
        out, label = workdir / f"{layers}l.{kind}.gguf", f"{layers} layers {kind} (llama.cpp)"
        if not (reuse and out.exists() and label in record):
            source = source or gguf_source(checkpoint, workdir, layers)
            if kind in ("F32", "F16"):
                start, cpu = time.perf_counter(), children_cpu()
                llama.convert(source, out, kind.lower())
                record[label] = {"seconds": time.perf_counter() - start, "split": f"convert_hf_to_gguf {kind}",
                                 "cpu_seconds": children_cpu() - cpu}
                if kind == "F32":  # the quantized ones read this one (converting it again overwrote its record)
                    f32 = (out, record[label]["seconds"])
            else:
                f32_label = f"{layers} layers F32 (llama.cpp)"
                if f32[1] is None and not (reuse and f32[0].exists() and f32_label in record):
                    start, cpu = time.perf_counter(), children_cpu()
                    llama.convert(source, f32[0], "f32")
                    record[f32_label] = {"seconds": time.perf_counter() - start, "split": "convert_hf_to_gguf F32",
                                         "cpu_seconds": children_cpu() - cpu}
                f32 = (f32[0], record[f32_label]["seconds"])
                start, cpu = time.perf_counter(), children_cpu()
                llama.quantize(f32[0], out, kind)
                quantized, cpu = time.perf_counter() - start, children_cpu() - cpu
                record[label] = {"seconds": f32[1] + quantized,
                                 "split": f"convert_hf_to_gguf F32 {f32[1]:.1f}s, llama-quantize {quantized:.1f}s",
                                 "cpu_seconds": record[f32_label].get("cpu_seconds", float("nan")) + cpu}
            log(f"{label}: made in {record[label]['seconds']:.1f} s, {record[label]['cpu_seconds']:.1f} s of CPU "
                f"({record[label]['split']})")
        made.append((fmt, label, out))
    if "f32" not in formats and f32[0].exists() and not reuse:
        f32[0].unlink()
    return made


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        print(json.dumps(worker(Path(argv[1]), int(argv[2]) if len(argv) > 2 else None)))
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("archives", nargs="*", type=Path, help="archives (.nnef.tgz or folders) to time as they are")
    parser.add_argument("--runs", type=int, default=5, help="fresh processes per archive (median)")
    parser.add_argument("--cpu", type=int, default=None, help="pin every process to this core (taskset)")
    parser.add_argument("--workdir", type=Path, default=None, help="make archives here first (--layers, --formats)")
    parser.add_argument("--layers", default="4,8,16,24,48", help="with --workdir: layer counts of the 0.8B shape")
    parser.add_argument("--formats", default="int8", help=f"with --workdir: a subset of {','.join(FORMATS)}")
    parser.add_argument("--checkpoint", action="append", default=[], metavar="L=FOLDER",
                        help="with --workdir: reuse this L-layer checkpoint (read only)")
    parser.add_argument("--keep", action="store_true", help="keep the archives made in --workdir (and reuse them, "
                        "with their conversion times, on the next run: --runs 0 only makes them)")
    parser.add_argument("--generate", type=int, default=0, metavar="N", help="with --workdir and int8: also time "
                        "`gdn-export generate --max-new-tokens 1` (and llama-simple -n 1 on the Q8_0 GGUF), N fresh "
                        "processes each")
    parser.add_argument("--segments", default=None, metavar="N,M", help="time each archive once per segment count, "
                        "through the Session's own loader (GDN_EXPORT_SEGMENTS; 'auto': the loader's own choice)")
    parser.add_argument("--speed", default=None, metavar="P,D", help="also time, on each start's plan, a P-token "
                        "prefill and D one-token decode steps (tokens/s: whole and in segments side by side)")
    parser.add_argument("--markdown", action="store_true")
    from bench_vs_llamacpp import LlamaCpp, add_llama_cpp_options

    add_llama_cpp_options(parser)
    args = parser.parse_args(argv)
    archives = [(path.name, path) for path in args.archives]
    pairs: dict[str, str] = {}  # an archive's label -> the label of the GGUF beside it
    made: list[Path] = []
    llama = None
    if args.llama_cpp is not None:
        global LLAMA_LOAD
        scratch = args.workdir or Path(tempfile.mkdtemp(prefix="bench_load_"))
        scratch.mkdir(parents=True, exist_ok=True)
        llama = LlamaCpp(args.llama_cpp, scratch, args.llama_cpp_build)
        LLAMA_LOAD = llama.compile(LOAD_C, "llama_load")
    record_path = args.workdir / "conversions.json" if args.workdir else None
    conversions: dict[str, dict] = json.loads(record_path.read_text()) if args.keep and record_path \
        and record_path.exists() else {}
    if args.workdir is not None:
        formats = args.formats.split(",")
        if any(f not in FORMATS for f in formats):
            parser.error(f"--formats: a comma-separated subset of {','.join(FORMATS)}")
        given = {int(k): Path(v) for k, v in (c.split("=", 1) for c in args.checkpoint)}
        args.workdir.mkdir(parents=True, exist_ok=True)
        for layers in (int(n) for n in args.layers.split(",")):
            checkpoint = checkpoint_for(layers, args.workdir, given)
            for fmt in formats:
                out = args.workdir / f"{layers}l.{fmt}.nnef.tgz"
                label = f"{layers} layers {fmt}"
                if out.exists() and args.keep and label in conversions:
                    log(f"{label}: reusing {out}")
                else:
                    conversions[label] = convert(checkpoint, fmt, out)
                    log(f"{label}: converted in {conversions[label]['seconds']:.1f} s, "
                        f"{conversions[label]['cpu_seconds']:.1f} s of CPU "
                        f"({conversions[label]['split']}), peak RSS {conversions[label]['peak_rss_gb']:.2f} GB")
                    made.append(out)
                archives.append((label, out))
            if llama is not None:
                for fmt, label, gguf in make_ggufs(llama, checkpoint, args.workdir, layers,
                                                   [f for f in formats if f in GGUF_TYPES], args.keep, conversions):
                    pairs[f"{layers} layers {fmt}"] = label
                    archives.append((label, gguf))
                    made.append(gguf)
            if record_path is not None:
                record_path.write_text(json.dumps(conversions, indent=1))
    if not archives:
        parser.error("give archives, or --workdir with --layers and --formats")
    if args.segments:
        counts = [0 if n == "auto" else int(n) for n in args.segments.split(",")]
        os.environ.setdefault("GDN_EXPORT_CACHE", tempfile.mkdtemp(prefix="bench_load_cache_"))
        spread = []
        for label, path in archives:
            if path.suffix == ".gguf" or path.is_dir():
                spread.append((label, path))
                continue
            for count in counts:
                name = f"{label} in {count or 'auto'}"
                SEGMENTS[name] = count
                spread.append((name, path))
                if count != 1:  # the first start of a graph records its cuts' facts: made once, not timed
                    one_start(path, args.cpu, name)
        archives = spread
    if args.speed:
        os.environ[SPEED_ENV] = args.speed
    try:
        if args.runs > 0:
            results = measure(archives, args.runs, args.cpu)
            print_table(archives, results, conversions, args.markdown, pairs)
        if args.generate and args.workdir is not None:
            print_generate(archives, pairs, args.generate, args.cpu, llama)
    finally:
        if not args.keep:
            for path in made:
                path.unlink(missing_ok=True)
    return 0


def print_generate(archives: list[tuple[str, Path]], pairs: dict[str, str], runs: int, cpu: int | None,
                   llama) -> None:
    """Wall seconds of `gdn-export generate --max-new-tokens 1` on each int8 archive and of llama-simple -n 1 on the
    Q8_0 GGUF beside it, fresh processes, rounds interleaved, medians."""
    paths = dict(archives)
    commands = {}
    for label, path in archives:
        if label.endswith(" int8"):
            commands[label] = [sys.executable, "-m", "gdn_export.cli", "generate", str(path), "--prompt-ids",
                               "1,2,3,4", "--max-new-tokens", "1"]
            if llama is not None and label in pairs:
                commands[pairs[label]] = [str(llama.bin / "llama-simple"), "-m", str(paths[pairs[label]]), "-n", "1",
                                          "abcd"]
    times: dict[str, list[float]] = {label: [] for label in commands}
    for _ in range(runs):
        for label, command in commands.items():
            times[label].append(generate_seconds(command, cpu))
            log(f"generate {label}: {times[label][-1]:.2f} s")
    print(f"\none token generated from a 4-token prompt, wall seconds of the whole command, median of {runs} fresh "
          "processes (min-max)")
    for label, values in times.items():
        tool = "llama-simple -n 1" if label.endswith("(llama.cpp)") else "gdn-export generate --max-new-tokens 1"
        print(f"| {label} | {tool} | {statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f}) |")


if __name__ == "__main__":
    sys.exit(main())
