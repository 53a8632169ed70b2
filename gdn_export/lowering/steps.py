"""Per-token ``tract_core_scan`` steps, shared by the scan and recurrent lowerings and the chunked form's tail.

Operands come from ``layout.step_operands`` (f32, time first, value heads split into key head x group).
Per token (docs/MATH.md, the generalized recurrence), for each of the n sub-steps j:
    S = S * exp(g)                      (once, before the first sub-step; per channel or per head)
    S = S + k_j * (u_j - sum_K(S * e_j))
    y = sum_K(S * q)                    (after the last sub-step)
which is the recurrence of ``gdn_export.ops.naive.delta_rule_recurrence``.

The elementwise step squeezes the scan axis and works on a rank-5 state ``[B, Hk, G, K, V]`` (keeping the
size-1 scan axis on the state measured 4x slower in tract 0.23.9). It is elementwise arithmetic and
reductions only: tract 0.23.9 never finishes loading one scan body that squeezes its inputs and multiplies
the state by a matrix (``tract_quirks.SCAN_SQUEEZE_MATMUL_NEVER_LOADS``, canary in tests/test_tract_quirks.py; not every
such body: a rank-5 recurrent body loaded in 20 ms in a probe, so the rule here is conservative).
"""

from __future__ import annotations

from nnef_tools.model import Tensor as NTensor
from torch_to_nnef.op.fragment import Fragment

from gdn_export.lowering.layout import StepOperands
from gdn_export.lowering.nnef_builder import NnefBuilder


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
    bind shorter names, ``decay`` names the decay factor the body multiplies the state by.
    """
    suffix = f"{kind}_n{num_householder}{'_decay' if has_decay else ''}"
    step, scan = f"gdn_export_{kind}_step_{suffix}", f"gdn_export_{kind}_scan_{suffix}"
    inputs = step_names(num_householder, has_decay)
    body = prologue + body_lines(num_householder, decay if has_decay else None, update) + [f"    y_t = {readout};"]
    definition = f"""fragment {step}(
    s_prev: tensor<scalar>, {", ".join(f"{name}_t: tensor<scalar>" for name in inputs)}
) -> ( s_t: tensor<scalar>, y_t: tensor<scalar> ) {{
{chr(10).join(body)}
}}

fragment {scan}(
    {", ".join(f"{name}: tensor<scalar>" for name in inputs)}, s_init: tensor<scalar>
) -> ( y: tensor<scalar>, s_final: tensor<scalar> ) {{
    (y, s_final) = tract_core_scan(
        body = "{step}",
        scan = [{", ".join(f'("{name}_t", {name}, 0, 1)' for name in inputs)}],
        full = [],
        state = [("s_prev", s_init, "s_t")],
        output = [("y_t", "full", {y_axis}, 1), ("s_t", "last", 0, 1)],
        skip = 0
    );
}}

"""
    return Fragment(name=scan, extensions=("tract_registry tract_core",), definition=definition)


def elementwise_step_fragment(kind: str, num_householder: int, has_decay: bool) -> Fragment:
    """The elementwise per-token step (the fastest per-token form measured) over ``step_inputs``; ``kind`` names
    the fragment (the chunked lowering's tail runs it under its own name)."""
    return scan_fragment(
        kind, num_householder, has_decay,
        prologue=[f"    {name} = squeeze({name}_t, axes = [0]);" for name in step_names(num_householder, has_decay)],
        update=lambda s, j: f"{s} + k{j} * (u{j} - sum_reduce({s} * e{j}, axes = [3]))",
        readout="sum_reduce(s_t * q, axes = [3])",
        y_axis=3,
    )


def step_inputs(b: NnefBuilder, ops: StepOperands, prepare=lambda x: x) -> list[NTensor]:
    """The elementwise step's scan inputs: q and keys/erases as columns ``[T, B, Hk, G|1, K, 1]``, writes as rows
    ``[.., 1, V]``, the decay factor ``exp(g)`` as a column; ``prepare`` is applied to each operand first."""
    column = lambda x: b.unsqueeze(prepare(x), [5])  # noqa: E731
    row = lambda x: b.unsqueeze(prepare(x), [4])  # noqa: E731
    inputs = [column(ops.q)]
    for key, erase, write in zip(ops.keys, ops.erases, ops.writes):
        inputs += [column(key), column(erase), row(write)]
    if ops.log_decay is not None:
        inputs.append(b.unary("exp", column(ops.log_decay)))
    return inputs
