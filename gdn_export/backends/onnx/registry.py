"""How an op reaches the ONNX back-end: the symbolic making its placeholder node registered by ``t2n_extra``
qualname (the ``symbolic`` decorator), the rewriter of that node registered by placeholder op type (the
``placeholder`` decorator), the back-end's options, and the onnxruntime version its contrib ops were verified
on. The back-end names no op: each op's ``onnx`` module registers itself when imported
(``gdn_export/ops/onnx_handlers.py`` imports them all).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from gdn_export.backends.registration import registrar
from gdn_export.errors import LoweringError
from gdn_export.targets import ONNX_RUNTIMES

RUNTIMES = ONNX_RUNTIMES
# what lowering= may ask of the ONNX target: "native" is the contrib op (the fused form, as for NNEF)
LOWERINGS = ("auto", "native", "scan")
CONTRIB_VERIFIED = (1, 32)  # onnxruntime version whose contrib ops were measured exact (older ones: not used)

# placeholder op type -> rewrite(builder, node, attrs, context): the node replaced in the builder's list, its Decision
# recorded in context.decisions (ops.protocol.record)
PLACEHOLDERS: dict[str, Callable] = {}
# t2n_extra qualname -> placeholder op type whose rewriter reads the operands' traced shapes (context.traced)
SHAPED: dict[str, str] = {}
# t2n_extra qualname -> TorchScript symbolic making its placeholder node (symbolics.register gives them to torch)
SYMBOLICS: dict[str, Callable] = {}


@dataclass(frozen=True)
class OnnxOptions:
    """The ONNX export's plan, the one value every op's ONNX ``decide(node, plan)`` reads (``ops.protocol``):
    ``runtime`` (RUNTIMES) and ``lowering`` (LOWERINGS), validated once here (LoweringError)."""

    runtime: str = "any"
    lowering: str = "auto"

    def __post_init__(self) -> None:
        validate(self.runtime, self.lowering)


@dataclass
class Context:
    """What a rewriter reads besides its node: the export's plan, and per placeholder op type the traced
    operand shapes of each call still to be rewritten, in graph order (``next_traced`` takes them); and where it
    records its node's Decision."""

    options: OnnxOptions
    traced: dict[str, list] = field(default_factory=dict)
    decisions: list = field(default_factory=list)  # one per placeholder rewritten, in graph order (ops.protocol.record)

    def next_traced(self, op_type: str) -> list | None:
        calls = self.traced.get(op_type)
        return calls.pop(0) if calls else None


def placeholder(op_type: str, shaped: tuple[str, ...] = ()) -> Callable[[Callable], Callable]:
    """Register the decorated function as the rewriter of ``gdn_export::<op_type>`` placeholders; ``shaped``: the
    t2n_extra ops whose calls' operand shapes it reads."""

    def register(rewriter: Callable) -> Callable:
        if PLACEHOLDERS.get(op_type, rewriter) is not rewriter:
            raise TypeError(f"placeholder {op_type} has two rewriters: {PLACEHOLDERS[op_type].__module__} and "
                            f"{rewriter.__module__}")
        PLACEHOLDERS[op_type] = rewriter
        SHAPED.update({qualname: op_type for qualname in shaped})
        return rewriter

    return register


def symbolic(qualname: str) -> Callable[[Callable], Callable]:
    """Register the decorated function as the TorchScript symbolic of ``qualname`` (a ``t2n_extra::`` op): it
    makes the op's placeholder node (``symbolics.placeholder_node``)."""

    return registrar(SYMBOLICS, qualname, f"{qualname} has two ONNX symbolics")


def validate(runtime: str, lowering: str) -> None:
    if runtime not in RUNTIMES:
        raise LoweringError(f"runtime {runtime!r} is not one of {', '.join(RUNTIMES)} for an ONNX export")
    if lowering not in LOWERINGS:
        raise LoweringError(f"lowering {lowering!r} is not available for an ONNX export (one of "
                            f"{', '.join(LOWERINGS)}; 'native' is onnxruntime's contrib op)")


def ort_version() -> tuple[int, int] | None:
    try:
        import onnxruntime
    except ImportError:
        return None
    try:
        major, minor = onnxruntime.__version__.split(".")[:2]
        return int(major), int(minor)
    except ValueError:
        return None
