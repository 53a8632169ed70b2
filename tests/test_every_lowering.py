"""Every fixture converts under every explicit lowering, and its logits are checked, within a time budget.

Each case converts a fixture (in-process: a subprocess per case cost half the suite in Python and torch imports)
under a time budget enforced by SIGALRM, which reaches the main thread even while tract loads (tract's loads run
in a worker thread, ``runtime.interruptible``): a lowering that never finishes fails its case instead of hanging
the suite. The archive's logits are then checked against the eager reference model (float32 rule), prefill +
decode. ``lowering="auto"`` picks one of these graphs per runtime (tests/test_decisions.py covers which), so the
explicit lowerings are the distinct graphs:
- chunked: what the CLI's default (auto on cpu) writes, which tests/test_hf_families.py and tests/test_fla.py convert
  and check for every fixture; here it is only confirmed from those archives;
- scan (the always-exact fallback): every fixture;
- recurrent (explicit only, never auto's choice): every fixture;
- native: refused by every fixture but one for one of two reasons (K != V, or a variant the fused op does not
  compute): that one and one fixture per reason;
- tract 0.22.1 as a target adds the portable conv (neither fused op exists).
"""

from __future__ import annotations

import json
import signal
import tarfile
from contextlib import contextmanager
from pathlib import Path

import pytest
from helpers import CHECKPOINTS, FIXTURES, by_fixture

from gdn_export.cli import main as cli
from gdn_export.hf.check import check_against_transformers
from gdn_export.pipeline.convert import convert

BUDGET_SECONDS = 300  # a conversion of a fixture takes seconds; one that does not finish in minutes is a defect
# fixture -> None where tract's fused op computes its layers exactly (plain GDN, K = V), else the refusal's reason
NATIVE_CASES = {"fla_gated_deltanet": None, "qwen3_5": "K=16 != V=8", "kimi_linear": "channel-wise decay"}


@contextmanager
def within_budget(what: str):
    def out_of_time(signum, frame):
        raise TimeoutError(f"{what} did not finish in {BUDGET_SECONDS} s")

    previous = signal.signal(signal.SIGALRM, out_of_time)
    signal.setitimer(signal.ITIMER_REAL, BUDGET_SECONDS)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def converted_and_checked(tmp_path: Path, name: str, reference_model, **options) -> tuple[Path, list[dict]]:
    out = tmp_path / f"{name}.nnef.tgz"
    with within_budget(f"converting {name} with {options}"):
        convert(FIXTURES / name, out, check=False, **options)
        check = check_against_transformers(out, reference_model(name), prompt_len=16, decode_steps=4)
    assert check.ok, f"{name} {options}: {check}"
    with tarfile.open(out) as tar:
        return out, json.loads(tar.extractfile("gdn_export.json").read())["decisions"]


def rule_lowerings(decisions: list[dict]) -> set[str]:
    # the gated delta rules' only: not the short conv's, nor the MoE feed-forwards' (tests/test_moe.py)
    return {d["lowering"] for d in decisions if "causal_conv1d" not in d["entry"] and "moe_ffn" not in d["entry"]}


@pytest.mark.parametrize("lowering", ["scan", "recurrent"])
@pytest.mark.parametrize("name", by_fixture(*CHECKPOINTS))
def test_portable_lowering_converts_and_checks(name, lowering, tmp_path, reference_model):
    _, decisions = converted_and_checked(tmp_path, name, reference_model, lowering=lowering)
    assert rule_lowerings(decisions) == {lowering}
    # the short conv keeps its own form (a scan over chunks): lowering= chooses the gated delta rule's lowering only
    assert {d["lowering"] for d in decisions if "causal_conv1d" in d["entry"]} <= {"chunks"}


@pytest.mark.parametrize("name", by_fixture(*CHECKPOINTS))
def test_default_cpu_conversion_is_chunked(name, converted):
    """The archives the family tests check were written with the chunked lowering in every GDN layer."""
    with tarfile.open(converted(name)) as tar:
        decisions = json.loads(tar.extractfile("gdn_export.json").read())["decisions"]
    assert rule_lowerings(decisions) == {"chunked"}


@pytest.mark.parametrize("name", by_fixture(*NATIVE_CASES))
def test_native_converts_where_exact_and_refuses_elsewhere(name, tmp_path, capsys, reference_model):
    if NATIVE_CASES[name] is None:
        _, decisions = converted_and_checked(tmp_path, name, reference_model, lowering="native")
        assert rule_lowerings(decisions) == {"native"}
        return
    out = tmp_path / f"{name}.nnef.tgz"
    with within_budget(f"converting {name} with lowering='native'"):
        status = cli(["convert", str(FIXTURES / name), "-o", str(out), "--lowering", "native", "--no-check"])
    reasons = [line for line in capsys.readouterr().err.splitlines() if line.startswith("gdn-export: error: ")]
    assert status == 1 and len(reasons) == 1
    assert "lowering='native' cannot be exact: " in reasons[0] and NATIVE_CASES[name] in reasons[0]
    assert not out.exists() and not list(tmp_path.iterdir())


@pytest.mark.parametrize("name", by_fixture("qwen3_5", "fla_kda"))
def test_portable_conv_for_tract_before_0_23_5(name, tmp_path, reference_model):
    """tract 0.22.1 has neither fused op: the short conv is plain NNEF (a scan over chunks of tokens), the rule a scan."""
    out, decisions = converted_and_checked(tmp_path, name, reference_model, tract_version="0.22.1", lowering="scan")
    with tarfile.open(out) as tar:
        graph = tar.extractfile("graph.nnef").read().decode()
    assert "tract_transformers_causal_conv1d_update" not in graph
    assert {d["lowering"] for d in decisions if "causal_conv1d" in d["entry"]} == {"chunks"}
