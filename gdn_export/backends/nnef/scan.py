"""The one writer of ``tract_core_scan`` fragments: a step body and the fragment that runs it with tract's scan.

tract's scan is written as two NNEF fragments: the step (``state`` in, ``state`` and outputs out: the body the
scan calls each iteration) and the fragment that calls ``tract_core_scan`` over its inputs. Every scan an op's
lowering writes (the gated delta rule's per-token steps and chunk bodies, the short conv's chunks) is this text,
its op-specific part the body lines. tract's contract (docs/TRACT.md): ``scan`` entries are
``(body input, outer tensor, axis, chunk)``, ``full`` ones ``(body input, outer tensor)`` read whole every step,
``state`` ones ``(body input, initial value, body output)``, ``output`` ones ``(body output, "last" | "full",
axis, chunk)``.

The step's parameters are the states' inputs, then the scanned inputs, then the full ones; its results the
states' next values, then the outputs no state carries: the order tract binds them by name is free, this one is
the order every lowering wrote before (archives byte-identical).
"""

from __future__ import annotations

from typing import Sequence

from torch_to_nnef.op.fragment import Fragment

EXTENSIONS = ("tract_registry tract_core",)


def _tensors(names: Sequence[str]) -> str:
    return ", ".join(f"{name}: tensor<scalar>" for name in names)


def scan_fragment(
    name: str,
    step: str,
    body: Sequence[str],
    *,
    params: Sequence[str],
    results: Sequence[str],
    scan: Sequence[tuple[str, str, int, int]],
    state: Sequence[tuple[str, str, str]],
    output: Sequence[tuple[str, str, int, int]],
    full: Sequence[tuple[str, str]] = (),
    bound: Sequence[str] | None = None,
    before: Sequence[str] = (),
    after: Sequence[str] = (),
) -> Fragment:
    """The fragment ``name(params) -> (results)`` running the step fragment ``step`` (its lines ``body``, indented)
    with ``tract_core_scan``. The scan's outputs are bound to ``bound`` (default: ``results``); ``before`` and
    ``after`` are lines of ``name`` around the scan (where its outputs are cut or renamed)."""
    carried = [nxt for _, _, nxt in state]
    step_params = [prev for prev, _, _ in state] + [inner for inner, *_ in scan] + [inner for inner, _ in full]
    step_results = carried + [inner for inner, *_ in output if inner not in carried]
    entries = {
        "scan": [f'("{i}", {x}, {axis}, {chunk})' for i, x, axis, chunk in scan],
        "full": [f'("{i}", {x})' for i, x in full],
        "state": [f'("{i}", {x}, "{nxt}")' for i, x, nxt in state],
        "output": [f'("{o}", "{kind}", {axis}, {chunk})' for o, kind, axis, chunk in output],
    }
    outer = [*before, f"    ({', '.join(bound or results)}) = tract_core_scan(", f'        body = "{step}",',
             *(f"        {key} = [{', '.join(items)}]," for key, items in entries.items()),
             "        skip = 0", "    );", *after]
    definition = f"""fragment {step}(
    {_tensors(step_params)}
) -> ( {_tensors(step_results)} ) {{
{chr(10).join(body)}
}}

fragment {name}(
    {_tensors(params)}
) -> ( {_tensors(results)} ) {{
{chr(10).join(outer)}
}}

"""
    return Fragment(name=name, extensions=EXTENSIONS, definition=definition)
