"""Weights that the graph casts before using them, stored in the type they are cast to.

A float16 export still computes a few things in float32 where the reference framework does (an MoE router's
logits: ``F.linear(x.float(), weight.float())``), so torch-to-nnef writes the float16 weight and a cast of it.
tract neither folds that cast nor packs the weight for its matmul kernels: measured 20-40x slower than a packed
matmul (benchmarks/RESULTS.md). ``fold_weight_casts`` stores each weight matrix whose every use is such a cast in
the cast's type instead: the same values (a float16 -> float32 cast is exact), and the cast left in the graph is an
identity tract removes. Which weights those are is read from torch-to-nnef's graph before it is written
(``weights_cast_before_use``, a graph pass of the export's target), not from graph.nnef's text.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

import numpy as np

FOLDED_TYPE = "f32"  # the cast folded: float16 -> float32 (exact)


def weights_cast_before_use(graph) -> dict[str, str]:
    """label -> type, for every variable of rank 2 or more used only through casts to that type.

    ``graph``: torch-to-nnef's NNEF graph (``nnef_tools.model.Graph``) before it is written: the export runs this
    as a graph pass of its target (``backends.nnef.target.OfflineTractTarget``), so the graph's own operations are
    read, not its text."""
    out = {}
    for op in graph.operations:
        if op.type != "variable" or len(op.attribs.get("shape", ())) < 2:
            continue
        tensor = op.outputs[0]
        if op.attribs["label"] == tensor.name:
            # kept as the text pass this replaces decided (it counted the label as one more use of the name): a
            # refactor changes no archive; folding these too is a later, visible change
            continue
        uses = tensor.consumers
        if uses and tensor not in graph.outputs and all(
                use.type == "tract_core_cast" and use.attribs == {"to": FOLDED_TYPE} and list(use.inputs) == [tensor]
                for use in uses):
            out[op.attribs["label"]] = FOLDED_TYPE
    return out


def fold_weight_casts(folder: Path, labels: Iterable[str]) -> list[str]:
    """Rewrite the ``.dat`` of each float16 weight of ``labels`` (``weights_cast_before_use``: the graph only casts
    them to float32) as float32; the labels done. A weight file, written by torch-to-nnef or a streamed writer, is
    converted: graph.nnef is not touched (its casts become identities tract removes)."""
    import nnef

    done = []
    for label in labels:
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
