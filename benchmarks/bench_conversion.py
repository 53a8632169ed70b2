"""Conversion time against llama.cpp's, side by side in one run: gdn_export trees and llama.cpp's converter (issue 36).

    python benchmarks/bench_conversion.py --workdir DIR --layers 8,24,48 --formats int8,f32 \
        [--tree main=/work/main --tree new=$PWD] [--checkpoint 24=FOLDER] [--rounds 1] \
        [--llama-cpp DIR --llama-cpp-build DIR]

Per layer count, the 0.8B Qwen3.5 shape (``large_checkpoint.py --layers L --hidden 1024 --intermediate 3584
--tied``; ``--checkpoint L=FOLDER`` reuses one read-only) is converted by each ``--tree`` (``LABEL=DIR``: a
gdn_export source tree, run with ``PYTHONPATH=DIR``; default: this one) in each format with ``gdn-export convert
--no-check --logits last`` (bench_load.py's formats), and made into the GGUF beside each format by llama.cpp as
bench_load.py makes it (``convert_hf_to_gguf.py`` F32 / F16; Q8_0 = the F32 conversion + ``llama-quantize``). Each
conversion runs in a process of its own, the trees and llama.cpp in turn within a round, so a busy spell falls on
all of them. The table gives per row the median wall seconds over ``--rounds``, the CPU seconds (user + system of
the process), the load average just before the first round's run, the converter's own split (its ``time:`` line),
and the ratio to llama.cpp's conversion of the same checkpoint into the GGUF beside that format.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_decode_profile import table  # noqa: E402
from bench_load import GGUF_TYPES, checkpoint_for, convert, log, machine, make_ggufs  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, required=True, help="archives, GGUFs and built checkpoints go here")
    parser.add_argument("--layers", default="8,24,48", help="layer counts of the 0.8B shape")
    parser.add_argument("--formats", default="int8,f32", help=f"a subset of {','.join(GGUF_TYPES)}")
    parser.add_argument("--tree", action="append", default=[], metavar="LABEL=DIR",
                        help="a gdn_export source tree to convert with (PYTHONPATH=DIR); default: this one")
    parser.add_argument("--checkpoint", action="append", default=[], metavar="L=FOLDER",
                        help="reuse this L-layer checkpoint (read only)")
    parser.add_argument("--rounds", type=int, default=1, help="conversions per tree and format (median)")
    parser.add_argument("--markdown", action="store_true")
    from bench_vs_llamacpp import LlamaCpp, add_llama_cpp_options

    add_llama_cpp_options(parser)
    args = parser.parse_args(argv)
    formats = args.formats.split(",")
    if any(f not in GGUF_TYPES for f in formats):
        parser.error(f"--formats: a comma-separated subset of {','.join(GGUF_TYPES)}")
    trees = [tuple(t.split("=", 1)) for t in args.tree] or [("this tree", str(HERE.parent))]
    given = {int(k): Path(v) for k, v in (c.split("=", 1) for c in args.checkpoint)}
    args.workdir.mkdir(parents=True, exist_ok=True)
    llama = LlamaCpp(args.llama_cpp, args.workdir, args.llama_cpp_build) if args.llama_cpp else None
    rows: list[dict] = []
    for layers in (int(n) for n in args.layers.split(",")):
        checkpoint = checkpoint_for(layers, args.workdir, given)
        runs: dict[tuple[str, str], list[dict]] = {}
        for round_ in range(args.rounds):
            for fmt in formats:
                for label, tree in trees:
                    out = args.workdir / f"{layers}l.{fmt}.nnef.tgz"
                    env = {**os.environ, "PYTHONPATH": str(Path(tree).resolve())}
                    load = os.getloadavg()[0]
                    result = {**convert(checkpoint, fmt, out, env=env), "load": load}
                    runs.setdefault((label, fmt), []).append(result)
                    log(f"{layers} layers {fmt}, {label}: {result['seconds']:.1f} s, {result['cpu_seconds']:.1f} s of "
                        f"CPU ({result['split']}), load {load:.2f}")
                    out.unlink(missing_ok=True)
            if llama is not None:
                record: dict[str, dict] = {}
                load = os.getloadavg()[0]
                for fmt, label, gguf in make_ggufs(llama, checkpoint, args.workdir, layers, formats, False, record):
                    runs.setdefault(("llama.cpp", fmt), []).append({**record[label], "load": load})
                    gguf.unlink(missing_ok=True)
        for fmt in formats:
            reference = runs.get(("llama.cpp", fmt))
            base = statistics.median(r["seconds"] for r in reference) if reference else None
            for label in [t[0] for t in trees] + (["llama.cpp"] if reference else []):
                measured = runs[(label, fmt)]
                seconds = statistics.median(r["seconds"] for r in measured)
                rows.append({"layers": layers, "format": fmt if label != "llama.cpp" else GGUF_TYPES[fmt],
                             "who": label, "seconds": seconds,
                             "cpu": statistics.median(r["cpu_seconds"] for r in measured),
                             "load": measured[0]["load"], "split": measured[0]["split"],
                             "ratio": seconds / base if base else float("nan")})
    print(f"\n{machine()}; medians of {args.rounds} conversion(s) each (seconds)")
    head = ["layers", "format", "converter", "wall s", "CPU s", "load", "x llama.cpp", "split"]
    lines = [[str(r["layers"]), r["format"], r["who"], f"{r['seconds']:.1f}", f"{r['cpu']:.1f}", f"{r['load']:.2f}",
              f"{r['ratio']:.2f}x", r["split"]] for r in rows]
    print(table(head, lines, args.markdown))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
