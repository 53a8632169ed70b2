"""Every fixture converts under every explicit lowering, and its logits are checked, within a time budget.

Each case is `gdn-export convert` in a subprocess (so a lowering whose load never finishes fails the test when
the budget runs out instead of hanging the suite), with the CLI's own check: the export against the torch module,
then prefill + decode in tract against transformers' eager model (or, for FLA checkpoints, the eager FLA model).
``lowering="auto"`` picks one of these graphs per runtime (tests/test_decisions.py covers which), so the
explicit lowerings are the distinct graphs; the chunked one is what the CLI's default (auto on cpu) writes, which
tests/test_hf_families.py and tests/test_fla.py convert and check for every fixture, so here it is only confirmed
from those archives. lowering="native" refuses every fixture but one for the same two reasons (K != V, or a
variant the fused op does not compute): one fixture per reason. tract 0.22.1 as a target adds the portable conv.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import by_fixture

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
NAMES = sorted(p.name for p in FIXTURES.iterdir() if (p / "config.json").is_file())
BUDGET_SECONDS = 300  # a conversion of a fixture takes seconds; one that does not finish in minutes is a defect
# fixture -> None where tract's fused op computes its layers exactly (plain GDN, K = V), else the refusal's reason
NATIVE_CASES = {"fla_gated_deltanet": None, "qwen3_5": "K=16 != V=8", "kimi_linear": "channel-wise decay"}


def run_convert(tmp_path: Path, name: str, *options: str) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path / f"{name}.nnef.tgz"
    command = [sys.executable, "-m", "gdn_export.cli", "convert", str(FIXTURES / name), "-o", str(out), *options]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=BUDGET_SECONDS,
                              env={**__import__("os").environ, "RUST_BACKTRACE": "0"})
    except subprocess.TimeoutExpired:
        pytest.fail(f"`gdn-export convert {name} {' '.join(options)}` did not finish in {BUDGET_SECONDS} s")
    return done, out


def gdn_layer_lowerings(report: str) -> list[str]:
    return re.findall(r"^  layer \d+: (\w+) - ", report, re.M)


@pytest.mark.parametrize("lowering", ["scan", "recurrent"])
@pytest.mark.parametrize("name", NAMES)
def test_portable_lowering_converts_and_checks(name, lowering, tmp_path):
    done, out = run_convert(tmp_path, name, "--lowering", lowering)
    assert done.returncode == 0, done.stderr
    layers = gdn_layer_lowerings(done.stdout)
    assert layers and set(layers) == {lowering}, done.stdout
    assert "check vs " in done.stdout and out.is_file()


@pytest.mark.parametrize("name", by_fixture(*NAMES))
def test_default_cpu_conversion_is_chunked(name, converted):
    """The archives the family tests check were written with the chunked lowering in every GDN layer."""
    import tarfile

    with tarfile.open(converted(name)) as tar:
        decisions = json.loads(tar.extractfile("gdn_export.json").read())["decisions"]
    assert {d["lowering"] for d in decisions if "causal_conv1d" not in d["entry"]} == {"chunked"}


@pytest.mark.parametrize("name", list(NATIVE_CASES))
def test_native_converts_where_exact_and_refuses_elsewhere(name, tmp_path):
    done, out = run_convert(tmp_path, name, "--lowering", "native")
    if NATIVE_CASES[name] is None:
        assert done.returncode == 0, done.stderr
        assert set(gdn_layer_lowerings(done.stdout)) == {"native"} and out.is_file()
        return
    reasons = [line for line in done.stderr.splitlines() if line.startswith("gdn-export: error: ")]
    assert done.returncode == 1 and len(reasons) == 1, done.stderr
    assert "lowering='native' cannot be exact: " in reasons[0] and NATIVE_CASES[name] in reasons[0]
    assert not out.exists() and not list(tmp_path.iterdir())


@pytest.mark.parametrize("name", ["qwen3_5", "fla_kda"])
def test_portable_conv_for_tract_before_0_23_5(name, tmp_path):
    """tract 0.22.1 has neither fused op: the short conv is plain NNEF (a depthwise conv), the rule a scan."""
    done, out = run_convert(tmp_path, name, "--tract-version", "0.22.1", "--lowering", "scan")
    assert done.returncode == 0, done.stderr
    import tarfile

    with tarfile.open(out) as tar:
        graph = tar.extractfile("graph.nnef").read().decode()
        decisions = json.loads(tar.extractfile("gdn_export.json").read())["decisions"]
    assert "tract_transformers_causal_conv1d_update" not in graph
    assert {d["lowering"] for d in decisions if "causal_conv1d" in d["entry"]} == {"portable"}
