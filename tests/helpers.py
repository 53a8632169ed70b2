"""What several test modules share (test modules import this and tests/oracle.py, never each other, nor conftest):
the fixture checkpoints, the delta-rule graphs and their operands, and the Engine's one-request-alone reference.
pytest's fixtures themselves (``converted``, ``shared_session``, ``reference_model``) are in tests/conftest.py."""

from __future__ import annotations

import contextlib
import http.client
import io
import json
import os
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import gdn_export
import gdn_export.ops
from gdn_export.run.generation import SamplingParams
from oracle import delta_rule_seq_major

gdn_export.ops.register_custom_ops()  # torch.ops.t2n_extra.*: the graphs below use them

# --- the fixture checkpoints (fixtures/<name>: config.json and safetensors, written by fixtures/make_*.py) -------

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
# fixtures/qwen3_5_trained: trained weights (11M parameters) for the quality figures, tested by test_trained.py; the
# per-fixture sweeps (every lowering, every quantization, ...) cover the small random-weight fixtures only
TRAINED = "qwen3_5_trained"
# the random-weight fixture checkpoints, by folder name: the one list the sweeps parametrize over (or a documented
# part of it)
CHECKPOINTS = sorted(p.name for p in FIXTURES.iterdir() if (p / "config.json").is_file() and p.name != TRAINED)
FLA_CHECKPOINTS = [name for name in CHECKPOINTS if name.startswith("fla_")]  # flash-linear-attention's layouts
# one fixture per family: Qwen3.5 (gated attention), its MoE, Qwen3-Next, Kimi (MLA, KDA), OLMo-Hybrid, LaraMini
# (sliding-window attention), FLA (a windowed softmax layer among GDN layers), FLA KDA (no attention layer)
FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next", "kimi_linear", "olmo_hybrid", "lara_mini", "fla_gated_deltanet",
            "fla_kda")


def archive_members(path) -> dict[str, bytes]:
    """Every file of a .nnef.tgz by name; graph.nnef without its export_date line (the only one that may differ),
    gdn_export.json without the digests it records of graph.nnef and of a nested archive (which cover that line); a
    nested archive (an MTP head's ``mtp.nnef.tgz``) by its own members, as ``mtp.nnef.tgz/<name>``."""
    with tarfile.open(fileobj=path) if isinstance(path, io.BytesIO) else tarfile.open(path) as tar:
        files = {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}
    nested = [name for name in files if name.endswith(".nnef.tgz")]
    for name in nested:
        files.update({f"{name}/{k}": v for k, v in archive_members(io.BytesIO(files.pop(name))).items()})
    graph = files["graph.nnef"].splitlines(keepends=True)
    files["graph.nnef"] = b"".join(line for line in graph if b"export_date" not in line)
    assert len(graph) - 1 == len(files["graph.nnef"].splitlines()), "graph.nnef should have one export_date line"
    if "gdn_export.json" in files:
        metadata = json.loads(files["gdn_export.json"])
        if isinstance(metadata.get("digests"), dict):
            for name in ["graph.nnef", *nested]:
                metadata["digests"].pop(name, None)
            files["gdn_export.json"] = json.dumps(metadata, indent=1).encode()
    return files


def by_fixture(*names):
    """Parameters for tests over fixtures/<name>: grouped by fixture, so that under ``-n 2 --dist loadgroup`` one
    worker converts each fixture, plans its Sessions and loads its reference, and the other never waits for it."""
    return [pytest.param(name, marks=pytest.mark.xdist_group(name), id=name) for name in names]


def slow_unless(fast: bool, *values, id: str | None = None):
    """One parameter set, in the fast tier when ``fast`` and marked ``slow`` otherwise: a parametrized test keeps a
    few representative cases fast (``pytest -m "not slow"``) and runs all of them in the full suite."""
    return pytest.param(*values, marks=() if fast else pytest.mark.slow, id=id)


# --- servers over real sockets (tests/test_serve.py, tests/test_server_bounds.py, tests/test_run_without_torch.py) ---

def wait_for(condition, timeout: float = 30.0, what: str = "the condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def shared_pool(session, workers: int, max_queue: int):
    """A ``WorkerPool`` of ``workers`` threads over ``session``'s tract plan (planned once), ``max_queue`` waiting."""
    from gdn_export.run.generation.executor import WorkerPool
    from gdn_export.run.session import Session

    return WorkerPool(Session.sharing_plan(session), workers=workers, max_queue=max_queue)


@contextlib.contextmanager
def serving(pool, name: str, **options):
    """``pool`` served under ``name`` by uvicorn in a thread of this process, on a free port of 127.0.0.1
    (``make_app``'s ``options``): the base url. (``gdn-export serve`` itself, a process of its own, is driven by
    ``test_gdn_export_serve``.)"""
    import uvicorn

    from gdn_export.run.http import listen, make_app

    sock = listen("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(make_app(pool, name, **options), log_level="error", lifespan="off",
                                           http="h11"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started, 30, "the server to start")
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(15)
        sock.close()
        pool.close()


def raw(base: str, method: str, path: str, body: bytes | str | None = None,
        headers: dict | None = None, timeout: float = 60) -> tuple[int, dict | str]:
    host, port = base.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        connection.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        response = connection.getresponse()
        data = response.read().decode()
    finally:
        connection.close()
    try:
        return response.status, json.loads(data)
    except ValueError:
        return response.status, data


def serve_process(args: list[str], log: Path, *, command: list[str] | None = None,
                  **env: str) -> tuple[subprocess.Popen, str]:
    """``gdn-export serve ARGS --port 0`` as a process of its own (``command``: how to start gdn-export, by default
    ``python -m gdn_export.cli``), its stderr in ``log``, once it listens on the port it prints: (the process, its
    base url). The caller stops it (``terminate()``: SIGTERM) and reads its exit status."""
    command = command or [sys.executable, "-m", "gdn_export.cli"]
    with open(log, "w") as err:
        process = subprocess.Popen([*command, "serve", *args, "--port", "0"], stdout=subprocess.DEVNULL, stderr=err,
                                   stdin=subprocess.DEVNULL, env=dict(os.environ, PYTHONUNBUFFERED="1", **env))
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            assert process.poll() is None, f"gdn-export serve exited with {process.returncode}: {log.read_text()}"
            for line in log.read_text().splitlines():
                if " on http://127.0.0.1:" in line:
                    return process, f"http://127.0.0.1:{int(line.split(' on http://127.0.0.1:')[1].split()[0])}"
            time.sleep(0.02)
        raise AssertionError(f"gdn-export serve did not listen within 90 s: {log.read_text()}")
    except BaseException:
        process.kill()
        process.wait()
        raise


# --- the gated delta rule as a graph ------------------------------------------------------------------------------

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


# the input and output names of GatedDeltaRuleModel / GatedDeltaScanModel, as export() takes them
NAMES = dict(input_names=["q", "k", "v", "g", "beta", "s0"], output_names=["o", "state"])


# --- every variant of the delta-rule family (docs/MATH.md) --------------------------------------------------------

VARIANTS = ["deltanet", "gdn", "kda", "gdn2", "gdn2_neg_eig", "product2", "product3", "product2_no_decay"]


def variant_inputs(variant, batch=2, seq=7, key_heads=2, heads=4, width_k=16, width_v=8, dtype=torch.float32,
                   seed=0):
    """Operands with gates from each variant's real formulas; returns (positional, keyword) arguments."""
    gen = torch.Generator().manual_seed(seed)
    n = int(variant[7]) if variant.startswith("product") else 1
    rand = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    q = rand(batch, seq, key_heads, width_k)
    k = rand(batch, seq * n, key_heads, width_k)
    v = rand(batch, seq * n, heads, width_v)
    s0 = 0.5 * rand(batch, heads, width_k, width_v)
    a_log = torch.linspace(0.02, 12.0, heads).log()
    kwargs = {}
    if variant in ("kda", "gdn2", "gdn2_neg_eig"):
        g = -a_log.exp()[:, None] * F.softplus(rand(batch, seq, heads, width_k) - 1.0)
    elif variant in ("deltanet", "product2_no_decay"):
        g = None
    else:
        g = -a_log.exp() * F.softplus(rand(batch, seq, heads) + 1.0)
    if variant.startswith("gdn2"):
        beta = None
        kwargs["erase"] = torch.sigmoid(rand(batch, seq, heads, width_k)) * (2 if variant.endswith("eig") else 1)
        kwargs["write"] = torch.sigmoid(rand(batch, seq, heads, width_v)).to(dtype)
        kwargs["erase"] = kwargs["erase"].to(dtype)
    else:
        beta = torch.sigmoid(rand(batch, seq * n, heads)) * (2 if variant.startswith("product") else 1)
        beta = beta.to(dtype)
    kwargs["num_householder"] = n
    return [q.to(dtype), k.to(dtype), v.to(dtype), g, beta, s0], kwargs


class Rule(torch.nn.Module):
    def __init__(self, erase=False, num_householder=1):
        super().__init__()
        self.erase, self.num_householder = erase, num_householder

    def forward(self, q, k, v, *rest):
        rest = list(rest)
        g = rest.pop(0) if self.has_g else None
        if self.erase:
            erase, write, s0 = rest
            return gdn_export.gated_delta_rule(q, k, v, g, None, s0, erase=erase, write=write, use_qk_l2norm=True)
        beta, s0 = rest
        return gdn_export.gated_delta_rule(q, k, v, g, beta, s0, num_householder=self.num_householder,
                                          use_qk_l2norm=True)


def graph_inputs(args, kwargs):
    """(module, flat tensor inputs, names) for one variant's operands."""
    q, k, v, g, beta, s0 = args
    module = Rule(erase="erase" in kwargs, num_householder=kwargs["num_householder"])
    module.has_g = g is not None
    tensors, names = [q, k, v], ["q", "k", "v"]
    if g is not None:
        tensors, names = tensors + [g], names + ["g"]
    if "erase" in kwargs:
        tensors, names = tensors + [kwargs["erase"], kwargs["write"]], names + ["erase", "write"]
    else:
        tensors, names = tensors + [beta], names + ["beta"]
    return module, tensors + [s0], names + ["s0"]


def oracle(args, kwargs):
    """The float64 oracle (tests/oracle.py) of one variant's operands: (o, state)."""
    q, k, v, g, beta, s0 = args
    as_np = lambda x: None if x is None else x.float().numpy()  # noqa: E731
    return delta_rule_seq_major(as_np(q), as_np(k), as_np(v), as_np(s0), g=as_np(g), beta=as_np(beta),
                                erase=as_np(kwargs.get("erase")), write=as_np(kwargs.get("write")),
                                num_householder=kwargs["num_householder"], use_qk_l2norm=True)


def assert_close(actual, expected, relative, what):
    error = np.abs(np.asarray(actual, np.float64) - expected).max()
    assert error <= relative * np.abs(expected).max(), f"{what}: max abs error {error:.3e}"


# --- the Engine's reference: a request alone through a batch-1 Session -------------------------------------------

def relative_error(actual: np.ndarray, expected: np.ndarray) -> float:
    """max |a - e| / max(1, |e|): the f32 rule of issue 11 (<= 1e-4)."""
    return float(np.max(np.abs(actual.astype(np.float64) - expected) / np.maximum(1.0, np.abs(expected))))


SESSIONS: dict = {}


def alone(path, prompt: tuple[int, ...], new_tokens: int) -> tuple[list[int], list[np.ndarray]]:
    """Greedy tokens and the logits they were picked from, the request alone through a batch-1 Session (one per
    archive and process, reset for each request: planned once)."""
    from gdn_export.run.session import Session

    session = SESSIONS.setdefault(path, Session(path, prefill_piece=64))
    session.reset()
    rows = [session.prefill(np.asarray([prompt]))[0, -1]]
    tokens = []
    for step in range(new_tokens):
        tokens.append(int(np.argmax(rows[-1])))
        if step + 1 < new_tokens:
            rows.append(session.decode(np.asarray([[tokens[-1]]]))[0, -1])
    return tokens, rows


def engine_greedy_events(engine, prompts, options, new_tokens: int) -> dict[int, list]:
    """Greedy requests (one per prompt, each with its ``options``' speculative config) submitted to ``engine`` at once
    and read side by side, a thread each: request index -> its events."""
    from gdn_export.run.generation import TokenRequest

    streams = [engine.submit(TokenRequest(p, new_tokens, GREEDY, speculative=o)) for p, o in zip(prompts, options)]
    events: dict[int, list] = {}
    readers = [threading.Thread(target=lambda i, s: events.__setitem__(i, list(s)), args=(i, s))
               for i, s in enumerate(streams)]
    for reader in readers:
        reader.start()
    for reader in readers:
        reader.join(timeout=120)
    return events


PROMPT_LENGTHS = (1, 3, 4, 63, 64, 65, 131)
GREEDY = SamplingParams(temperature=0.0)


def prompts_for(path, lengths=PROMPT_LENGTHS, seed=0) -> list[tuple[int, ...]]:
    from gdn_export.run.session import Session

    vocab = Session(path).metadata["vocab_size"]
    rng = np.random.default_rng(seed)
    return [tuple(int(t) for t in rng.integers(0, vocab, n)) for n in lengths]


def rewritten(source: Path, target: Path, metadata: dict | None = None, drop_metadata=(), add: dict | None = None,
              raw_metadata: bytes | None = None) -> Path:
    """A copy of archive ``source`` with gdn_export.json's fields updated (or replaced by ``raw_metadata``) and
    members added (name -> bytes, listed as generation files)."""
    with tarfile.open(source) as tar:
        members = [(m, tar.extractfile(m).read()) for m in tar.getmembers()]
    with tarfile.open(target, "w:gz", compresslevel=1) as out:
        for member, data in members:
            if member.name == "gdn_export.json":
                meta = json.loads(data)
                meta.update(metadata or {})
                for name in drop_metadata:
                    meta.pop(name, None)
                if add:
                    meta["generation_files"] = sorted(set(meta["generation_files"]) | set(add))
                data = raw_metadata if raw_metadata is not None else json.dumps(meta).encode()
                member.size = len(data)
            if add and member.name in add:
                continue
            out.addfile(member, io.BytesIO(data))
        for name, data in (add or {}).items():
            add_member(out, name, data)
    return resealed(target)


def damaged(source: Path, target: Path, member: str) -> Path:
    """A copy of archive ``source`` with the sign bit of ``member``'s first f16 number flipped: a Q4_0 weight's first
    block's scale (every weight of the block negated), an f16 weight's first value."""
    with tarfile.open(source) as tar:
        members = [(m, tar.extractfile(m).read()) for m in tar.getmembers()]
    with tarfile.open(target, "w:gz", compresslevel=1) as out:
        for info, data in members:
            if info.name == member:
                data = bytearray(data)
                data[128 + 1] ^= 0x80  # the first f16 number's high byte
                data = bytes(data)
            info.size = len(data)
            out.addfile(info, io.BytesIO(data))
    return resealed(target)


def resealed(path: Path) -> Path:
    """The archive at ``path`` with the digests of its gdn_export.json recorded anew for its members as they are now
    (what ``pack`` would have recorded): a test's deliberate change is an archive as a conversion would write it,
    not a damaged one (gdn_export.run.integrity refuses those before tract reads them). Rewritten in place."""
    import hashlib

    with tarfile.open(path) as tar:
        members = [(m, tar.extractfile(m).read() if m.isfile() else None) for m in tar.getmembers()]
    digests = {m.name: {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
               for m, data in members if data is not None and m.name != "gdn_export.json"}
    with tarfile.open(path, "w:gz", compresslevel=1) as out:
        for member, data in members:
            if member.name == "gdn_export.json":
                try:
                    meta = json.loads(data)
                except (ValueError, RecursionError):  # a test's deliberately broken metadata stays as it is
                    meta = None
                if isinstance(meta, dict) and "digests" in meta:
                    meta["digests"] = digests
                    data = json.dumps(meta).encode()
                    member.size = len(data)
            out.addfile(member, io.BytesIO(data) if data is not None else None)
    return path


class Zeros(io.RawIOBase):
    """``size`` zero bytes, read by the chunk: a big archive member written without holding it in memory."""

    def __init__(self, size: int) -> None:
        self.left = size

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        n = min(len(buffer), self.left)
        buffer[:n] = bytes(n)
        self.left -= n
        return n


def add_member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))
