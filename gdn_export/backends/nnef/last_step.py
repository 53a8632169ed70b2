"""The last entry of a symbolic axis (``x[:, -1:]``) written so that tract knows its length is 1.

torch-to-nnef writes ``x[:, -1:]`` over a dynamic axis as ``dyn_slice_begin(x, begin = -1)``, whose begin is clamped
by ``within_bound_index``: ``min(max(0, S - 1), S)``. tract 0.23.9 carries that bound as a symbolic expression of
``min`` and ``max`` into the slice's length and every shape after it, and its optimizer then spends seconds proving
things about it: the 0.8B Qwen3.5-shape int8 archive converted with ``--logits last`` (where the last position is
taken before the head) loaded in 16.3 s against 8.3 s for the same model with every position's logits
(benchmarks/RESULTS.md, "Load time"). Sliced as ``[len - 1, len)`` from the axis's own length, the bounds are plain
``S - 1`` and ``S``, and the length simplifies to 1 (the form the chunked lowering's final state already uses).

Exact wherever the axis is not empty: the pass rewrites only the decoder's slice of the new tokens' axis (at least
one token a call), recognised as the one such slice of an axis with the sequence's traced length.
"""

from __future__ import annotations

from torch_to_nnef.op.fragment import Fragment

LAST_STEP = Fragment(name="gdn_export_last_step", extensions=("tract_registry tract_core",),
                     definition="""fragment gdn_export_last_step(
    input: tensor<scalar>, axis: integer
) -> ( output: tensor<scalar> ) {
    # the last entry of input's axis, sliced as [len - 1, len) so that its length simplifies to 1
    length = squeeze(slice(tract_core_shape_of(input), axes = [0], begin = [axis], end = [axis + 1]), axes = [0]);
    output = slice(input, axes = [axis], begin = [length - 1], end = [length]);
}

""")


def rewrite_last_step(graph, extent: int) -> bool:
    """Rewrite the ``dyn_slice_begin(x, axis = 1, begin = -1, stride = 1)`` of torch-to-nnef's NNEF graph whose axis
    had the sequence's traced ``extent`` (the new tokens of a call: never empty) into ``gdn_export_last_step``, when
    the graph has exactly one (the decoder's last position before the head, ``--logits last``); return whether it
    did. With none or several nothing changes: a slice that might read an empty axis keeps torch-to-nnef's form."""
    candidates = [op for op in graph.operations
                  if op.type == "dyn_slice_begin" and op.attribs.get("axis") == 1 and op.attribs.get("begin") == -1
                  and op.attribs.get("stride", 1) == 1 and op.inputs[0].shape is not None
                  and len(op.inputs[0].shape) > 1 and op.inputs[0].shape[1] == extent]
    if len(candidates) != 1:
        return False
    (op,) = candidates
    op.type = LAST_STEP.name
    op.attribs = {"axis": 1}
    return True
