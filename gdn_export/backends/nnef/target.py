"""The tract inference target gdn_export hands to torch-to-nnef: offline, and carrying the lowering options.

torch-to-nnef's ``TractNNEF`` downloads a tract command-line binary in its constructor and checks
outputs with it. gdn_export checks with tract's Python bindings instead (``gdn_export.run.runtime``), so
this target never needs the binary: it is built with the download replaced by a stand-in that only
answers the version, and with torch-to-nnef's own I/O check off.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable, Sequence

from torch_to_nnef.inference_target.tract import TractCli, TractNNEF
from torch_to_nnef.utils import SemanticVersion

from gdn_export.backends.compat import patched
from gdn_export.backends.compat.torch_to_nnef import no_download


class _NoBinary(TractCli):
    """Stands where torch-to-nnef expects a downloaded tract binary; running it is an error."""

    def __init__(self, version: SemanticVersion) -> None:  # noqa: D107 - no binary, no path check
        self.tract_path = Path("<tract python bindings>")
        self.__dict__["version"] = version

    def run(self, args, quiet=False):  # pragma: no cover - torch-to-nnef's check_io is off
        raise RuntimeError("gdn_export runs tract through its Python bindings, not a binary")


class _NoBinaryAnswer:
    """The stand-in ``TractCli.download`` answers while a target is built."""

    def __call__(self, version: SemanticVersion) -> _NoBinary:
        return _NoBinary(version)


GraphPass = Callable[[Any], None]  # reads or completes torch-to-nnef's NNEF graph (nnef_tools.model.Graph) in place


class OfflineTractTarget(TractNNEF):
    """``TractNNEF`` without a binary, carrying what the ops' handlers read: ``gdn_options`` (the export's plan,
    ``ops.options.NnefOptions``, given by the pipeline) and ``gdn_decisions`` (one Decision appended per node).
    The back-end never looks inside the plan.

    ``graph_passes``: functions of torch-to-nnef's NNEF graph, run in order once every node is translated and
    before anything is written (torch-to-nnef's own ``post_trace`` hook of its target, after its dynamic axes):
    what the pipeline knows about the whole graph and no handler can say (which weights are only cast, which
    gathers read a block-quantized table) is said there, on the graph's operations, so graph.nnef is written right
    the first time rather than patched as text afterwards."""

    # the versions gdn_export's tests run (torch-to-nnef warns beyond its own list)
    OFFICIAL_SUPPORTED_VERSIONS = [SemanticVersion.from_str(v) for v in ("0.23.9", "0.22.1")]

    def __init__(self, version: str, *, options: Any = None, dynamic_axes: dict | None = None,
                 graph_passes: Sequence[GraphPass] = ()) -> None:
        with patched(no_download(_NoBinaryAnswer())):
            super().__init__(
                version, check_io=False, dynamic_axes=dynamic_axes, dump_identity_properties=False,
                native_gated_delta_op=False,
            )
        self.graph_passes = tuple(graph_passes)
        self.pass_fragments: dict[str, str] = {}  # fragments the graph passes' rewrites use (name -> definition)
        if options is not None:
            self.gdn_options = options
            self.gdn_decisions: list = []

    def post_trace(self, nnef_graph, active_custom_extensions) -> None:
        """torch-to-nnef's hook between translating and writing: its own (dynamic axes), then ``graph_passes``."""
        super().post_trace(nnef_graph, active_custom_extensions)
        for graph_pass in self.graph_passes:
            graph_pass(nnef_graph)

    def specific_fragments(self, model) -> dict[str, str]:
        """torch-to-nnef's fragments of this target, and those the graph passes wrote (``pass_fragments``)."""
        return {**super().specific_fragments(model), **self.pass_fragments}

    def with_dynamic_axes(self, dynamic_axes):
        """torch-to-nnef's copy with other dynamic axes; whether traced extents may be symbolic follows them."""
        copy = super().with_dynamic_axes(dynamic_axes)
        if hasattr(copy, "gdn_options"):
            copy.gdn_options = dataclasses.replace(copy.gdn_options, seq_may_vary=bool(dynamic_axes))
        return copy
