"""What an NNEF export asks of the ops: one frozen, validated value (the plan every op's ``decide`` reads), carried
by the NNEF target. Its fields are the back-end's (``tract_version``, ``runtime``, ``seq_may_vary``: every op
reads them) and the gated delta rule's (``lowering``, ``core_dtype``, ``chunk_size``: validated by its own rules,
``ops/gated_delta_rule/nnef/options.py``).

Validation lives here only: ``LoweringOptions(...)`` (or ``validate_options``, before the tract version is
known) raises LoweringError with the same message wherever the values come from (``export()``, the CLI, a
plain torch-to-nnef target).
"""

from __future__ import annotations

from dataclasses import dataclass

from gdn_export.errors import LoweringError
from gdn_export.ops.gated_delta_rule.nnef import options as gated_delta_rule
from gdn_export.targets import NNEF_RUNTIMES, parse_version


def validate_options(lowering: str = "auto", runtime: str = "any", core_dtype: str | None = None,
                     chunk_size: int | None = None) -> None:
    """Raise LoweringError naming the first export option that is not valid (before any work is done): the
    runtime by the NNEF back-end's table (``targets.NNEF_RUNTIMES``), the gated delta rule's options by its own
    rules (``ops/gated_delta_rule/nnef/options.py``), in the order the API lists them."""
    gated_delta_rule.validate(lowering=lowering)
    if runtime not in NNEF_RUNTIMES:
        raise LoweringError(f"runtime {runtime!r} is not one of {', '.join(NNEF_RUNTIMES)}")
    gated_delta_rule.validate(core_dtype=core_dtype, chunk_size=chunk_size)


@dataclass(frozen=True, kw_only=True)
class LoweringOptions:
    """The export's choices the emitter and the lowerings read.

    ``lowering``: one of LOWERINGS ("auto": the first exact lowering in the runtime's order, policy.py);
    ``runtime``: where tract will run ("any", "cpu", "cuda"); ``core_dtype``: "float16" lets the fused op take
    f16 q/k/v/beta whatever the model's dtype (an explicit, inexact choice); ``chunk_size``: tokens per chunk
    of the chunked form (None: the body's default, chunked/outer.py); ``tract_version``: the target version,
    ``(0, 23, 9)``; ``seq_may_vary``: dynamic axes were declared, so traced extents may be symbolic.
    """

    tract_version: tuple[int, int, int]
    lowering: str = "auto"
    runtime: str = "any"
    core_dtype: str | None = None
    chunk_size: int | None = None
    seq_may_vary: bool = False

    def __post_init__(self) -> None:
        validate_options(lowering=self.lowering, runtime=self.runtime, core_dtype=self.core_dtype,
                         chunk_size=self.chunk_size)

    @property
    def core_f16(self) -> bool:
        """The caller asked for an f16 core (the fused op rounds q/k/v/beta to float16)."""
        return self.core_dtype == "float16"


def policy_of(target):
    """The torch-to-nnef target with the ops' state (``gdn_options``, ``gdn_decisions``): one built by the export
    carries them already; a plain ``TractNNEF`` (torch-to-nnef's own export) gets the default options for its
    version, once."""
    if not hasattr(target, "gdn_options"):
        target.gdn_options = LoweringOptions(tract_version=parse_version(target.version.to_str()),
                                             seq_may_vary=bool(getattr(target, "dynamic_axes", None)))
        target.gdn_decisions = []
    return target
