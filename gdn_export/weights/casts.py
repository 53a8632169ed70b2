"""Weights that the graph casts before using them, stored in the type they are cast to.

A float16 export still computes a few things in float32 where the reference framework does (an MoE router's
logits: ``F.linear(x.float(), weight.float())``), so torch-to-nnef writes the float16 weight and a cast of it.
tract neither folds that cast nor packs the weight for its matmul kernels: measured 20-40x slower than a packed
matmul (benchmarks/RESULTS.md). ``fold_weight_casts`` stores each weight matrix whose every use is such a cast in
the cast's type instead: the same values (a float16 -> float32 cast is exact), and the cast left in the graph is an
identity tract removes.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import numpy as np

CAST = re.compile(r"tract_core_cast\((\w+),\s*to\s*=\s*'(f32)'\)")
VARIABLE = re.compile(r"^\s*(\w+)\s*=\s*variable<scalar>\(label\s*=\s*'([^']+)',\s*shape\s*=\s*\[([^\]]*)\]", re.M)


def weights_cast_before_use(graph: str) -> dict[str, str]:
    """label -> type, for every variable of rank 2 or more used only through casts to that type."""
    uses = Counter(re.findall(r"(?<![\w.])\w+(?![\w.])", graph))  # every identifier, once over the text
    casts: dict[str, list[str]] = {}
    for match in CAST.finditer(graph):
        casts.setdefault(match.group(1), []).append(match.group(2))
    out = {}
    for match in VARIABLE.finditer(graph):
        name, label, shape = match.groups()
        if shape.count(",") >= 1 and name in casts and uses[name] == 1 + len(casts[name]):  # defined, then cast only
            out[label] = casts[name][0]
    return out


def fold_weight_casts(folder: Path) -> list[str]:
    """Rewrite the ``.dat`` of each float16 weight the graph only casts to float32 as float32; the labels done."""
    import nnef

    done = []
    for label, _ in weights_cast_before_use((folder / "graph.nnef").read_text()).items():
        path = folder / f"{label}.dat"
        with path.open("rb") as handle:
            header = handle.read(128)
            bits, item = np.frombuffer(header, np.uint32, count=2, offset=44)
            if (int(item), int(bits)) != (0, 16):
                continue
            handle.seek(0)
            values = nnef.read_tensor(handle)
        staged = path.with_suffix(".dat.f32")
        with staged.open("wb") as handle:
            nnef.write_tensor(handle, values.astype(np.float32))
        staged.replace(path)
        done.append(label)
    return done
