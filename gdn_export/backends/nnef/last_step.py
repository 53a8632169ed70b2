"""The last entry of the new tokens' axis (``x[:, -1:]``, ``--logits last``) written so that tract loads it fast.

torch-to-nnef writes ``x[:, -1:]`` over a dynamic axis as ``dyn_slice_begin(x, begin = -1)``, a slice whose begin
``within_bound_index`` clamps to ``min(max(0, S - 1), S)``. tract 0.23.9's optimizer then pushes that slice up
through every position-wise op of the model (its ``PushSliceUp`` pass, which computes the axes mapping of each scan
body it meets): the 0.8B Qwen3.5-shape int8 archive converted with ``--logits last`` loaded in 16.3 s against 8.3 s
with every position's logits; sliced as ``[S - 1, S)`` instead it still took 15.3 s (benchmarks/RESULTS.md, "Load
time"). A gather at index ``S - 1`` (one row of the hidden state, copied once per call) is no slice: 8.45 s.

Exact wherever the axis is not empty: the pass rewrites only the decoder's slice of the new tokens' axis (at least
one token a call), recognised as the one such slice of an axis with the sequence's traced length.
"""

from __future__ import annotations

from torch_to_nnef.op.fragment import Fragment

LAST_STEP = Fragment(name="gdn_export_last_step", extensions=("tract_registry tract_core",),
                     definition="""fragment gdn_export_last_step(
    input: tensor<scalar>, axis: integer
) -> ( output: tensor<scalar> ) {
    # the last entry of input's axis, gathered at index len - 1: its length is 1, and no slice is left for tract's
    # optimizer to push up through the model
    length = squeeze(slice(tract_core_shape_of(input), axes = [0], begin = [axis], end = [axis + 1]), axes = [0]);
    output = tract_core_gather(input, unsqueeze(tract_core_cast(length - 1, to = 'i64'), axes = [0]), axis = axis);
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
