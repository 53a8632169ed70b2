"""The tract inference target gdn_export hands to torch-to-nnef: offline, and carrying the lowering policy.

torch-to-nnef's ``TractNNEF`` downloads a tract command-line binary in its constructor and checks
outputs with it. gdn_export checks with tract's Python bindings instead (``gdn_export.runtime``), so
this target never needs the binary: it is built with the download replaced by a stand-in that only
answers the version, and with torch-to-nnef's own I/O check off.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from torch_to_nnef.inference_target.tract import TractCli, TractNNEF
from torch_to_nnef.utils import SemanticVersion

from gdn_export.lowering.capabilities import parse_version

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
    # the versions gdn_export's tests run (torch-to-nnef warns beyond its own list)
    OFFICIAL_SUPPORTED_VERSIONS = [SemanticVersion.from_str(v) for v in ("0.23.9", "0.22.1")]

    """``TractNNEF`` without a binary, plus what the emitter needs to decide.

    Attributes read by the emitter: ``gdn_lowering`` (one of emitter.LOWERINGS), ``gdn_runtime`` (where
    tract will run: "any", "cpu", "cuda"), ``gdn_core_dtype`` ("float16" to run the fused op on f16
    operands whatever the model's dtype, an explicit, inexact choice), ``gdn_chunk_size`` (tokens per chunk of
    the chunked form, None: each body's default), ``tract_version`` (a tuple),
    ``seq_may_vary`` (dynamic axes were declared, so traced extents may be symbolic) and
    ``gdn_decisions`` (the emitter appends one Decision per node).
    """

    def __init__(self, version: str, *, lowering: str = "auto", dynamic_axes: dict | None = None,
                 runtime: str = "any", core_dtype: str | None = None, chunk_size: int | None = None) -> None:
        with _CONSTRUCTION_LOCK, _no_download():
            super().__init__(
                version, check_io=False, dynamic_axes=dynamic_axes, dump_identity_properties=False,
                native_gated_delta_op=False,
            )
        self.gdn_lowering = lowering
        self.tract_version = parse_version(version)
        self.gdn_decisions: list = []
        self.gdn_runtime = runtime
        self.gdn_core_dtype = core_dtype
        self.gdn_chunk_size = chunk_size

    @property
    def seq_may_vary(self) -> bool:
        return bool(self.dynamic_axes)


def policy_of(target) -> OfflineTractTarget:
    """The emitter's view of any TractNNEF: a plain one (torch-to-nnef's own export) gets the defaults."""
    if isinstance(target, OfflineTractTarget):
        return target
    if not hasattr(target, "gdn_decisions"):
        target.gdn_lowering = "auto"
        target.gdn_runtime = "any"
        target.gdn_core_dtype = None
        target.gdn_chunk_size = None
        target.tract_version = parse_version(target.version.to_str())
        target.gdn_decisions = []
        target.seq_may_vary = bool(getattr(target, "dynamic_axes", None))
    return target
