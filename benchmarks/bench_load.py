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

llama.cpp's load of the same checkpoint's GGUF is not measured here (no llama.cpp build on this machine when this
was written); bench_vs_llamacpp.py times a whole ``llama-bench -p 1 -n 1`` run where one is built.
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
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
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
    if path.is_dir():
        for file in path.rglob("*"):
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


def worker(path: Path) -> dict:
    """Each stage's seconds for one start of ``path`` in this (fresh) process, and the peak RSS."""
    import tract

    from gdn_export.run import session as session_module
    from gdn_export.run.session import Session

    times = {"read": read_seconds(path)}

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
    times["ready"] = times["load"] + times["plan"] + times["first"]
    times["peak_rss_gb"] = peak_rss_bytes() / 1e9
    return times


def peak_rss_bytes() -> int:
    """This process's peak resident set (VmHWM: its own since exec; ``ru_maxrss`` keeps the parent's peak across
    fork + exec, which read the 2.4 GB of the parent that built checkpoints)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# --- the parent -------------------------------------------------------------------------------------------------

def one_start(path: Path, cpu: int | None) -> dict:
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", str(path)]
    if cpu is not None:
        command = ["taskset", "-c", str(cpu), *command]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"the worker failed on {path}:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


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
            times = one_start(path, cpu)
            results[label].append(times)
            log(f"round {round_ + 1}/{runs} {label}: " + ", ".join(f"{k} {times[k]:.2f}" for k in (*STAGES, "ready"))
                + f" s, peak RSS {times['peak_rss_gb']:.2f} GB")
    return results


def convert(checkpoint: Path, fmt: str, out: Path) -> dict:
    """Convert ``checkpoint`` to ``out`` in ``fmt`` in a process of its own: wall seconds and the report's split."""
    command = [sys.executable, "-m", "gdn_export.cli", "convert", str(checkpoint), "-o", str(out), "--force", "--no-check",
               "--logits", "last", *FORMATS[fmt]]
    start = time.perf_counter()
    done = subprocess.run(["/usr/bin/time", "-f", "PEAK_RSS_KB %M", *command], capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"converting {checkpoint} ({fmt}) failed:\n{done.stderr[-3000:]}")
    split = next((line.split("time:", 1)[1].strip() for line in done.stdout.splitlines() if "time:" in line), "")
    peak = next((int(line.split()[1]) * 1024 / 1e9 for line in done.stderr.splitlines()
                 if line.startswith("PEAK_RSS_KB")), float("nan"))
    return {"seconds": seconds, "split": split, "peak_rss_gb": peak}


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
                markdown: bool) -> None:
    import tract

    print(f"\n{machine()}; tract {tract.version()}; medians of {len(next(iter(results.values())))} fresh processes "
          "(seconds)")
    head = ["archive", "GB", "graph lines", *STAGES, "ready (min-max)", "x first", "peak RSS GB"]
    if conversions:
        head += ["convert s", "converter's split"]
    rows = []
    base = None
    for label, path in archives:
        runs = results[label]
        med = {k: statistics.median(r[k] for r in runs) for k in (*STAGES, "ready", "peak_rss_gb")}
        base = base or med["ready"]
        size = sum(f.stat().st_size for f in path.rglob("*")) if path.is_dir() else path.stat().st_size
        row = [label, f"{size / 1e9:.2f}", str(graph_lines(path) or "-"), *(f"{med[k]:.2f}" for k in STAGES),
               f"{med['ready']:.2f} ({min(r['ready'] for r in runs):.2f}-{max(r['ready'] for r in runs):.2f})",
               f"{med['ready'] / base:.2f}x", f"{med['peak_rss_gb']:.2f}"]
        if conversions:
            made = conversions.get(label)
            row += [f"{made['seconds']:.1f}" if made else "-", made["split"] if made else "-"]
        rows.append(row)
    table = [head, *rows]
    if markdown:
        print("\n".join("| " + " | ".join(cells) + " |" for cells in [head, ["---"] * len(head), *rows]))
    else:
        widths = [max(len(cells[i]) for cells in table) for i in range(len(head))]
        print("\n".join("  ".join(cell.ljust(w) for cell, w in zip(cells, widths)) for cells in table))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        print(json.dumps(worker(Path(argv[1]))))
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
    parser.add_argument("--keep", action="store_true", help="keep the archives made in --workdir")
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args(argv)
    archives = [(path.name, path) for path in args.archives]
    conversions: dict[str, dict] = {}
    made: list[Path] = []
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
                if out.exists() and args.keep:
                    log(f"{label}: reusing {out}")
                else:
                    conversions[label] = convert(checkpoint, fmt, out)
                    log(f"{label}: converted in {conversions[label]['seconds']:.1f} s "
                        f"({conversions[label]['split']}), peak RSS {conversions[label]['peak_rss_gb']:.2f} GB")
                    made.append(out)
                archives.append((label, out))
    if not archives:
        parser.error("give archives, or --workdir with --layers and --formats")
    try:
        results = measure(archives, args.runs, args.cpu)
        print_table(archives, results, conversions, args.markdown)
    finally:
        if not args.keep:
            for path in made:
                path.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
