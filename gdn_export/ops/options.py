"""What an NNEF export asks of every op: one frozen, validated value (``NnefOptions``, the plan every op's
``decide`` reads), carried by the NNEF target. Its fields are the back-end's (``tract_version``, ``runtime``,
``seq_may_vary``: every op reads them) and, in ``ops``, each op's own option values by the op's name, which this
module neither reads nor names: an op with options of its own makes its options object from the plan and validates
them by its own rules (the gated delta rule's: ``ops/gated_delta_rule/nnef/options.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from gdn_export.errors import LoweringError
from gdn_export.targets import NNEF_RUNTIMES, parse_version


def validate_runtime(runtime: str) -> None:
    """Raise LoweringError unless ``runtime`` is one the NNEF back-end's table lists (``targets.NNEF_RUNTIMES``)."""
    if runtime not in NNEF_RUNTIMES:
        raise LoweringError(f"runtime {runtime!r} is not one of {', '.join(NNEF_RUNTIMES)}")


@dataclass(frozen=True, kw_only=True)
class NnefOptions:
    """The export's choices every op's ``decide`` reads.

    ``tract_version``: the target version, ``(0, 23, 9)``; ``runtime``: where tract will run ("any", "cpu",
    "cuda"); ``seq_may_vary``: dynamic axes were declared, so traced extents may be symbolic; ``ops``: each op's
    own option values (keyword arguments of its options class) by the op's name, given by the pipeline.
    """

    tract_version: tuple[int, int, int]
    runtime: str = "any"
    seq_may_vary: bool = False
    ops: Mapping[str, Mapping[str, object]] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        validate_runtime(self.runtime)

    def shared(self) -> dict:
        """The back-end's fields, as keyword arguments (what an op's options class, a subclass, starts from)."""
        return {"tract_version": self.tract_version, "runtime": self.runtime, "seq_may_vary": self.seq_may_vary}


def policy_of(target):
    """The torch-to-nnef target with the ops' state (``gdn_options``, ``gdn_decisions``): one built by the export
    carries them already; a plain ``TractNNEF`` (torch-to-nnef's own export) gets the default options for its
    version, once."""
    if not hasattr(target, "gdn_options"):
        target.gdn_options = NnefOptions(tract_version=parse_version(target.version.to_str()),
                                         seq_may_vary=bool(getattr(target, "dynamic_axes", None)))
        target.gdn_decisions = []
    return target
