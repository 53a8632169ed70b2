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

tract is not asked about the whole graph (its load grows faster than the layers: 7.6 s of a 24-layer 0.8B
conversion, 24.7 s at 48 layers). An output of an einsum (``KEEP_THEIR_NAME``: a float linear layer,
backends/nnef/float_linears.py) keeps its name unasked; one computed by an op outside ``MAY_KEEP_THEIR_NAME`` (a
linear, a mul, a copy, a fused op; a cast to the type it already has) is wrapped unasked: the select keeps the declared name whatever tract would have reported,
and on every fixture those are the outputs tract renames. The others (the layers' states: a transpose, a squeeze, a
concat) are grouped by how they are written (``_Graph.signatures``: ops, attributes and shapes ``SIGNATURE_DEPTH``
producers back, not the names or the layer numbers), and tract loads only the graph's first statements: up to the
earliest output of each group and the last reader of what it is computed from (tract fuses an op into its input's
producer only where nothing else reads that input, so each tensor near those outputs keeps all its readers), with
the tensors later statements read declared as outputs: the first layer of each kind. Every layer of one kind is
written alike, so it is renamed alike; tests/test_output_names.py compares this answer with tract's load of the
whole graph on every fixture.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
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


# The ops whose output tract may report under the declared name (an output of any other op is wrapped without
# asking tract: a copy or cast it removes, a linear or mul it fuses, a fused op's second output; see the module doc).
MAY_KEEP_THEIR_NAME = frozenset({"transpose", "squeeze", "unsqueeze", "reshape", "concat", "slice", "select"})
# The ops whose output tract reports under the declared name, not asked either: a float linear layer written as an
# einsum (backends/nnef/float_linears.py; tract_quirks.EINSUM_KEEPS_ITS_NAME), e.g. an untied head's logits.
KEEP_THEIR_NAME = frozenset({"tract_core_einsum"})
_LINEAR_EINSUM = re.compile(r"expr\s*=\s*'([a-h]*)k,nk->\1n'")  # only float_linears' form: any other is wrapped
SIGNATURE_DEPTH = 8  # how many producers back two outputs must be written alike to count as one kind

_STRING = re.compile(r"'[^']*'|\"[^\"]*\"")
_WORD = re.compile(r"[A-Za-z_]\w*")


@dataclass
class _Graph:
    """graph.nnef's main graph as statements: enough to cut it down to the cones of some outputs."""

    prefix_text: str  # everything before ``graph NAME(``: the fragments, extensions
    name: str
    inputs: list[str]
    outputs: list[str]
    statements: list[tuple[list[str], str]]  # (names assigned, right-hand side), in the written order
    producer: dict[str, tuple[int, int]]  # name -> (statement index, position among its names) of its last assignment
    reads: list[list[tuple[int, int]]]  # per statement, the producers (as above) of the tensors it reads

    @classmethod
    def parse(cls, text: str) -> "_Graph":
        header = re.search(r"graph\s+(\w+)\s*\((.*?)\)\s*->\s*\((.*?)\)\s*\{", text, re.S)
        body = text[header.end(): text.rindex("}")]
        statements, reads, producer = [], [], {}
        for piece in body.split(";"):
            if piece.strip():
                assigned, rhs = piece.split("=", 1)
                names, rhs = _WORD.findall(assigned), rhs.strip()
                # a name may be assigned again (torch-to-nnef does): a read is of its assignment so far
                reads.append([producer[w] for w in _WORD.findall(_STRING.sub("", rhs)) if w in producer])
                producer.update({name: (len(statements), k) for k, name in enumerate(names)})
                statements.append((names, rhs))
        return cls(prefix_text=text[: header.start()], name=header.group(1),
                   inputs=[n.strip() for n in header.group(2).split(",") if n.strip()],
                   outputs=[n.strip() for n in header.group(3).split(",") if n.strip()],
                   statements=statements, producer=producer, reads=reads)

    def op(self, name: str) -> str:
        word = _WORD.match(self.statements[self.producer[name][0]][1])
        return word.group(0) if word else ""

    def signatures(self, depth: int) -> dict[str, str]:
        """Per declared output, a digest of how it is computed ``depth`` producers back: the ops, their
        attributes and the positions of what they read, not the tensors' names nor the constants' labels (nor
        their values: the shadow tract loads has its weights as inputs anyway)."""
        import hashlib

        memo: dict[tuple[tuple[int, int], int], str] = {}

        def written(rhs: str) -> str:
            rhs = re.sub(r"label\s*=\s*'[^']*'", "label", rhs)  # a constant by its shape: layers label theirs apart
            rhs = _STRING.sub(lambda m: re.sub(r"\d+", "#", m.group(0)), rhs)
            return _WORD.sub(lambda m: "%" if m.group(0) in self.producer else m.group(0), rhs)

        def signature(node: tuple[int, int], level: int) -> str:
            key = (node, level)
            if key not in memo:
                index, position = node
                parts = [str(position), written(self.statements[index][1])]
                if level:
                    parts += [signature(read, level - 1) for read in self.reads[index]]
                memo[key] = hashlib.sha1("|".join(parts).encode()).hexdigest()
            return memo[key]

        return {name: signature(self.producer[name], depth) for name in self.outputs}

    def prefix(self, outputs: list[str]) -> tuple[str, list[str]]:
        """The graph's first statements, far enough for ``outputs`` and every reader of what they are computed
        from (so each tensor near them has the readers it has in the whole graph: tract fuses an op into its input's
        producer only where nothing else reads that input); its outputs: the declared ones it computes, then the
        tensors later statements read (kept alive, as the rest of the graph keeps them). Returns (graph text, the
        declared outputs it computes)."""
        # constants (computed from no input: tract folds them) and the inputs themselves have no readers to keep
        varying: set[int] = set()
        for index, (_, rhs) in enumerate(self.statements):
            if rhs.startswith(("tract_core_external", "external")) or any(r in varying for r, _ in self.reads[index]):
                varying.add(index)
        leaf = {index for index, (_, rhs) in enumerate(self.statements)
                if index not in varying or rhs.startswith(("tract_core_external", "external"))}
        cone: set[int] = set()
        stack = [self.producer[name][0] for name in outputs]
        while stack:
            index = stack.pop()
            if index not in cone:
                cone.add(index)
                stack.extend(read for read, _ in self.reads[index])
        end = max(self.producer[name][0] for name in outputs)
        for index, reads in enumerate(self.reads):  # readers of the cone's computed tensors
            if index > end and any(read in cone and read not in leaf for read, _ in reads):
                end = index
        declared = [name for name in self.outputs if self.producer[name][0] <= end]
        live: list[str] = []
        for reads in self.reads[end + 1:]:
            for index, position in reads:
                name = self.statements[index][0][position]
                if index <= end and index not in leaf and self.producer[name] == (index, position) \
                        and name not in live and name not in declared:
                    live.append(name)
        defined = {name for names, _ in self.statements[: end + 1] for name in names}
        inputs = [name for name in self.inputs if name in defined]
        lines = [f"    {names[0] if len(names) == 1 else '(' + ', '.join(names) + ')'} = {rhs};\n"
                 for names, rhs in self.statements[: end + 1]]
        text = (f"{self.prefix_text}graph {self.name}({', '.join(inputs)}) -> ({', '.join(declared + live)})\n{{\n"
                + "".join(lines) + "}\n")
        return text, declared


def renamed_outputs(folder: Path, inputs_from_bytes: int | None = None,
                    pending: Mapping[str, str] | None = None, retyped: frozenset[str] = frozenset()) -> list[str]:
    """The declared outputs of ``folder``'s graph that tract would report under another name, learnt without a
    load of the whole graph: an output of an einsum (``KEEP_THEIR_NAME``) is kept unasked, one of another op outside
    ``MAY_KEEP_THEIR_NAME`` counted as renamed unasked;
    the others are grouped by how they are computed (``_Graph.signatures``: every layer of one kind writes its
    states alike) and tract loads only the graph's first statements (``_Graph.prefix``: up to the earliest output
    of each group and the last reader of what it is computed from: the first layer of each kind), which answers
    for the outputs it computes and for their groups. An output of a ``tract_core_cast`` is decided by its types
    (``tract_quirks.SAME_TYPE_CAST_REMOVED``): renamed unless it is in ``retyped`` (the casts that change the type,
    which the translated graph knows). ``inputs_from_bytes``, ``pending``: see ``tract_names``.
    tests/test_output_names.py checks the answer against tract's load of the whole graph on every fixture."""
    import tempfile

    import tract

    graph = _Graph.parse((folder / "graph.nnef").read_text())
    asked = [name for name in graph.outputs if graph.op(name) in MAY_KEEP_THEIR_NAME]
    kinds = graph.signatures(SIGNATURE_DEPTH)
    earliest: dict[str, str] = {}
    for name in sorted(asked, key=lambda name: graph.producer[name]):
        earliest.setdefault(kinds[name], name)
    answered: dict[str, bool] = {}  # a declared output of the prefix -> whether tract renames it
    if earliest:
        text, declared = graph.prefix(list(earliest.values()))
        with tempfile.TemporaryDirectory(prefix=".gdn_export_names_", dir=folder.parent) as tmp:
            shadow = Path(tmp)
            _weights_as_inputs(folder, shadow, 2 ** 62 if inputs_from_bytes is None else inputs_from_bytes,
                               pending or {}, text=text)
            model = tract.nnef().with_tract_transformers().load(str(shadow))
            answered = {name: model.output_name(i) != name for i, name in enumerate(declared)}
    renamed_kinds = {kinds[name] for name in earliest.values() if answered[name]}

    def renamed(name: str) -> bool:
        if name in answered:
            return answered[name]
        if name in asked:
            return kinds[name] in renamed_kinds
        if graph.op(name) in KEEP_THEIR_NAME and _LINEAR_EINSUM.search(graph.statements[graph.producer[name][0]][1]):
            return False
        return graph.op(name) != "tract_core_cast" or name not in retyped

    return [name for name in graph.outputs if renamed(name)]


NNEF_ITEM_TYPES = {(0, 16): "f16", (0, 32): "f32", (0, 64): "f64"}  # (item type, bits) of a .dat header -> tract's


def _weights_as_inputs(folder: Path, shadow: Path, min_bytes: int, pending: Mapping[str, str],
                       text: str | None = None) -> None:
    """``shadow``: ``folder``'s graph (or ``text``, a graph reading ``folder``'s files) with each variable of
    ``min_bytes`` or more declared as an input; a variable of ``pending`` (label -> tract type: a weight matrix whose
    file is still being written) is one too, its file not opened."""
    import os
    import shutil
    import struct

    if text is None:
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
    # the weights the shadow's graph still reads as variables, linked, not copied; no other .dat: tract reads every
    # file of a folder, and a prefix of the graph (``renamed_outputs``) leaves out weights that may still be being
    # written (``pending``): linked, a half-written one failed the load ("failed to fill whole buffer")
    from gdn_export.run.archive import VARIABLE

    kept = {match.group(2) for match in VARIABLE.finditer(text)}  # of any type
    for entry in folder.iterdir():
        label = entry.name.removesuffix(".dat")
        if entry.is_file() and entry.name != "graph.nnef" and label not in replaced \
                and (not entry.name.endswith(".dat") or label in kept):
            try:
                os.link(entry, shadow / entry.name)
            except OSError:
                shutil.copyfile(entry, shadow / entry.name)


def declared_outputs(folder: Path) -> list[str]:
    header = re.search(r"graph\s+\w+\s*\(.*?\)\s*->\s*\((.*?)\)", (folder / "graph.nnef").read_text(), re.S)
    return [name.strip() for name in header.group(1).split(",")]


def _condition(raw: str, is_bool: bool) -> str:
    """A condition of ``raw``'s own shape, computed from it (so tract cannot fold the select): a select whose
    condition broadcasts copies ~5x slower in tract 0.23.9 (tract_quirks.SELECT_BROADCAST_SLOW); an empty output
    gives an empty condition, which is fine."""
    return raw if is_bool else f"eq({raw}, {raw})"


def keep_output_names(folder: Path, inputs_from_bytes: int | None = None,
                      pending: Mapping[str, str] | None = None, bool_outputs: frozenset[str] = frozenset(),
                      retyped: frozenset[str] = frozenset()) -> list[str]:
    """Rewrite ``folder/graph.nnef`` so tract reports every declared output name; return the names fixed.

    ``inputs_from_bytes``, ``pending``: see ``tract_names`` (the weights are then not read); ``bool_outputs``: the
    outputs of type bool (their own condition); ``retyped``: see ``renamed_outputs``. Which outputs need it is ``renamed_outputs``' answer (a load of the
    first layers' part of the graph, not of the whole). The rewrite is not re-loaded here (a load of a big model
    costs seconds to minutes): export's check loads the archive once with ``runtime.load_tract_model(...,
    expect_outputs=...)``, which raises if a name still differs.
    """
    renamed = renamed_outputs(folder, inputs_from_bytes, pending, retyped)
    if not renamed:
        return []
    path = folder / "graph.nnef"
    text = path.read_text()
    start = text.index("{", re.search(r"graph\s+\w+\s*\(", text).end())
    head, body = text[: start + 1], text[start + 1 :]
    body_end = body.rindex("}")
    body, tail = body[:body_end], body[body_end:]
    wrappers = []
    for name in renamed:
        body = _word(name).sub(name + RAW_SUFFIX, body)
        wrappers.append(_wrapper(name, name in bool_outputs))
    path.write_text(head + body + "".join(wrappers) + tail)
    return renamed


def growth_bound(folder: Path) -> int:
    """The most bytes ``keep_output_names`` may add to ``folder/graph.nnef``: every declared output renamed (its
    uses suffixed, its wrapper appended), what an archive writer leaves room for before the names are known."""
    names = set(declared_outputs(folder))
    if not names:
        return 0
    any_name = rf"(?<![\w.])(?:{'|'.join(map(re.escape, names))})(?![\w.])"
    uses = re.findall(any_name, (folder / "graph.nnef").read_text())
    return len(uses) * len(RAW_SUFFIX) + sum(len(_wrapper(name, False)) for name in names)


def _word(name: str) -> re.Pattern:
    """``name`` as a whole identifier of the graph's text."""
    return re.compile(rf"(?<![\w.]){re.escape(name)}(?![\w.])")


def _wrapper(name: str, is_bool: bool) -> str:
    """The statements that give output ``name`` back its name, from its renamed producer."""
    raw = name + RAW_SUFFIX
    return f"    {name}__c = {_condition(raw, is_bool)};\n    {name} = select({name}__c, {raw}, {raw});\n"
