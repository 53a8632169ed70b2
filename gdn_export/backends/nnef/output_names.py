"""Keeping the declared output names of an NNEF graph visible through tract's ``Model.output_name``.

tract reports an output by the name of the node producing it, not by the outlet label its NNEF loader
sets, and its declutter pass moves outputs onto other nodes: a ``linear`` output shows as
``logits_linear_output``, both outputs of a two-output fused op show the op's first name, a removed
``copy`` shows its source. An ``Iff`` node (NNEF ``select``) whose condition is computed from the data
is never folded and keeps its own name, so each renamed output is re-declared as
``NAME = select(c, NAME__raw, NAME__raw)``: the same value whatever ``c`` is. It copies the tensor once
per call, so only the outputs tract would rename get it.

Why this one is a pass over graph.nnef after it is written, the one left of gdn_export's own (weights/int8/codec.py's is
the int8 helper's): which outputs tract renames is decided by tract's declutter on the loaded model (which ops it
fuses, which copies it removes), so only tract can say it, about a written graph; torch-to-nnef's translated graph
(where the other passes run: ``backends.nnef.target.OfflineTractTarget``'s graph passes) cannot predict it, and
a shadow of that graph for tract to load first would need the block-quantized (Q4_0) weights' files, which exist
only once written, and would serialize the weight writes this load now overlaps (backends/nnef/exporter.py). The behaviour it works around and the one it relies on are typed records with canaries:
``tract_quirks.OUTPUT_NAMED_AFTER_PRODUCER``, ``SELECT_KEEPS_ITS_NAME``, ``FUSED_OUTPUTS_SHARE_A_NAME``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Mapping


RAW_SUFFIX = "__raw"


def tract_names(folder: Path, inputs_from_bytes: int | None = None,
                pending: Mapping[str, str] | None = None) -> tuple[list[str], list[str], list[str]]:
    """(declared output names, names tract reports, facts) for the graph in ``folder``.

    With ``inputs_from_bytes``, tract loads a copy of the graph in which every variable of rank 2 or more whose
    ``.dat`` holds at least that many bytes is a graph input of the same shape and type instead: the names come out the same (checked
    against the plain load on every fixture in tests/test_output_names.py) without reading the weights, which is
    what lets a model bigger than memory be exported."""
    import tempfile

    import tract

    if inputs_from_bytes is not None:
        with tempfile.TemporaryDirectory(prefix=".gdn_export_names_", dir=folder.parent) as tmp:
            shadow = Path(tmp)
            _weights_as_inputs(folder, shadow, inputs_from_bytes, pending or {})
            return tract_names(shadow)
    model = tract.nnef().with_tract_transformers().load(str(folder))
    reported = [model.output_name(i) for i in range(model.output_count())]
    facts = [str(model.output_fact(i)) for i in range(model.output_count())]
    return declared_outputs(folder), reported, facts


NNEF_ITEM_TYPES = {(0, 16): "f16", (0, 32): "f32", (0, 64): "f64"}  # (item type, bits) of a .dat header -> tract's


def _weights_as_inputs(folder: Path, shadow: Path, min_bytes: int, pending: Mapping[str, str]) -> None:
    """``shadow``: ``folder``'s graph with each variable of ``min_bytes`` or more declared as an input; a variable
    of ``pending`` (label -> tract type: a weight matrix whose file is still being written) is one too, its file
    not opened."""
    import os
    import shutil
    import struct

    text = (folder / "graph.nnef").read_text()
    added: list[str] = []
    replaced: set[str] = set()

    def stored_type(label: str) -> str | None:
        """The tract type of ``label``'s .dat when it holds ``min_bytes`` or more of a float type, else None."""
        path = folder / f"{label}.dat"
        if not path.is_file() or path.stat().st_size - 128 < min_bytes:
            return None
        with path.open("rb") as handle:
            header = handle.read(128)
        return NNEF_ITEM_TYPES.get(struct.unpack_from("<II", header, 44)[::-1])

    def replace(match: re.Match) -> str:
        name, label, shape = match.group(1), match.group(2), match.group(3)
        if shape.count(",") < 1:
            return match.group(0)  # vectors and scalars (some ops need those as constants) stay
        datum = pending[label] if label in pending else stored_type(label)
        if datum is None:
            return match.group(0)  # small ones, and block-quantized ones, stay
        added.append(name)
        replaced.add(label)
        return f"{name} = tract_core_external(shape = [{shape}], datum_type = '{datum}');"

    text = re.sub(r"(\w+)\s*=\s*variable<scalar>\(label\s*=\s*'([^']+)',\s*shape\s*=\s*\[([^\]]*)\]\);", replace, text)
    if added:
        text = re.sub(r"(graph\s+\w+\s*\()", lambda m: m.group(1) + ", ".join(added) + ", ", text, count=1)
    (shadow / "graph.nnef").write_text(text)
    for entry in folder.iterdir():  # the weights left as variables (and other files), linked, not copied
        if entry.is_file() and entry.name != "graph.nnef" and entry.name.removesuffix(".dat") not in replaced:
            try:
                os.link(entry, shadow / entry.name)
            except OSError:
                shutil.copyfile(entry, shadow / entry.name)


def declared_outputs(folder: Path) -> list[str]:
    header = re.search(r"graph\s+\w+\s*\(.*?\)\s*->\s*\((.*?)\)", (folder / "graph.nnef").read_text(), re.S)
    return [name.strip() for name in header.group(1).split(",")]


def _condition(raw: str, fact: str) -> str:
    """A condition of ``raw``'s own shape, computed from it (so tract cannot fold the select): a select whose
    condition broadcasts copies ~5x slower in tract 0.23.9 (tract_quirks.SELECT_BROADCAST_SLOW); an empty output
    gives an empty condition, which is fine."""
    dtype = fact.rsplit(",", 1)[-1]  # a fact reads "B,128,f32": its dimensions, then its type
    return raw if dtype == "bool" else f"eq({raw}, {raw})"


def keep_output_names(folder: Path, inputs_from_bytes: int | None = None,
                      pending: Mapping[str, str] | None = None) -> list[str]:
    """Rewrite ``folder/graph.nnef`` so tract reports every declared output name; return the names fixed.

    ``inputs_from_bytes``, ``pending``: see ``tract_names`` (the weights are then not read). The rewrite is not re-loaded here (a load of a big model costs seconds to minutes): export's check loads the
    archive once with ``runtime.load_tract_model(..., expect_outputs=...)``, which raises if a name still differs.
    """
    declared, reported, facts = tract_names(folder, inputs_from_bytes, pending)
    renamed = [(name, fact) for name, got, fact in zip(declared, reported, facts) if got != name]
    if not renamed:
        return []
    path = folder / "graph.nnef"
    text = path.read_text()
    start = text.index("{", re.search(r"graph\s+\w+\s*\(", text).end())
    head, body = text[: start + 1], text[start + 1 :]
    body_end = body.rindex("}")
    body, tail = body[:body_end], body[body_end:]
    wrappers = []
    for name, fact in renamed:
        word = re.compile(rf"(?<![\w.]){re.escape(name)}(?![\w.])")
        body = word.sub(name + RAW_SUFFIX, body)
        raw = name + RAW_SUFFIX
        wrappers.append(f"    {name}__c = {_condition(raw, fact)};\n    {name} = select({name}__c, {raw}, {raw});\n")
    path.write_text(head + body + "".join(wrappers) + tail)
    return [name for name, _ in renamed]
