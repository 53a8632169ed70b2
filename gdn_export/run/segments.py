"""Loading a big archive as consecutive segments planned side by side: the graph cut at layer boundaries, each segment a
graph of its own that tract loads and plans in its own thread, run one after the other on every call.

Why: tract's load and plan of a graph are single-threaded and grow faster than the graph (the 0.8B shape: 24 layers
ready in ~13 s, 4 layers in ~2 s), while two loads in two threads run side by side (the bindings release the GIL).
The 0.8B int8 graph cut in two halves was planned in 5.2 s on two cores against 11.4 s whole, and 10.1 s for the two
halves one after the other (benchmarks/RESULTS.md). Each call then runs the segments in turn; what one segment computes
and a later one reads (the residual stream, the attention mask) passes between them as tract tensors, not copied.

How a graph is cut (``plan``): every statement of the graph body is classified by what it depends on. A *weight*
statement reads only variables (a variable, a cast or reshape of one); a *light* one reads graph inputs and small
variables only (positions, rotary tables, a state input's cast); an *activation* reads both a graph input and a
large variable, or another activation. Weight and light statements are copied into every segment that needs them (a
large weight read by two segments, such as a tied embedding, is then read twice); an activation belongs to the segment
whose range holds it, and one read by a later segment is an output of its own segment and an input of the later one. A
cut is placed where the fewest activations cross it, near equal shares of the activations.

What tract needs and the text cannot say: the type and shape of a tensor that crosses a cut (``B,S,1024,f32``),
declared as an external input of the later segment. tract states them as the output facts of the earlier segment, so
the first load of a graph plans its segments one after the other and records the facts (``facts_file``: a small JSON
keyed by the graph's SHA-256, the cuts and tract's version, under ``GDN_EXPORT_CACHE`` or ``~/.cache/gdn_export``);
every later load, in any process, plans the segments side by side. tract reads a graph and its weights from a
folder; the archive's members are written to a temporary folder during the integrity pass that reads them anyway
(``integrity.check_archive(..., unpack_to=...)``), and removed once the segments are planned.

Any fault on this path (a graph this module cannot cut, a fact it cannot declare, a segment tract refuses) falls back
to loading the archive whole, with a one-line warning: slower, never different. Outputs are the same to the bit:
tests/test_segments.py runs every position's logits and every state of whole and cut plans side by side.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
import threading
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from gdn_export.run.archive import VARIABLE

SEGMENTS_ENV = "GDN_EXPORT_SEGMENTS"  # a number of segments (1: never cut), else chosen from the graph
CACHE_ENV = "GDN_EXPORT_CACHE"  # the folder of the recorded facts (default ~/.cache/gdn_export)
UNPACK_ENV = "GDN_EXPORT_UNPACK_DIR"  # where the weights are written for tract to read (default: unpack_root)
# tract's load and plan of a graph grow faster than its statements, so a graph loads faster in more, smaller
# segments than there are cores (each later one also starts sooner, its weights written earlier): the 0.8B int8
# archive (6,143 statements) on 2 cores, ready in 5.6 s in 2 segments, 5.1 s in 3, 4.8-4.9 s in 4 and in 6; f16
# (~4,800) 6.8 s in 2, 6.1-6.4 s in 4 (benchmarks/RESULTS.md, 2026-12-05). One segment per this many statements.
STATEMENTS_PER_SEGMENT = 1200
# and one more per this many archive bytes: a heavier archive's pass ends later, so its last segment starts later
# and had better be small (f16, 1.62 GB, ~4,400 statements: 6.3-6.5 s in 3 segments, 5.97-5.99 s in 4; int8, 0.82 GB:
# 4.73-4.83 s in 4, 4.80-5.07 s in 5)
SEGMENT_BYTES = 1 << 30
MAX_SEGMENTS = 8
MIN_ARCHIVE_BYTES = 64 << 20  # smaller archives plan in a few seconds: loaded whole unless SEGMENTS_ENV says otherwise
# Cutting pays in graph (tract's per-node work, side by side) and costs in bytes (the weights written out and read
# back, the pass before the last segment starts): measured on the 0.8B shape, medians of 2-3 (ready whole -> in
# segments, 2026-12-05), int8 0.82 GB / 6,153 statements (133 kB each) 8.99 -> 4.95 s, f16 1.62 GB / 4,624 (350 kB)
# 9.70 -> 6.48 s, f32 2.62 GB / 4,625 (566 kB) 12.12 -> 13.84 s (slower). Above this many archive bytes per graph
# statement the archive is loaded whole.
MAX_BYTES_PER_STATEMENT = 450_000
MAX_STATEMENTS = 60_000  # a bigger graph is not cut: the cutter's time bounded (0.67 s at this size on the AMD EPYC; the 0.8B shape: 6,143)
MAX_RECORD_BYTES = 1 << 20  # a facts record is a few hundred bytes; a larger file there is not read
FACTS_FORMAT = 3  # part of a record's key: a change of how graphs are cut must not reuse older records
HEAVY_ELEMENTS = 4096  # a variable of this many elements or more is a weight worth reading once
MAX_CROSSING = 8  # a cut where more activations cross is not taken
FACT_TYPES = {"f32", "f16", "f64", "i64", "i32", "i8", "u8", "bool"}

_STRING = re.compile(r"'[^']*'|\"[^\"]*\"")
_GENERIC = re.compile(r"\s*<\s*\w+\s*>")
_IDENTIFIER = re.compile(r"(?<![\w.])[A-Za-z_][A-Za-z0-9_]*")
_AFTER = re.compile(r"\s*(==|=|\()?")  # what follows an identifier: a call, a keyword argument, or neither
_SIGNATURE = re.compile(r"graph\s+(\w+)\s*\(([^)]*)\)\s*->\s*\(([^)]*)\)\s*\{", re.S)
_SYMBOL = re.compile(r"^\s*extension\s+tract_symbol\s+(\w+)\s*;", re.M)
WEIGHT, HEAVY_WEIGHT, LIGHT, ACTIVATION = "weight", "heavy weight", "light", "activation"


class NotCut(Exception):
    """This graph is loaded whole (why: the message)."""


@dataclass
class Segment:
    """One segment: the graph statements it runs (indexes into the body), the archive inputs and outputs it takes and
    gives, the activations it reads from earlier segments and those it gives later ones (statement indexes)."""

    statements: list[int]
    inputs: list[str]
    outputs: list[str]
    crossing_in: list[int]
    crossing_out: list[int]


@dataclass
class Plan:
    """A graph cut into segments: its header (everything before the graph), name, body and the segments."""

    header: str
    name: str
    inputs: list[str]
    outputs: list[str]
    body: list[str]
    defined: list[list[str]]
    segments: list[Segment] = field(default_factory=list)

    def crossing_name(self, index: int) -> str:
        return self.defined[index][0]

    def text(self, k: int, facts: dict[int, str]) -> str:
        """Segment ``k``'s graph.nnef, its crossing inputs declared from ``facts`` (statement index: tract's fact)."""
        segment = self.segments[k]
        declared = [f"    {self.crossing_name(j)} = {external(facts[j])};" for j in segment.crossing_in]
        # the crossing inputs first, in the signature as in the body: tract numbers a graph's inputs in the order
        # their declarations come in the body
        inputs = [self.crossing_name(j) for j in segment.crossing_in] + segment.inputs
        outputs = segment.outputs + [self.crossing_name(j) for j in segment.crossing_out]
        body = "\n".join(declared + ["    " + self.body[i] for i in segment.statements])
        return (f"{self.header}graph {self.name}({', '.join(inputs)}) -> ({', '.join(outputs)})\n{{\n{body}\n}}\n")

    def labels(self, k: int) -> list[str]:
        """The variable labels segment ``k`` reads (one ``<label>.dat`` each)."""
        return [m.group(2) for i in self.segments[k].statements if (m := VARIABLE.search(self.body[i]))]


def external(fact: str) -> str:
    """``tract_core_external(...)`` declaring a tensor of tract's fact ``fact`` (``B,S,1024,f32``)."""
    parts = [p.strip() for p in fact.split(",")]
    dtype = parts[-1].lower()
    if dtype not in FACT_TYPES or any(not re.fullmatch(r"[\w+\-*/ ()]+", d) for d in parts[:-1]):
        raise NotCut(f"a tensor crossing a cut has the fact {fact!r}, which a segment cannot declare")
    return f"tract_core_external(shape = [{', '.join(parts[:-1])}], datum_type = '{dtype}')"


def split_graph(text: str) -> tuple[str, str, list[str], list[str], list[str]]:
    """(header, graph name, inputs, outputs, body statements) of an NNEF graph text."""
    match = _SIGNATURE.search(text)
    if match is None:
        raise NotCut("graph.nnef has no graph declaration this module reads")
    header = text[:match.start()]
    rest = text[match.end():]
    end = rest.rfind("}")
    if end < 0:
        raise NotCut("graph.nnef's graph body does not end")
    statements, current = [], []
    for line in rest[:end].splitlines():
        if not line.strip():
            continue
        current.append(line.strip())
        if line.rstrip().endswith(";"):
            statements.append(" ".join(current))
            current = []
    if current:
        raise NotCut("graph.nnef's graph body ends inside a statement")
    names = lambda group: [x.strip() for x in group.split(",") if x.strip()]  # noqa: E731
    return header, match.group(1), names(match.group(2)), names(match.group(3)), statements


def _defines_and_reads(statement: str) -> tuple[list[str], list[str]]:
    if "=" not in statement:
        raise NotCut(f"a graph statement without an assignment: {statement[:80]}")
    left, right = statement.split("=", 1)
    right = _GENERIC.sub("", _STRING.sub("''", right))  # variable<scalar>(...): neither name is a tensor
    reads = []
    for found in _IDENTIFIER.finditer(right):
        after = _AFTER.match(right, found.end()).group(1)  # by index: a long statement stays linear to read
        if after in ("(", "="):
            continue  # an operation's or a keyword argument's name
        reads.append(found.group(0))
    return _IDENTIFIER.findall(left), reads


def plan(text: str, count: int) -> Plan:
    """``text`` (a graph.nnef) cut into ``count`` segments, or NotCut saying why it cannot be."""
    header, name, inputs, outputs, body = split_graph(text)
    symbols = set(_SYMBOL.findall(header)) | {"true", "false", "inf", "nan"}  # and the literals NNEF names
    body, parsed = _reordered(body)
    defined, producers = [], []
    latest: dict[str, int] = {}
    first: dict[str, int] = {}
    for i, (names, reads) in enumerate(parsed):
        producers.append(sorted({latest[r] for r in reads if r in latest}))
        unknown = [r for r in reads if r not in latest and r not in symbols]
        if unknown:
            raise NotCut(f"statement {i} reads {unknown[0]}, defined by no earlier statement")
        defined.append(names)
        for n in names:
            latest[n] = i
            first.setdefault(n, i)
    if any(x not in first for x in inputs) or any(o not in latest for o in outputs):
        raise NotCut("an input or output of the graph is defined by no statement")
    if len(set(outputs)) != len(outputs):
        raise NotCut("the graph lists an output twice")
    inputs = sorted(inputs, key=first.__getitem__)  # tract numbers a graph's inputs in the order the body declares them
    kinds: list[str] = []
    for i, statement in enumerate(body):
        variable = VARIABLE.search(statement)
        if variable is not None:
            size = 1
            for dim in variable.group(3).split(","):
                size *= int(dim) if dim.strip().isdigit() else 1
            kind = HEAVY_WEIGHT if size >= HEAVY_ELEMENTS else WEIGHT
        elif "tract_core_external" in statement or re.match(r"\w+\s*=\s*external\s*<", statement):
            kind = LIGHT
        else:
            read = {kinds[j] for j in producers[i]}
            if ACTIVATION in read or (HEAVY_WEIGHT in read and LIGHT in read):
                kind = ACTIVATION
            elif HEAVY_WEIGHT in read:
                kind = HEAVY_WEIGHT
            elif LIGHT in read:
                kind = LIGHT
            else:
                kind = WEIGHT
        kinds.append(kind)
    last_read = [-1] * len(body)  # the last statement reading each one
    for i, reads in enumerate(producers):
        for j in reads:
            last_read[j] = i
    final = {o: latest[o] for o in outputs}
    activations = [i for i, k in enumerate(kinds) if k == ACTIVATION]
    if len(activations) < count * 2:
        raise NotCut(f"the graph has {len(activations)} computing statements, too few for {count} segments")

    live = _crossing_counts(activations, last_read)  # live[c]: activations made before statement c, read from c on
    given_names = Counter(name for names in defined for name in names)
    # a crossing tensor is declared by its name in the later segment: a name given twice could read the other one
    ambiguous = [j for j in activations if len(defined[j]) != 1 or given_names[defined[j][0]] > 1]
    blocked = _crossing_counts(ambiguous, last_read)  # cuts that an activation of an ambiguous name would cross
    cuts: list[int] = []
    for k in range(1, count):
        target = activations[len(activations) * k // count]
        window = max(1, len(body) // (4 * count))
        candidates = [c for c in activations if abs(c - target) <= window and (not cuts or c > cuts[-1])
                      and not blocked[c]]
        if not candidates:
            raise NotCut(f"no place to cut the graph into {count} segments")
        # only cuts within MAX_CROSSING compete (a closer cut with more crossing tensors must not hide a farther
        # one within it: 48 layers in 8 segments were refused so); then balance first: a tensor fewer crossing is
        # worth about one layer's shift of the cut (window / 8)
        candidates = [c for c in candidates if live[c] <= MAX_CROSSING]
        if not candidates:
            raise NotCut(f"no place to cut the graph into {count} segments with at most {MAX_CROSSING} tensors "
                         "crossing")
        cuts.append(min(candidates, key=lambda c: live[c] + 8 * abs(c - target) / window))
    bounds = [0, *cuts, len(body)]
    result = Plan(header, name, inputs, outputs, body, defined)
    for k in range(count):
        low, high = bounds[k], bounds[k + 1]
        own_outputs = [o for o in outputs if low <= final[o] < high]
        given = [j for j in activations if low <= j < high and last_read[j] >= high]
        roots = [final[o] for o in own_outputs] + given
        needed, taken = set(), set()
        todo = list(roots)
        while todo:
            i = todo.pop()
            if i in needed or i in taken:
                continue
            if kinds[i] == ACTIVATION and i < low:
                taken.add(i)
                continue
            if kinds[i] == ACTIVATION and i >= high:
                raise NotCut("a segment reads an activation of a later segment")
            needed.add(i)
            todo.extend(producers[i])
        segment_inputs = [x for x in inputs if first[x] in needed]  # body order, as ``inputs``
        result.segments.append(Segment(sorted(needed), segment_inputs, own_outputs, sorted(taken), given))
    produced = {j for p in result.segments for j in p.crossing_out}
    if any(j not in produced for p in result.segments for j in p.crossing_in):
        raise NotCut("a segment reads an activation no earlier segment gives")
    return result


def _crossing_counts(made: list[int], last_read: list[int]) -> list[int]:
    """For each cut c (before statement c), how many statements of ``made`` come before it and are read from c on."""
    counts = [0] * (len(last_read) + 2)
    for j in made:
        if last_read[j] > j:
            counts[j + 1] += 1
            counts[last_read[j] + 1] -= 1
    for c in range(1, len(counts)):
        counts[c] += counts[c - 1]
    return counts


def _reordered(body: list[str]) -> tuple[list[str], list[tuple[list[str], list[str]]]]:
    """``body`` in the order the cuts are planned over (``_hoisted``, then ``_sunk``), with each statement's (names
    given, names read), parsed once. Statements that give or read a name given twice keep their places relative
    to each other in both (moving one could make it read the other value)."""
    parsed = [_defines_and_reads(statement) for statement in body]
    given = Counter(name for names, _ in parsed for name in names)
    twice = {n for n, c in given.items() if c > 1}
    pinned = [bool(twice.intersection(names) or twice.intersection(reads)) for names, reads in parsed]
    for reorder in (_hoisted, _sunk):
        order = reorder(*_links(parsed), pinned)
        body, parsed, pinned = ([seq[i] for i in order] for seq in (body, parsed, pinned))
    return body, parsed


def _links(parsed: list[tuple[list[str], list[str]]]) -> tuple[list[list[int]], list[list[int]]]:
    """Per statement, the statements whose results it reads (distinct, in order) and those that read its own."""
    latest: dict[str, int] = {}
    producers: list[list[int]] = []
    readers: list[list[int]] = [[] for _ in parsed]
    for i, (names, reads) in enumerate(parsed):
        found = sorted({latest[r] for r in reads if r in latest})
        producers.append(found)
        for p in found:
            readers[p].append(i)
        for n in names:
            latest[n] = i
    return producers, readers


def _hoisted(producers: list[list[int]], readers: list[list[int]], pinned: list[bool]) -> list[int]:
    """The order in which each statement that only leads to graph outputs comes right after the last statement it
    reads, not wherever the writer put it: an output re-declared at the graph's end (``output_names``' ``select`` of
    the state a layer computed) then sits beside what it reads, and no cut has that state crossing it. Any other
    statement keeps its place: one read by a later layer (an attention layer's ``unsqueeze`` of the shared mask)
    moved up beside what it reads would cross every cut before its layer (48 layers: 12 such tensors, no cut left
    within MAX_CROSSING). ``pinned`` statements keep their places. Each round sorts by (the position of the last
    statement read, the statement's own position): a valid order, since a statement's key is above each of its
    producers'; a few rounds carry a chain (the state, its condition, its select) to its place."""
    count = len(producers)
    toward_outputs = [False] * count  # read by nothing, or only by such statements: a graph output's chain
    for i in reversed(range(count)):
        toward_outputs[i] = all(toward_outputs[r] for r in readers[i])
    stays = [p or not toward for p, toward in zip(pinned, toward_outputs)]
    position = list(range(count))
    for _ in range(8):
        order = sorted(range(count), key=lambda i: (position[i] - 1 if stays[i] else
                                                    max((position[p] for p in producers[i]), default=-1),
                                                    position[i]))
        moved = [0] * count
        for rank, i in enumerate(order):
            moved[i] = rank
        if moved == position:
            break
        position = moved
    return sorted(range(count), key=position.__getitem__)


def _sunk(producers: list[list[int]], readers: list[list[int]], pinned: list[bool]) -> list[int]:
    """The order in which each statement that reads one statement's result moves down to just before its first
    reader (declarations, which read none, keep their places: tract numbers a graph's inputs in their order):
    torch-to-nnef writes an attention layer's ``unsqueeze`` of the shared mask beside the mask, and left there each
    would cross every cut up to its layer (12 at 48 layers); moved down, it crosses none and the mask alone crosses
    in their place. Only readers of an input read two or more times (a shared tensor) move: a chain of one reader
    each (a shape's dimensions) stays beside its source. ``pinned`` statements keep their places."""
    count = len(producers)
    key = [float(i) for i in range(count)]
    for i in reversed(range(count)):  # readers first (their places final)
        if len(producers[i]) == 1 and not pinned[i] and readers[i]:
            if len(readers[producers[i][0]]) >= 2:  # a shared input: its k readers moved, at most it crosses
                key[i] = min(key[r] for r in readers[i]) - 1e-6 * (count - i)
    return sorted(range(count), key=key.__getitem__)


def segment_count(archive_bytes: int) -> int:
    """How many segments to plan an archive of ``archive_bytes`` in, at most: ``GDN_EXPORT_SEGMENTS`` when set, else
    MAX_SEGMENTS for an archive of MIN_ARCHIVE_BYTES or more, else 1. The graph then lowers it (``segments_for``: one
    per STATEMENTS_PER_SEGMENT statements)."""
    forced = os.environ.get(SEGMENTS_ENV)
    if forced is not None:
        if not forced.strip().isdigit() or int(forced) < 1:
            from gdn_export.errors import GdnExportError

            raise GdnExportError(f"{SEGMENTS_ENV}={forced!r}: expected a whole number of segments, 1 or more")
        return min(int(forced), MAX_SEGMENTS)
    return MAX_SEGMENTS if archive_bytes >= MIN_ARCHIVE_BYTES else 1


def unpack_root(archive_bytes: int) -> str | None:
    """The folder the archive's weights are written to while its segments load: ``GDN_EXPORT_UNPACK_DIR`` when set;
    else ``/dev/shm`` (memory: writing 0.8 GB there took 0.4 s against 1.2 s to /tmp's disk here) when it and the
    machine's available memory hold twice the archive (its files, and tract's copy of them while it reads); else
    the system's temporary folder (None)."""
    forced = os.environ.get(UNPACK_ENV)
    if forced:
        return forced
    shm = Path("/dev/shm")
    try:
        if not (shm.is_dir() and os.access(shm, os.W_OK)) or shutil.disk_usage(shm).free < 2 * archive_bytes:
            return None
        with open("/proc/meminfo") as meminfo:
            available = next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None
    return str(shm) if available >= 2 * archive_bytes else None


def segments_for(statements: int, wanted: int, archive_bytes: int = 0) -> int:
    """``wanted`` lowered to one segment per STATEMENTS_PER_SEGMENT of the graph's ``statements``, plus one per
    SEGMENT_BYTES of archive (unless forced by the env)."""
    if os.environ.get(SEGMENTS_ENV) is not None:
        return wanted
    return max(1, min(wanted, statements // STATEMENTS_PER_SEGMENT + archive_bytes // SEGMENT_BYTES))


def facts_file(text: str, graph: Plan, tract_version: str) -> Path:
    """Where the facts of ``graph``'s crossing tensors are recorded: keyed by the graph text, its cuts and tract."""
    cuts = ",".join(str(p.statements[0]) + ":" + ",".join(map(str, p.crossing_in)) for p in graph.segments)
    key = hashlib.sha256(f"{FACTS_FORMAT}\n{tract_version}\n{cuts}\n{text}".encode()).hexdigest()[:40]
    root = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "gdn_export")
    return root / "segments" / f"{key}.json"


def _read_facts(path: Path) -> dict[int, str] | None:
    try:
        if path.stat().st_size > MAX_RECORD_BYTES:
            return None
        data = json.loads(path.read_text())
        return {int(k): str(v) for k, v in data["facts"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _write_facts(path: Path, facts: dict[int, str]) -> None:
    """Recorded atomically (a temporary file renamed); a folder that cannot be written is skipped: the next load
    plans the segments one after the other again."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as handle:
            json.dump({"facts": {str(k): v for k, v in facts.items()}}, handle)
        os.replace(handle.name, path)
    except OSError:
        pass


class SegmentsRunnable:
    """The segments' plans run in turn, as one runnable: ``run(inputs)`` takes the archive's inputs in their order and
    gives its outputs in theirs (``runtime.run_tract_tensors``'s protocol)."""

    def __init__(self, graph: Plan, runnables: Sequence) -> None:
        self.graph, self.runnables = graph, list(runnables)
        self.position = {name: i for i, name in enumerate(graph.inputs)}
        self.output_position = {name: i for i, name in enumerate(graph.outputs)}

    def run(self, values: Sequence) -> list:
        if len(values) != len(self.graph.inputs):
            raise ValueError(f"{len(values)} inputs where the graph takes {len(self.graph.inputs)}")
        crossing: dict[int, object] = {}
        outputs: list = [None] * len(self.graph.outputs)
        for segment, runnable in zip(self.graph.segments, self.runnables):
            given = [crossing[j] for j in segment.crossing_in] + [values[self.position[x]] for x in segment.inputs]
            result = list(runnable.run(given))
            for name, value in zip(segment.outputs, result):
                outputs[self.output_position[name]] = value
            for j, value in zip(segment.crossing_out, result[len(segment.outputs):]):
                crossing[j] = value
        return outputs


class SegmentedLoad:
    """One load of an archive in segments, told by the integrity pass what it reads (``integrity.check_archive``'s
    ``listener``): the graph (then the cuts are planned and their recorded facts looked up) and each weight once its
    member passed its checks (then every segment whose weights are all written, when the facts are known, starts
    loading and planning in a thread of its own while the pass goes on). ``finished()`` after the pass gives the
    runnable; ``abandoned()`` waits for what was started when the pass failed.

    ``load_one(segment folder, segment)``: tract's model of a segment; ``plan_one(model)``: its runnable;
    ``start(work)`` runs a work in a thread, ``finish(handle)`` waits for its result (its error raised)."""

    def __init__(self, folder: Path, count: int, tract_version: str, load_one: Callable, plan_one: Callable,
                 start: Callable[[Callable], object], finish: Callable[[object], object],
                 archive_bytes: int = 0) -> None:
        self.folder, self.count, self.version, self.archive_bytes = folder, count, tract_version, archive_bytes
        self.load_one, self.plan_one, self.start, self.finish = load_one, plan_one, start, finish
        self.text: str | None = None
        self.plan: Plan | None = None
        self.facts: dict[int, str] | None = None
        self.fault: str | None = None  # why this graph is loaded whole after all
        self.written: set[str] = set()
        self.waiting: list[set[str]] = []
        self.handles: dict[int, object] = {}
        self.lock = threading.Lock()  # handles: added by the pass's thread, waited for by the caller's
        self.stopped = False  # abandoned: no segment starts, no weight is written any more

    def graph(self, text: str) -> None:
        try:
            self._graph(text)
        except Exception as err:  # noqa: BLE001 - never out of the integrity pass: the archive is loaded whole
            self.fault = f"{type(err).__name__}: {err}"

    def _graph(self, text: str) -> None:
        self.text = text
        statements = max(1, text.count(";\n"))
        count = segments_for(statements, self.count, self.archive_bytes)
        if statements > MAX_STATEMENTS:
            raise NotCut(f"the graph has {statements} statements, more than the {MAX_STATEMENTS} a cut is planned for")
        if count < 2 or (os.environ.get(SEGMENTS_ENV) is None
                         and self.archive_bytes / statements > MAX_BYTES_PER_STATEMENT):
            return  # loaded whole: one segment's worth of graph, or weights too heavy for it to pay
        self._plan(text, count)

    def wants_weights(self) -> bool:
        """Whether the pass should still write weights out: until the graph is known, then only for segments."""
        return not self.stopped and self.fault is None and (self.text is None or self.plan is not None)

    def _plan(self, text: str, count: int) -> None:
        try:
            self.plan = plan(text, count)
        except Exception as err:  # noqa: BLE001 - a graph this module cannot read is tract's to judge, whole
            self.fault = str(err) if isinstance(err, NotCut) else f"graph.nnef not cut ({type(err).__name__}: {err})"
            return
        facts = _read_facts(facts_file(text, self.plan, self.version))
        wanted = {j for p in self.plan.segments for j in p.crossing_in}
        self.facts = facts if facts is not None and wanted <= facts.keys() else None
        self.waiting = [set(self.plan.labels(k)) - self.written for k in range(count)]
        self._start_ready()

    def weight(self, label: str) -> None:
        self.written.add(label)
        if self.plan is not None:
            for waiting in self.waiting:
                waiting.discard(label)
            try:
                self._start_ready()
            except Exception as err:  # noqa: BLE001 - as in graph()
                self.fault = f"{type(err).__name__}: {err}"

    def _start_ready(self) -> None:
        if self.facts is None or self.fault is not None or self.stopped:
            return
        for k, waiting in enumerate(self.waiting):
            if not waiting and k not in self.handles:
                try:
                    folder = self._prepare(k)
                    folder.joinpath("graph.nnef").write_text(self.plan.text(k, self.facts))
                except (NotCut, OSError) as err:
                    self.fault = str(err)
                    return
                segment = self.plan.segments[k]
                with self.lock:
                    if self.stopped:
                        return
                    self.handles[k] = self.start(lambda f=folder, p=segment: self.plan_one(self._checked(f, p)))

    def _checked(self, folder: Path, segment: Segment):
        """tract's model of a segment declared from recorded facts, its own crossing outputs' facts checked against
        the record (a record that does not match is removed: the next start records them again)."""
        model = self.load_one(folder, segment)
        given = [str(model.output_fact(i)).strip() for i in range(model.output_count())][len(segment.outputs):]
        if given != [self.facts[j] for j in segment.crossing_out]:
            facts_file(self.text, self.plan, self.version).unlink(missing_ok=True)
            raise NotCut("the recorded facts of a cut are not what tract states: record removed")
        return model

    def _prepare(self, k: int) -> Path:
        """Segment ``k``'s folder: a link to each weight file it reads."""
        folder = self.folder / f"segment{k}"
        folder.mkdir()
        for label in dict.fromkeys(self.plan.labels(k)):
            source, target = self.folder / "weights" / f"{label}.dat", folder / f"{label}.dat"
            if not source.is_file():
                raise NotCut(f"the archive has no weight {label}")
            target.parent.mkdir(parents=True, exist_ok=True)
            os.symlink(source.resolve(), target)
        return folder

    def finished(self) -> SegmentsRunnable | None:
        """The runnable once the pass ended (None: load the archive whole: one segment's worth of graph);
        NotCut (why) when the graph could not be cut or a segment failed."""
        if self.fault is not None:
            self.abandoned()
            raise NotCut(self.fault)
        if self.plan is None:
            return None
        try:
            return self._finished()
        except BaseException:
            self.abandoned()
            raise

    def _finished(self) -> SegmentsRunnable:
        if self.facts is not None:
            missing = [k for k in range(len(self.plan.segments)) if k not in self.handles]
            if missing:
                raise NotCut(f"segment {missing[0]}'s weights are not all in the archive")
            return SegmentsRunnable(self.plan, [self.finish(self.handles[k]) for k in range(len(self.handles))])
        facts = {}
        for k, segment in enumerate(self.plan.segments):  # this graph's first load: a segment's facts before the next
            folder = self._prepare(k)
            folder.joinpath("graph.nnef").write_text(self.plan.text(k, facts))
            model = self.finish(self.start(lambda f=folder, p=segment: self.load_one(f, p)))
            given = [str(model.output_fact(i)) for i in range(model.output_count())][len(segment.outputs):]
            for j, fact in zip(segment.crossing_out, given):
                external(fact)  # NotCut for a fact a segment could not declare
                facts[j] = fact.strip()
            with self.lock:  # planned while the next segment loads
                self.handles[k] = self.start(lambda m=model: self.plan_one(m))
        runnables = [self.finish(self.handles[k]) for k in range(len(self.plan.segments))]
        _write_facts(facts_file(self.text, self.plan, self.version), facts)
        return SegmentsRunnable(self.plan, runnables)

    def abandoned(self) -> None:
        """Stop (no segment starts, no weight is written any more) and wait for the segments started (tract's work
        cannot be stopped), their results or errors dropped."""
        with self.lock:
            self.stopped = True
            handles = list(self.handles.values())
            self.handles.clear()
        for handle in handles:
            try:
                self.finish(handle)
            except Exception:  # noqa: BLE001 - dropped: the load failed or is abandoned anyway
                pass
