"""torch-to-nnef behaviour gdn_export corrects at export time (each listed in ``gdn_export.tract_quirks``).

Node order and names (torch-to-nnef 0.24.12). ``TorchModuleIRGraph._filter_nodes_not_in_trace_between_inputs_and_
outputs`` drops unused nodes and re-sorts the kept ones by their index in the traced graph; nodes created after the
trace (no index) get -1 and keep the iteration order of a ``set``, which follows ``hash()`` of their names:
``PYTHONHASHSEED`` decides the NNEF names torch-to-nnef numbers (``c26`` or ``c57``), so two conversions of one
checkpoint differed. ``apply_name_to_tensor_in_module`` names a tensor held under several names (a tied head) by
``list(names)[0]`` of a set, and the custom fragments and extensions come from sets too. Replaced: the pruning, as a
walk back from the outputs over each node's producers (torch-to-nnef's loops test every op against every kept
node: quadratic), the nodes without index sorted by name; a tensor's names iterated sorted (``hf.lm_head.weight``
before ``hf.model.embed_tokens.weight``); fragments and extension registries sorted (symbols keep their declared
order, which tract's symbolic expressions follow). The same archive from every process.

Shape inference. ``TorchModuleIRGraph._infer_missing_shapes_from_ops_outputs`` drops the ops it has shaped from its
work list with ``op not in ops_to_rm`` on a list, which compares ops field by field (dataclass ``__eq__``):
quadratic in the number of ops, a third of a 20-layer model's conversion (py-spy). Replaced by the same loop with
ops compared by identity. It also re-runs every op at every level of the module tree (39 runs of each gated
delta-rule node, in eager torch, in a 4-layer model), and at a module's level once more after each of its
submodule calls is merged: quadratic in the number of layers (24 layers: ~20 s of a 70 s conversion). A re-run
can change the graph at an outer level (an input found constant there: its output becomes a constant, a cast of a
weight dropped), so it is kept wherever an input changed since the op last ran, and skipped where nothing it reads
changed (``_inputs_unchanged``: the same input nodes, holding the same data objects and flags, and the same output
nodes): such a re-run recomputes and stores exactly what the last one stored. gdn_export's own ops run once.
"""

from __future__ import annotations

import threading

_INSTALLED = threading.Lock()
OWN_OPS = "t2n_extra::"  # the custom ops of gdn_export.ops


def install() -> None:
    """Apply the corrections (idempotent)."""
    import torch_to_nnef.export as t2n_export
    from torch_to_nnef.tensor.updater import ModTensorUpdater
    from torch_to_nnef.torch_graph.ir_graph import TorchModuleIRGraph

    with _INSTALLED:
        method = TorchModuleIRGraph._filter_nodes_not_in_trace_between_inputs_and_outputs
        if getattr(method, "gdn_export_patch", False):
            return
        TorchModuleIRGraph._filter_nodes_not_in_trace_between_inputs_and_outputs = _filter_nodes
        ModTensorUpdater.__init__ = _sorted_names(ModTensorUpdater.__init__)
        TorchModuleIRGraph._infer_missing_shapes_from_ops_outputs = _infer_missing_shapes
        t2n_export._build_nnef_graph_and_fragments = _sorted_fragments(t2n_export._build_nnef_graph_and_fragments)


class _SortedSet(set):
    """A set iterated in sorted order."""

    def __iter__(self):
        return iter(sorted(set.__iter__(self)))


def _sorted_names(original):
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        for key, names in list(self.id_to_names.items()):
            self.id_to_names[key] = _SortedSet(names)

    return __init__


def _sorted_fragments(original):
    def build(*args, **kwargs):
        graph, extensions, fragments = original(*args, **kwargs)
        # registries sorted; symbols kept in their declared order (tract orders symbolic expressions by it)
        symbols = [e for e in extensions if str(e).startswith("tract_symbol")]
        others = sorted(e for e in extensions if not str(e).startswith("tract_symbol"))
        return graph, others + symbols, dict(sorted(fragments.items()))

    return build


def _filter_nodes(self):
    """torch-to-nnef's pruning of the nodes no output (or input) depends on, as a walk back from them over each
    node's producers (its own loops test every op against every kept node: quadratic); kept nodes in their traced
    order, nodes made after the trace by name."""
    from torch_to_nnef.utils import ReactiveNamedItemDict

    before = {hash(node): index for index, node in enumerate(self.data_nodes)}
    producers: dict[str, list] = {}
    for op in self.op_nodes:
        for out in op.outputs:
            producers.setdefault(out.name, []).append((op, out))
    used = set(self.outputs) | set(self.inputs)
    used_ops: set[int] = set()
    frontier = list(used)

    def visit(items) -> None:
        for item in items:
            if item not in used:
                used.add(item)
                frontier.append(item)

    while frontier:
        node = frontier.pop()
        if node.is_container:
            visit(node.iter())
        for op, out in producers.get(node.name, ()):
            if id(op) not in used_ops and out == node:
                used_ops.add(id(op))
                visit(op.inputs)
    self.op_nodes = [op for op in self.op_nodes if id(op) in used_ops]
    nodes = sorted(used, key=lambda node: (before.get(hash(node), -1), "" if hash(node) in before else _name(node)))
    self.data_nodes = ReactiveNamedItemDict(nodes)


_filter_nodes.gdn_export_patch = True


def _name(node) -> str:
    return str(getattr(node, "export_name", None) or getattr(node, "name", ""))


def _infer_missing_shapes(self, raise_error: bool = False):
    """torch-to-nnef 0.24.12's ``_infer_missing_shapes_from_ops_outputs``, its work list filtered by identity and
    an op's re-run skipped where nothing it reads changed."""
    from torch_to_nnef.exceptions import T2NErrorNotImplemented
    from torch_to_nnef.torch_graph.ir_graph import _expand_node_containers_if_exists

    unshaped_data = {node.name: node for node in self.data_nodes if not node.tracable}
    # gdn_export's own ops (a recurrence run in eager torch: ms each) are not run again once their outputs have
    # shapes; other ops re-run where something they read changed (``_realise_unless_unchanged``), since that can
    # simplify the graph (a cast to the same dtype dropped).
    remaining_ops = [op for op in self.op_nodes
                     if not op.kind.startswith(OWN_OPS) or any(
                         node.name in unshaped_data for node in _expand_node_containers_if_exists(op.outputs))]
    while unshaped_data:
        done = set()
        start_len = len(unshaped_data)
        for op_node in remaining_ops:
            if _realise_unless_unchanged(op_node):
                done.add(id(op_node))
                for node in _expand_node_containers_if_exists(op_node.outputs):
                    unshaped_data.pop(node.name, None)
        remaining_ops = [op for op in remaining_ops if id(op) not in done]
        if len(unshaped_data) == start_len:
            if raise_error:
                raise T2NErrorNotImplemented(f"missing unshaped_data: {unshaped_data}")
            break
    return self


_LAST_RUN = "_gdn_export_last_run"  # attribute of a TorchOp: (what it read, its result) when it last ran


def _reads(op) -> tuple:
    """What ``realise_output_type_and_size`` reads of ``op``'s inputs, and its output nodes: node and data objects
    (compared by identity, and kept alive by the memo, so an id is never reused), and the flags."""
    from torch_to_nnef.torch_graph.ir_graph import _expand_node_containers_if_exists

    state = []
    for node in _expand_node_containers_if_exists(op.inputs):
        state += [node, getattr(node, "data", None), getattr(node, "_traced_data", None),
                  getattr(node, "tracable", None), getattr(node, "is_constant", None),
                  getattr(node, "module_attr", None), getattr(node, "dtype", None),
                  tuple(getattr(node, "shape", None) or ())]
    return tuple(state), tuple(_expand_node_containers_if_exists(op.outputs))


def _same(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(x is y or (type(x) in (bool, tuple, type(None)) and x == y) for x, y in zip(a, b))


def _inputs_unchanged(op, reads: tuple) -> bool:
    last = getattr(op, _LAST_RUN, None)
    return last is not None and _same(last[0][0], reads[0]) and _same(last[0][1], reads[1])


def _realise_unless_unchanged(op) -> bool:
    """``op.realise_output_type_and_size()``, or its last result when nothing it reads changed since it ran."""
    reads = _reads(op)
    if _inputs_unchanged(op, reads):
        return getattr(op, _LAST_RUN)[1]
    result = op.realise_output_type_and_size()
    object.__setattr__(op, _LAST_RUN, (_reads(op), result))
    return result
