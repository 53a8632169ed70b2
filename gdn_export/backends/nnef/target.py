"""The tract inference target gdn_export hands to torch-to-nnef: offline, and carrying the lowering options.

torch-to-nnef's ``TractNNEF`` downloads a tract command-line binary in its constructor and checks
outputs with it. gdn_export checks with tract's Python bindings instead (``gdn_export.run.runtime``), so
this target never needs the binary: it is built with the download replaced by a stand-in that only
answers the version, and with torch-to-nnef's own I/O check off.
"""

from __future__ import annotations

import dataclasses
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from torch_to_nnef.inference_target.tract import TractCli, TractNNEF
from torch_to_nnef.utils import SemanticVersion

from gdn_export.ops.gated_delta_rule.capabilities import parse_version
from gdn_export.ops.options import LoweringOptions

_CONSTRUCTION_LOCK = threading.Lock()


class _NoBinary(TractCli):
    """Stands where torch-to-nnef expects a downloaded tract binary; running it is an error."""

    def __init__(self, version: SemanticVersion) -> None:  # noqa: D107 - no binary, no path check
        self.tract_path = Path("<tract python bindings>")
        self.__dict__["version"] = version

    def run(self, args, quiet=False):  # pragma: no cover - torch-to-nnef's check_io is off
        raise RuntimeError("gdn_export runs tract through its Python bindings, not a binary")


@contextmanager
def _no_download() -> Iterator[None]:
    original = TractCli.__dict__["download"]
    TractCli.download = classmethod(lambda cls, version: _NoBinary(version))
    try:
        yield
    finally:
        TractCli.download = original


class OfflineTractTarget(TractNNEF):
    """``TractNNEF`` without a binary, carrying what the emitter reads: ``gdn_options`` (a
    ``LoweringOptions``, validated here: LoweringError on a bad value) and ``gdn_decisions`` (the emitter
    appends one Decision per node)."""

    # the versions gdn_export's tests run (torch-to-nnef warns beyond its own list)
    OFFICIAL_SUPPORTED_VERSIONS = [SemanticVersion.from_str(v) for v in ("0.23.9", "0.22.1")]

    def __init__(self, version: str, *, lowering: str = "auto", dynamic_axes: dict | None = None,
                 runtime: str = "any", core_dtype: str | None = None, chunk_size: int | None = None) -> None:
        with _CONSTRUCTION_LOCK, _no_download():
            super().__init__(
                version, check_io=False, dynamic_axes=dynamic_axes, dump_identity_properties=False,
                native_gated_delta_op=False,
            )
        self.gdn_options = LoweringOptions(tract_version=parse_version(version), lowering=lowering, runtime=runtime,
                                           core_dtype=core_dtype, chunk_size=chunk_size,
                                           seq_may_vary=bool(self.dynamic_axes))
        self.gdn_decisions: list = []

    def with_dynamic_axes(self, dynamic_axes):
        """torch-to-nnef's copy with other dynamic axes; whether traced extents may be symbolic follows them."""
        copy = super().with_dynamic_axes(dynamic_axes)
        copy.gdn_options = dataclasses.replace(copy.gdn_options, seq_may_vary=bool(dynamic_axes))
        return copy


def policy_of(target) -> TractNNEF:
    """The target with the emitter's state (``gdn_options``, ``gdn_decisions``): a plain TractNNEF
    (torch-to-nnef's own export) gets the default options for its version, once."""
    if not hasattr(target, "gdn_options"):
        target.gdn_options = LoweringOptions(tract_version=parse_version(target.version.to_str()),
                                             seq_may_vary=bool(getattr(target, "dynamic_axes", None)))
        target.gdn_decisions = []
    return target
