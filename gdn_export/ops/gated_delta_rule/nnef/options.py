"""The gated delta rule's options of an NNEF export, and their rules: which lowering (``LOWERINGS``), an f16 core
for the fused op (``CORE_DTYPES``), the chunked lowering's tokens per chunk. ``GatedDeltaRuleOptions`` is what the
op's ``decide`` and lowerings read: the NNEF plan's shared fields (``ops.options.NnefOptions``) and these, made from
the plan by ``of``. The checks are light (no torch, no numpy): the CLI's ``--help`` and the export validate with
them before anything is traced (``validate_options``), with the same message wherever the values come from."""

from __future__ import annotations

from dataclasses import dataclass

from gdn_export.errors import LoweringError
from gdn_export.ops.gated_delta_rule.nnef.chunking import chunk_size_error
from gdn_export.ops.gated_delta_rule.nnef.registry import LOWERINGS
from gdn_export.ops.options import NnefOptions, validate_runtime

CORE_DTYPES = (None, "float16")
OP = "gated_delta_rule"  # the key of this op's values in ``NnefOptions.ops``


TAIL_CHUNKS = (1, 2, 4, 8, 16)  # tokens per short chunk of the chunked tail; 1: token by token


def validate(lowering: str = "auto", core_dtype: str | None = None, chunk_size: int | None = None,
             tail_chunk: int | None = None) -> None:
    """Raise LoweringError naming the first of the gated delta rule's options that is not valid."""
    if lowering not in LOWERINGS:
        raise LoweringError(f"lowering {lowering!r} is not one of {', '.join(LOWERINGS)}")
    if core_dtype not in CORE_DTYPES:
        raise LoweringError(f"core_dtype {core_dtype!r}: only 'float16' (or None, the model's own) is supported")
    if chunk_size is not None and chunk_size_error(chunk_size):
        raise LoweringError(f"chunk_size: {chunk_size_error(chunk_size)}")
    if tail_chunk is not None and (isinstance(tail_chunk, bool) or tail_chunk not in TAIL_CHUNKS):
        raise LoweringError(f"tail_chunk {tail_chunk!r} is not one of {', '.join(map(str, TAIL_CHUNKS))} "
                            "(1: the tail token by token)")


def validate_options(lowering: str = "auto", runtime: str = "any", core_dtype: str | None = None,
                     chunk_size: int | None = None, tail_chunk: int | None = None) -> None:
    """Raise LoweringError naming the first option of an NNEF export of this op that is not valid (before any work
    is done, the tract version not known yet), in the order the API lists them."""
    validate(lowering=lowering)
    validate_runtime(runtime)
    validate(core_dtype=core_dtype, chunk_size=chunk_size, tail_chunk=tail_chunk)


@dataclass(frozen=True, kw_only=True)
class GatedDeltaRuleOptions(NnefOptions):
    """The gated delta rule's options beside the plan's shared fields.

    ``lowering``: one of LOWERINGS ("auto": the first exact lowering in the runtime's order, policy.py);
    ``core_dtype``: "float16" lets the fused op take f16 q/k/v/beta whatever the model's dtype (an explicit,
    inexact choice); ``chunk_size``: tokens per chunk of the chunked form (None: the body's default,
    chunked/outer.py); ``tail_chunk``: tokens per short chunk of the chunked form's tail, the last S mod C
    tokens (None: chunking.TAIL_CHUNK, 4; 1: token by token, the form before short chunks: fewer scan bodies for
    tract to load, a verify call of k tokens slower).
    """

    lowering: str = "auto"
    core_dtype: str | None = None
    chunk_size: int | None = None
    tail_chunk: int | None = None

    def __post_init__(self) -> None:
        validate_options(lowering=self.lowering, runtime=self.runtime, core_dtype=self.core_dtype,
                         chunk_size=self.chunk_size, tail_chunk=self.tail_chunk)

    @classmethod
    def of(cls, plan: NnefOptions) -> GatedDeltaRuleOptions:
        """This op's options in the export's plan (its defaults for a plan that gives it none)."""
        return cls(**plan.shared(), **plan.ops.get(OP, {}))

    @property
    def core_f16(self) -> bool:
        """The caller asked for an f16 core (the fused op rounds q/k/v/beta to float16)."""
        return self.core_dtype == "float16"
