"""Running exported models in tract through its Python bindings (no tract binary anywhere)."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from pathlib import Path
from typing import Callable, Sequence, TypeVar

import numpy as np

from gdn_export.errors import GdnExportError, TractRuntimeError

T, F = TypeVar("T"), TypeVar("F")


def tract_version() -> str:
    """The version of the installed tract Python bindings, e.g. '0.23.9'."""
    import tract

    return tract.version()


def load_tract_model(path: str | os.PathLike, symbols: dict[str, int] | None = None, *,
                     expect_outputs: Sequence[str] | None = None, whole: bool = False):
    """Load a ``.nnef.tgz`` (or folder) with the transformers extension and make it runnable; ``symbols`` fixes
    symbolic sizes first (e.g. ``{"B": 1}``), so tract plans with them known. With ``expect_outputs``, tract must
    report exactly those output names (TractRuntimeError otherwise): the graph is then loaded whole, as a program
    embedding the archive loads it. A big archive is otherwise planned in segments side by side
    (``run/segments.py``); ``whole``: never (a caller that reads the model's facts, ``gdn-export info``)."""
    import tract

    path = Path(path)
    if not path.exists():
        raise TractRuntimeError(f"no model at {path}")
    if path.is_file():  # what tract would read checked first (members, headers, digests, states): ArchiveError
        from gdn_export.run.segments import segment_count
        from gdn_export.run.reading import read_metadata
        from gdn_export.run.integrity import check_archive

        count = segment_count(path.stat().st_size)
        if count > 1 and expect_outputs is None and not whole:
            runnable = _load_in_segments(path, count, symbols, expect_outputs)
            if runnable is not None:
                return runnable
        interruptible(lambda: check_archive(path, read_metadata(path)))

    def load():
        model = tract.nnef().with_tract_transformers().load(str(path))
        if expect_outputs is not None:
            reported = [model.output_name(i) for i in range(model.output_count())]
            if reported != list(expect_outputs):
                wrong = [(e, r) for e, r in zip(expect_outputs, reported) if e != r]
                raise TractRuntimeError(f"tract reports outputs {reported} where {list(expect_outputs)} were "
                                        f"declared (declared, reported: {wrong})")
        if symbols:
            model.transform(tract.SetSymbols(symbols))
        return model.into_runnable()

    try:
        with _planning_allocator():
            return interruptible(load)
    except TractRuntimeError:
        raise
    except Exception as err:  # tract raises plain Exceptions with its own message
        from gdn_export.run.archive import damaged_message, gzip_damage

        damaged = gzip_damage(path) if path.is_file() else None
        if damaged is not None:  # say what is wrong with the file rather than what tract tripped on
            raise TractRuntimeError(damaged_message(path, damaged)) from None
        raise TractRuntimeError(f"tract could not load {path}: {tract_fault(str(err))}") from err


def _load_in_segments(path: Path, count: int, symbols: dict[str, int] | None, expect_outputs: Sequence[str] | None):
    """The archive at ``path`` planned as ``count`` segments side by side (``run/segments.py``), or None when its graph
    is better loaded whole (one segment's worth of statements); a graph that cannot be cut, or a segment tract refuses,
    is loaded whole after a one-line warning. A damaged archive raises (ArchiveError) as a whole load would."""
    import shutil
    import sys
    import tempfile

    import tract

    from gdn_export.run import segments
    from gdn_export.run.integrity import check_archive
    from gdn_export.run.reading import read_metadata

    from gdn_export.run.integrity import UnpackError

    def load_one(segment_folder: Path, segment: segments.Segment):
        return tract.nnef().with_tract_transformers().load(str(segment_folder))

    def plan_one(model):
        if symbols:
            model.transform(tract.SetSymbols(symbols))
        return model.into_runnable()

    folder = None
    try:
        folder = Path(tempfile.mkdtemp(prefix="gdn_export_segments_", dir=segments.unpack_root(path.stat().st_size)))
        (folder / "weights").mkdir()
        loading = segments.SegmentedLoad(folder, count, tract_version(), load_one, plan_one, _started,
                                         lambda handle: _joined(*handle)[0], path.stat().st_size)
        with _planning_allocator():
            try:  # the segments start loading as the pass writes their weights out
                interruptible(lambda: check_archive(path, read_metadata(path), unpack_to=folder, listener=loading))
            except BaseException as err:
                loading.abandoned()
                if not isinstance(err, UnpackError):
                    raise
                loading.fault = str(err)  # not the archive's fault: the pass runs again, whole, below
            return loading.finished()
    except (TractRuntimeError, KeyboardInterrupt, SystemExit):
        raise
    except Exception as err:  # NotCut, UnpackError, an unusable temporary folder, tract's plain Exceptions
        if isinstance(err, GdnExportError):  # a damaged archive (ArchiveError): the whole load's error too
            raise
        print(f"gdn_export: {path.name} loaded whole, not in {count} segments: {tract_fault(str(err))}",
              file=sys.stderr, flush=True)
        return None
    finally:
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)


def tract_fault(message: str) -> str:
    """What tract's load error says went wrong: its deepest cause (tract's first line reads ``opening file "X"``
    whatever the fault), a parse error as the graph's line; the message's first line when it has no causes."""
    import re

    lines = message.split("Stack backtrace:")[0].splitlines()
    causes = [m.group(1).strip() for line in lines if (m := re.match(r"\s*\d+: (.*\S)", line))]
    if not causes:
        return lines[0].strip() if lines else message
    deepest = causes[-1]
    parse = re.match(r"at line (\d+), in (\w+)", deepest)
    if parse:
        return f"graph.nnef does not parse at line {parse.group(1)} (tract expected a {parse.group(2)})"
    return deepest


def interruptible(work: Callable[[], T]) -> T:
    """``work()``, run so that Ctrl-C and SIGTERM still reach the main thread while it lasts.

    Python runs signal handlers only between bytecodes of the main thread, so a long call into tract (a model's
    load and optimization takes seconds to minutes) would hold Ctrl-C back until it returns. In the main thread
    the call runs in a daemon worker (tract releases the GIL) while the main thread waits in short slices; an
    interruption then raises at once and the caller's cleanup runs. Elsewhere it is a plain call."""
    if threading.current_thread() is not threading.main_thread():
        return work()
    return _joined(*_started(work))[0]


def alongside(background: Callable[[], T], foreground: Callable[[], F]) -> tuple[tuple[T, float], F]:
    """((background's result, its seconds), foreground's result): ``background`` runs in a daemon thread (tract
    releases the GIL) while ``foreground`` runs in this one; an error of either is raised here once both ended,
    and Ctrl-C still reaches this thread while it waits."""
    worker, outcome = _started(background)
    try:
        result = foreground()
    finally:
        while worker.is_alive():
            worker.join(0.1)
    return _joined(worker, outcome), result


def _started(work: Callable[[], T]) -> tuple[threading.Thread, dict]:
    """A daemon thread running ``work``, and the dict that receives its value (or error) and its seconds."""
    outcome: dict[str, object] = {}

    def run() -> None:
        start = time.perf_counter()
        try:
            outcome["value"] = work()
        except BaseException as err:  # handed to the caller's thread
            outcome["error"] = err
        outcome["seconds"] = time.perf_counter() - start

    worker = threading.Thread(target=run, name="gdn_export-tract", daemon=True)
    worker.start()
    return worker, outcome


def _joined(worker: threading.Thread, outcome: dict) -> tuple:
    """(value, seconds) of a ``_started`` thread once it ended (waiting in short slices); its error raised."""
    while worker.is_alive():
        worker.join(0.1)
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    return outcome["value"], outcome["seconds"]


def run_tract(path_or_runnable, inputs: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Run a model in tract on positional inputs (graph-input order); return its outputs as numpy arrays."""
    runnable = (
        load_tract_model(path_or_runnable) if isinstance(path_or_runnable, (str, os.PathLike)) else path_or_runnable
    )
    return [o.to_numpy() for o in run_tract_tensors(runnable, inputs)]


def run_tract_tensors(runnable, inputs: Sequence) -> list:
    """Run a runnable on positional inputs, numpy arrays or tract tensors (passed as they are, not copied out and
    back); return its outputs as tract tensors."""
    import tract

    values = [x if isinstance(x, tract.Tensor) else np.ascontiguousarray(np.asarray(x)) for x in inputs]
    try:
        return list(runnable.run(values))
    except Exception as err:
        raise TractRuntimeError(f"tract failed to run the model: {err}") from err


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
_allocator: str | None = None  # the mode set last: "steady", "lean", or None (glibc's own)
_allocator_lock = threading.Lock()
_planning = 0  # loads in progress


@contextlib.contextmanager
def _planning_allocator():
    """Load and plan under ``lean_allocator``, then go back to the mode set before (a Session's ``steady``).

    tract reads every weight of the archive, then packs it for its matmuls and drops the read copy. Under
    ``steady_allocator`` those read copies (a few MiB each, below its 32 MiB mmap threshold) come from the heap
    and their memory stays with the process once freed: planning the 0.8B shape in f16 left 2.98 GB peak and
    2.83 GB resident against 2.07 and 1.92 GB under ``lean_allocator`` (1.31 GB of weights; benchmarks/RESULTS.md).
    The steady mode matters for the per-call buffers after planning, not for planning itself. Only under
    ``steady_allocator`` (glibc's own adaptive mode, once changed, cannot be restored)."""
    global _planning
    with _allocator_lock:
        steady = _allocator == "steady"
        if steady:
            _planning += 1
            _mallopt((M_MMAP_THRESHOLD, 1024 * 1024),)
    try:
        yield
    finally:
        if steady:
            with _allocator_lock:
                _planning -= 1
                if _planning == 0 and _allocator == "steady":
                    steady_allocator()


def steady_allocator() -> bool:
    """Keep glibc from unmapping tract's big per-call buffers between calls; return whether it applied.

    glibc serves big allocations with fresh mmaps and trims freed memory at the top of the heap; which one
    happens depends on the process's history (its thresholds adapt), so a model's buffers can end up mapped
    and page-faulted anew on every call. Measured here (benchmarks/bench_decode_floor.py): a decode step of the
    fused op 3.6 ms against 2.2 ms, of the chunked graph 2.05 against 0.58 ms, from one run to the next. Fixing
    the mmap threshold at its maximum (32 MiB) and never trimming removes that mode. The cost: freed memory
    stays with the process (its resident size keeps its peak), except what tract frees while planning
    (``load_tract_model`` plans under ``lean_allocator``). Process-wide; a no-op off glibc."""
    global _allocator
    _allocator = "steady"
    return _mallopt((M_MMAP_THRESHOLD, 32 * 1024 * 1024), (M_TRIM_THRESHOLD, 2**31 - 1))


def lean_allocator() -> bool:
    """Give memory back as soon as it is freed: every allocation of 1 MiB or more its own mmap, unmapped on free;
    return whether it applied. For a conversion, which allocates and frees copies of each weight in turn
    (torch-to-nnef's trace clones the tensors an op reads): with glibc's adaptive threshold those copies came from
    the heap and stayed resident, 1.6 GB held through the trace of a 3.5 GB checkpoint against 0.4 GB with this
    (benchmarks/RESULTS.md). Process-wide; a no-op off glibc; ``steady_allocator`` (a Session's) undoes it."""
    global _allocator
    _allocator = "lean"
    return _mallopt((M_MMAP_THRESHOLD, 1024 * 1024),)


def _mallopt(*settings: tuple[int, int]) -> bool:
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):
        return False
    return all(bool(mallopt(option, value)) for option, value in settings)
