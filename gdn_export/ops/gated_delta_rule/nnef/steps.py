"""Per-token ``tract_core_scan`` steps, shared by the scan and recurrent lowerings and the chunked form's tail.

Operands come from ``layout.step_operands`` (f32, time first, value heads split into key head x group).
Per token (docs/MATH.md, the generalized recurrence), for each of the n sub-steps j:
    S = S * exp(g)                      (once, before the first sub-step; per channel or per head)
    S = S + k_j * (u_j - sum_K(S * e_j))
    y = sum_K(S * q)                    (after the last sub-step)
which is the recurrence of ``gdn_export.ops.gated_delta_rule.naive.delta_rule_recurrence``.

The elementwise step works on the state ``[1, B, H, K, V]``: one axis per value head (key-head operands are
tiled over their G value heads first, a per-token vector against the per-token passes over the ``[K, V]``
state), and the scan's own size-1 axis kept in front, on the state and on every operand (nothing is squeezed in
the body). Measured in tract 0.23.9 (one thread, H=16, K=V=128, one token, benchmarks/bench_decode_floor.py):
the earlier ``[B, Hk, G, K, V]`` state (G = 1 a middle unit axis) ran the step 2x slower than ``[B, H, K, V]``,
and a leading unit axis costs ~10% at most; it is what lets the callers write the state output as a squeeze, a
node of its own that keeps the output's name (a scan inside a fragment is named after the fragment's inner
nodes; output_names.py would otherwise re-declare it with a select, a copy of the state per call).
The step is elementwise arithmetic and reductions only: tract 0.23.9 never finishes loading one scan body that squeezes its inputs and multiplies
the state by a matrix (``tract_quirks.SCAN_SQUEEZE_MATMUL_NEVER_LOADS``, canary in tests/test_tract_quirks.py; not every
such body: a rank-5 recurrent body loaded in 20 ms in a probe, so the rule here is conservative).
"""

from __future__ import annotations

from nnef_tools.model import Tensor as NTensor
from torch_to_nnef.op.fragment import Fragment

from gdn_export.backends.nnef import scan as nnef_scan

from gdn_export.ops.gated_delta_rule.nnef.layout import StepOperands
from gdn_export.backends.nnef.builder import NnefBuilder


def body_lines(num_householder: int, decay: str | None, update) -> list[str]:
    """The recurrence over one token, as NNEF lines; ``update(state, j)`` writes sub-step j's new state."""
    lines, state = [], "s_prev"
    if decay is not None:
        lines.append(f"    s_decayed = s_prev * {decay};")
        state = "s_decayed"
    for j in range(num_householder):
        nxt = "s_t" if j == num_householder - 1 else f"s_{j}"
        lines.append(f"    {nxt} = {update(state, j)};")
        state = nxt
    return lines


def step_names(num_householder: int, has_decay: bool) -> list[str]:
    """The step's per-token inputs: ``q``, then ``k{j}, e{j}, u{j}`` per sub-step, then ``decay``."""
    names = ["q"] + [f"{name}{j}" for j in range(num_householder) for name in ("k", "e", "u")]
    return names + (["decay"] if has_decay else [])


def scan_fragment(kind: str, num_householder: int, has_decay: bool, prologue: list[str], update, readout: str,
                  y_axis: int, decay: str = "decay") -> Fragment:
    """A step body and the ``tract_core_scan`` that runs it over T, for one variant.

    The body's inputs are ``q_t``, ``k{j}_t``, ``e{j}_t``, ``u{j}_t`` (and ``decay_t``); ``prologue`` may
    bind shorter names, ``decay`` names the decay factor the body multiplies the state by. The final state is
    the scan's first output: tract reports both outputs of a node under the first one's name, so the state
    (a graph output in the scan lowering and the chunked tail) keeps its own name without a renaming copy,
    while y always goes through another op.
    """
    suffix = f"{kind}_n{num_householder}{'_decay' if has_decay else ''}"
    inputs = step_names(num_householder, has_decay)
    body = prologue + body_lines(num_householder, decay if has_decay else None, update) + [f"    y_t = {readout};"]
    return nnef_scan.scan_fragment(
        f"gdn_export_{kind}_scan_{suffix}", f"gdn_export_{kind}_step_{suffix}", body,
        params=[*inputs, "s_init"], results=("s_final", "y"),
        scan=[(f"{name}_t", name, 0, 1) for name in inputs], state=[("s_prev", "s_init", "s_t")],
        output=[("s_t", "last", 0, 1), ("y_t", "full", y_axis, 1)],
    )


def elementwise_step_fragment(kind: str, num_householder: int, has_decay: bool) -> Fragment:
    """The elementwise per-token step (the fastest per-token form measured) over ``step_inputs``; ``kind`` names
    the fragment (the chunked lowering's tail runs it under its own name)."""
    return scan_fragment(
        kind, num_householder, has_decay, prologue=[],
        update=lambda s, j: f"{s} + k{j}_t * (u{j}_t - sum_reduce({s} * e{j}_t, axes = [3]))",
        readout="sum_reduce(s_t * q_t, axes = [3])", y_axis=3, decay="decay_t",
    )


def step_inputs(b: NnefBuilder, ops: StepOperands, groups: int, prepare=lambda x: x) -> list[NTensor]:
    """The elementwise step's scan inputs, one axis per value head: q and keys/erases as columns
    ``[T, B, H, K, 1]``, writes as rows ``[.., 1, V]``, the decay factor ``exp(g)`` as a column; ``prepare`` is
    applied to each operand first. Its state is ``[1, B, H, K, V]`` (``step_state``), its y ``[1, B, H, T, V]``."""
    column = lambda x: b.unsqueeze(per_value_head(b, prepare(x), groups), [4])  # noqa: E731
    row = lambda x: b.unsqueeze(per_value_head(b, prepare(x), groups), [3])  # noqa: E731
    inputs = [column(ops.q)]
    for key, erase, write in zip(ops.keys, ops.erases, ops.writes):
        inputs += [column(key), column(erase), row(write)]
    if ops.log_decay is not None:
        inputs.append(b.unary("exp", column(ops.log_decay)))
    return inputs


def per_value_head(b: NnefBuilder, x: NTensor, groups: int) -> NTensor:
    """``[T, B, Hk, G|1, X]`` -> ``[T, B, H, X]``: a key-head operand tiled over its G value heads."""
    if x.shape[3] != groups:
        x = b.op("tile", x, shape=(*x.shape[:3], groups, x.shape[4]), attribs={"repeats": [1, 1, 1, groups, 1]})
    return b.merge_axes(x, 2, 2)
