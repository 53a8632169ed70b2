"""One gated delta-rule node as an entry point (``gdn_export.ops.nnef_handlers``) hands it to the emitter."""

from __future__ import annotations

from dataclasses import dataclass

from nnef_tools.model import Tensor as NTensor


@dataclass
class GdnNode:
    """One delta-rule node as an entry point hands it over.

    ``use_qk_l2norm`` and ``scale`` are the node's own semantics: the node normalizes q/k itself and
    multiplies q by ``scale`` (None: q is used as given, already normalized and scaled by the caller).
    g is None (no decay), per head or per key channel; beta is None when erase/write gates are given.
    """

    name: str
    q: NTensor
    k: NTensor
    v: NTensor
    g: NTensor | None
    beta: NTensor | None
    s0: NTensor
    y: NTensor  # output tensors, created by the entry point with their final names and dtypes
    s_final: NTensor
    head_major: bool
    use_qk_l2norm: bool
    scale: float | None
    entry: str  # which entry point produced the node, for the report
    erase: NTensor | None = None
    write: NTensor | None = None
    num_householder: int = 1

    def operands(self) -> dict[str, NTensor]:
        given = {"q": self.q, "k": self.k, "v": self.v, "g": self.g, "beta": self.beta, "erase": self.erase,
                 "write": self.write, "s0": self.s0}
        return {name: t for name, t in given.items() if t is not None}
