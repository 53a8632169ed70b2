import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

os.environ.setdefault("RUST_BACKTRACE", "0")  # tract's errors carry a Rust backtrace otherwise
# the references run on the CPU: transformers takes flash-linear-attention's gated delta rule whenever that package
# imports, and its Triton kernels need a GPU; a None entry makes `import fla` fail (before transformers' models import)
sys.modules.setdefault("fla", None)

import gdn_export  # noqa: E402,F401  (registers the ops)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
# fixtures/qwen3_5_trained: trained weights (11M parameters) for the quality figures, tested by test_trained.py; the
# per-fixture sweeps (every lowering, every quantization, ...) cover the small random-weight fixtures only
TRAINED = "qwen3_5_trained"


def swept_fixtures() -> list[str]:
    """The names of the random-weight fixtures (folders of fixtures/ with a config.json), sorted."""
    return sorted(p.name for p in FIXTURES.iterdir() if (p / "config.json").is_file() and p.name != TRAINED)

# the fixtures' models are tiny: a second torch thread only waits (a conversion took 3.2 s on one, 3.8-6.2 s on two),
# and under pytest-xdist (one worker per core) it would contend with the other worker
torch.set_num_threads(1)


def pytest_configure(config):
    config.addinivalue_line("markers", "xdist_group(name): tests run by one pytest-xdist worker under --dist "
                                       "loadgroup (those of one fixture: its conversions and Sessions made once)")


def by_fixture(*names):
    """Parameters for tests over fixtures/<name>: grouped by fixture, so that under ``-n 2 --dist loadgroup`` one
    worker converts each fixture, plans its Sessions and loads its reference, and the other never waits for it."""
    return [pytest.param(name, marks=pytest.mark.xdist_group(name), id=name) for name in names]


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

    def get(name: str, dtype: str = "float32", serving: bool = False) -> Path:
        out = folder / f"{name}-{dtype}{'-serving' if serving else ''}.nnef.tgz"
        with FileLock(str(out) + ".lock"):
            if not out.is_file():
                status = cli(["convert", str(FIXTURES / name), "-o", str(out), "--dtype", dtype, "--no-check"]
                             + (["--serving"] if serving else []))
                assert status == 0, f"gdn-export convert {name} --dtype {dtype} failed"
        return out

    return get


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


def make_rule_inputs(batch, seq, key_heads, heads, width_k, width_v, dtype=torch.float32, seed=0):
    """Seq-major operands of gated_delta_rule with gates from the real formulas (docs/MATH.md)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seq, key_heads, width_k, generator=gen)
    k = torch.randn(batch, seq, key_heads, width_k, generator=gen)
    v = torch.randn(batch, seq, heads, width_v, generator=gen)
    a_log = torch.linspace(0.02, 12.0, heads).log()
    g = -a_log.exp() * torch.nn.functional.softplus(torch.randn(batch, seq, heads, generator=gen) + 1.0)
    beta = torch.rand(batch, seq, heads, generator=gen)
    s0 = 0.5 * torch.randn(batch, heads, width_k, width_v, generator=gen)
    return q.to(dtype), k.to(dtype), v.to(dtype), g, beta.to(dtype), s0


class GatedDeltaRuleModel(torch.nn.Module):
    """The gated delta rule as a graph: inputs q, k, v, g, beta, s0; outputs o, state."""

    def __init__(self, use_qk_l2norm=True, scale=None):
        super().__init__()
        self.use_qk_l2norm, self.scale = use_qk_l2norm, scale

    def forward(self, q, k, v, g, beta, s0):
        return gdn_export.gated_delta_rule(q, k, v, g, beta, s0, scale=self.scale, use_qk_l2norm=self.use_qk_l2norm)


class GatedDeltaScanModel(torch.nn.Module):
    def forward(self, q, k, v, g, beta, s0):
        return torch.ops.t2n_extra.gated_delta_scan(q, k, v, g, beta, s0)


NAMES = dict(input_names=["q", "k", "v", "g", "beta", "s0"], output_names=["o", "state"])
