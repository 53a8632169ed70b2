"""pytest's fixtures and hooks: the fixture checkpoints converted once per run (``converted``), their Sessions and
reference models, and the ``slow`` tier. What test modules share otherwise is in tests/helpers.py.

Tiers: ``pytest -m "not slow"`` runs the fast tier (the ops against their float64 oracles, decisions, errors, the
run side's API: no fixture is converted); every test that uses ``converted``, ``shared_session`` or
``reference_model`` is marked slow here, and tests that convert in their own code carry ``pytest.mark.slow``."""

import os
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

os.environ.setdefault("RUST_BACKTRACE", "0")  # tract's errors carry a Rust backtrace otherwise
# the references run on the CPU (tract_quirks.TRANSFORMERS_FLA_KERNELS_WITHOUT_GPU): transformers takes flash-linear-attention's gated delta rule whenever that package
# imports, and its Triton kernels need a GPU; a None entry makes `import fla` fail (before transformers' models import)
sys.modules.setdefault("fla", None)

import gdn_export.ops  # noqa: E402

gdn_export.ops.register_custom_ops()  # torch.ops.t2n_extra.*, which tests call directly
from helpers import FIXTURES  # noqa: E402

# the fixtures' models are tiny: a second torch thread only waits (a conversion took 3.2 s on one, 3.8-6.2 s on two),
# and under pytest-xdist (one worker per core) it would contend with the other worker
torch.set_num_threads(1)


# a test using one of these (directly or through another fixture) converts a fixture checkpoint or loads a whole
# reference model: slow. converted_here (test_checkpoints.py), onnx_converted (test_onnx.py) and tied_checkpoint
# (test_tied_head.py) are their modules' own.
CONVERTING_FIXTURES = frozenset({"converted", "shared_session", "reference_model", "converted_here", "onnx_converted",
                                 "tied_checkpoint"})


def pytest_collection_modifyitems(config, items):
    for item in items:
        if CONVERTING_FIXTURES & set(item.fixturenames):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    np.random.seed(0)


# --- fixtures converted once per test run, shared by every module (and every pytest-xdist worker) --------------

@pytest.fixture(scope="session")
def converted(tmp_path_factory):
    """``converted(name, dtype="float32", serving=False) -> Path``: fixtures/<name> converted through the CLI
    (``gdn-export convert ... --no-check``, with ``--serving``: the serving graph) once per test run. Under pytest-xdist the workers share one folder (the parent of their
    base temp folders) and a lock per archive, so each archive is converted once, by whichever worker asks first;
    the CLI writes an archive under its final name only once complete."""
    from filelock import FileLock

    from gdn_export.cli import main as cli

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # every worker's base temp folder lies in this run's folder
        root = root.parent
    folder = root / "converted"
    folder.mkdir(exist_ok=True)
    _plan_converted_archives_once(folder)

    def get(name: str, dtype: str = "float32", serving: bool = False) -> Path:
        out = folder / f"{name}-{dtype}{'-serving' if serving else ''}.nnef.tgz"
        with FileLock(str(out) + ".lock"):
            if not out.is_file():
                status = cli(["convert", str(FIXTURES / name), "-o", str(out), "--dtype", dtype, "--no-check"]
                             + (["--serving"] if serving else []))
                assert status == 0, f"gdn-export convert {name} --dtype {dtype} failed"
        return out

    return get


_PLANS: dict = {}  # (archive name, its file's identity, symbols) -> tract runnable: converted archives only
_PLANS_LOCK = threading.Lock()


def _plan_converted_archives_once(folder: Path) -> None:
    """tract's plan of a ``converted`` archive made once per process and symbols (batch size), whichever Session,
    Engine or WorkerPool asks: planning is most of a small fixture's test (1-12 s a plan against milliseconds a
    call; half of the suite's plans were the same archive planned again for the same batch by the next test). A plan
    is what tract makes of the file, deterministically, and a runnable spawns a fresh state for every call
    (``Session.sharing_plan`` and the Engine share one likewise), so a test sees the same tract model either way.
    Only archives in ``converted``'s folder, which no test writes to (a test that changes an archive works on a copy
    of its own, planned afresh); keyed by the file's identity too (inode, size, times), so a changed file would be
    planned again; errors are not kept. Loads with ``expect_outputs`` (the exporter's own check) are not kept."""
    import gdn_export.run.runtime as runtime
    import gdn_export.run.session as session

    if getattr(runtime.load_tract_model, "plans_converted_once", False):
        return
    load = runtime.load_tract_model

    def load_tract_model(path, symbols=None, **options):
        path = Path(path)
        if options or path.parent != folder or not path.is_file():
            return load(path, symbols, **options)
        stat = path.stat()
        key = (path.name, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns,
               tuple(sorted((symbols or {}).items())))
        with _PLANS_LOCK:
            if key not in _PLANS:
                _PLANS[key] = load(path, symbols)
            return _PLANS[key]

    load_tract_model.plans_converted_once = True
    # session.py imported the function by name; the Engine and the MTP drafter import it from runtime when they plan
    runtime.load_tract_model = session.load_tract_model = load_tract_model


@pytest.fixture(scope="session")
def shared_session(converted):
    """``shared_session(name, dtype="float32", batch=1) -> Session`` over ``converted(name, dtype)``, one per process
    and batch size (a Session plans tract's model for the batch size of its first call: one per batch plans once).
    Its states are the caller's: start with ``reset()`` (``session_logits`` and the checks do)."""
    from gdn_export.run.session import Session

    cache = {}

    def get(name: str, dtype: str = "float32", batch: int = 1):
        if (name, dtype, batch) not in cache:
            cache[name, dtype, batch] = Session(converted(name, dtype))
        return cache[name, dtype, batch]

    return get


@pytest.fixture(scope="session")
def reference_model():
    """``reference_model(name, dtype="float32")``: the eager model of fixtures/<name> (transformers', or the family's
    reference for FLA checkpoints), loaded once per process; in float16 through ``copy_in_dtype``. Read only."""
    from gdn_export.hf.checkpoint import copy_in_dtype, load_model, read_config
    from gdn_export.hf.families import family_for

    cache = {}

    def get(name: str, dtype: str = "float32"):
        if (name, dtype) not in cache:
            if dtype == "float32":
                config = read_config(FIXTURES / name)
                cache[name, dtype] = load_model(FIXTURES / name, family_for(config["model_type"]), config)
            else:
                cache[name, dtype] = copy_in_dtype(get(name), getattr(torch, dtype))
        return cache[name, dtype]

    return get
