"""torch-to-nnef's internals as gdn_export patches them for one export (``conversion()``; each patch names its
``Quirk`` in ``gdn_export.tract_quirks``; written for torch-to-nnef 0.24.12, ``require``d).

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
changed (``_inputs_unchanged``: the same input nodes, each attribute of each the same object, and the same
output nodes): such a re-run recomputes and stores exactly what the last one stored. gdn_export's own ops run once.

Graph edits. Each submodule call merged into its caller (every layer, at every level of the module tree) drops
the call's op with ``op != callmethod_node`` over the whole op list, and the NNEF translation filters its work list
with ``op not in done_nodes``: both compare ``TorchOp``s field by field (dataclass ``__eq__``, each field a list of
nodes compared by name, shape, dtype): quadratic in the number of layers. Replaced: ops compared by identity (the
dataclass ``__eq__`` removed for the conversion; two distinct ops never compare equal: each writes its own uniquely
named nodes). ``remap_node`` (once per input and output of every merged call) also sets a new, equal item list in
every container of the graph, so every op reading a container ran its shape inference again after every remap;
replaced by the same function setting only the containers that hold the node. Its rebuilding of every op's lists
stays: testing each list for the node costs what rebuilding it does (2-3 items; measured).
"""

from __future__ import annotations

import importlib
import importlib.machinery
import sys
from contextlib import ExitStack, contextmanager
from typing import Callable, Iterator, Mapping

from gdn_export.backends.compat import Patch, _LOCK, _MISSING, patched, require

OWN_OPS = "t2n_extra::"  # the custom ops of gdn_export.ops


def order_and_shape_patches() -> list[Patch]:
    """Deterministic names and order, linear shape inference and graph edits (the module docstring): every export
    needs them."""
    import torch_to_nnef.export as t2n_export
    from torch_to_nnef.tensor.updater import ModTensorUpdater
    from torch_to_nnef.torch_graph.ir_graph import TorchModuleIRGraph
    from torch_to_nnef.torch_graph.ir_op import TorchOp

    return [
        Patch(TorchModuleIRGraph, "_filter_nodes_not_in_trace_between_inputs_and_outputs", lambda _: _filter_nodes,
              quirk="T2N_SET_ORDER_NAMES"),
        Patch(ModTensorUpdater, "__init__", _sorted_names, quirk="T2N_SET_ORDER_NAMES"),
        Patch(TorchModuleIRGraph, "_infer_missing_shapes_from_ops_outputs", lambda _: _infer_missing_shapes,
              quirk="T2N_QUADRATIC_SHAPE_INFERENCE"),
        Patch(t2n_export, "_build_nnef_graph_and_fragments", _sorted_fragments, quirk="T2N_SET_ORDER_NAMES"),
        # the dataclass __eq__ removed: object's, identity in C (list membership tests no Python call per item)
        Patch(TorchOp, "__eq__", lambda _: _MISSING, quirk="T2N_QUADRATIC_GRAPH_EDITS"),
        Patch(TorchModuleIRGraph, "remap_node", lambda _: _remap_node, quirk="T2N_QUADRATIC_GRAPH_EDITS"),
    ]


def handler_patches(handlers: Mapping[str, Callable]) -> list[Patch]:
    """gdn_export's ``t2n_extra`` handlers written into torch-to-nnef's registry dict (its ``register`` asserts on
    a name it has, and it has its own stale ``gated_delta_scan``), each restored afterwards."""
    from torch_to_nnef.op import extras

    registry = extras._T2N_EXTRA_REGISTRY._registry
    return [Patch(registry, name, lambda _, handler=handler: handler, quirk="T2N_REGISTRY_REFUSES_SECOND_HANDLER")
            for name, handler in sorted(handlers.items())]


def no_download(stand_in: Callable) -> Patch:
    """``TractCli.download`` answering ``stand_in(version)`` instead of fetching a tract binary."""
    from torch_to_nnef.inference_target.tract import TractCli

    return Patch(TractCli, "download", lambda _: classmethod(lambda cls, version: stand_in(version)),
                 quirk="T2N_TARGET_DOWNLOADS_TRACT")


def streamed_weight_patches(write_nnef_tensor: Callable, remap_if_neutral_op: Callable,
                            clone: Callable) -> list[Patch]:
    """The hooks of a streamed export (``gdn_export.weights.streamed``): each a wrapper factory of the original."""
    from torch_to_nnef.nnef_io import writer
    from torch_to_nnef.op.aten import math
    from torch_to_nnef.tensor.named import NamedTensor

    return [Patch(writer, "write_nnef_tensor", write_nnef_tensor, quirk="T2N_READS_WEIGHT_VALUES"),
            Patch(math, "remap_if_neutral_op", remap_if_neutral_op, quirk="T2N_READS_WEIGHT_VALUES"),
            Patch(NamedTensor, "clone", clone, quirk="T2N_CLONES_TENSORS_PER_OP")]


@contextmanager
def conversion(handlers: Mapping[str, Callable] = {}) -> Iterator[None]:
    """What one torch-to-nnef export needs, for its duration: the version check, the order and shape patches, and
    ``handlers`` registered. Wrap your own ``torch_to_nnef.export_model_to_nnef`` call in it (with
    ``gdn_export.backends.nnef.registry.CUSTOM_OPS`` after ``import gdn_export.ops.nnef_handlers``) to export
    gdn_export's ops."""
    require("torch_to_nnef")
    import_torch_to_nnef()
    with ExitStack() as stack:
        stack.enter_context(patched(*order_and_shape_patches(), *handler_patches(handlers)))
        yield


class _CompileHeldBack:
    """A meta-path finder that runs one module of torch-to-nnef with ``torch.compile`` as the identity.

    torch-to-nnef 0.24.12's ``tensor/quant/base.py`` wraps the dequantization of its own quantized tensors in
    ``torch.compile`` at import, which imports inductor: 1.2 s of CPU in every process that exports (measured:
    3.5-4.2 s against 2.5 s for ``import torch_to_nnef``). gdn_export writes its Q4_0 itself and never dequantizes
    those tensors, which stay correct, only eager (tract_quirks.T2N_COMPILES_AT_IMPORT)."""

    MODULE = "torch_to_nnef.tensor.quant.base"

    def find_spec(self, name, path=None, target=None):
        if name != self.MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_held_back(module) -> None:
            import torch

            compile_ = torch.compile
            torch.compile = lambda model=None, *args, **kwargs: model
            try:
                exec_module(module)
            finally:
                torch.compile = compile_

        spec.loader.exec_module = exec_held_back
        return spec


def import_torch_to_nnef() -> None:
    """Import torch-to-nnef, its quantized-tensor module with ``torch.compile`` held back (the finder is in
    ``sys.meta_path`` for this import only)."""
    if _CompileHeldBack.MODULE in sys.modules:
        return
    with _LOCK:
        finder = _CompileHeldBack()
        sys.meta_path.insert(0, finder)
        try:
            importlib.import_module(_CompileHeldBack.MODULE)
            importlib.import_module("torch_to_nnef")
        finally:
            sys.meta_path.remove(finder)


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



def _remap_node(self, from_node, to_node) -> None:
    """torch-to-nnef 0.24.12's ``TorchModuleIRGraph.remap_node``, a container's items set only where it holds
    ``from_node`` (upstream sets an equal new list in every container of the graph, which makes every op reading one
    run its shape inference again after every remap: exact, as a re-run with the same inputs stores what the last
    one stored, but quadratic in the layers)."""
    from torch_to_nnef.torch_graph.ir_data import Data

    assert isinstance(from_node, Data)
    assert isinstance(to_node, Data)
    self.inputs = [to_node if _ is from_node else _ for _ in self.inputs]
    self.outputs = [to_node if _ is from_node else _ for _ in self.outputs]
    for op in self.op_nodes:
        op.inputs = [to_node if _ is from_node else _ for _ in op.inputs]
        op.outputs = [to_node if _ is from_node else _ for _ in op.outputs]
    self.data_nodes.remove(from_node, raise_exception_if_not_found=False)
    target = id(from_node)
    for dnode in self.data_nodes:  # nodes in containers too
        if dnode.is_container and target in map(id, dnode.iter()):
            dnode.set_data([to_node if _ is from_node else _ for _ in dnode.iter()])
    if not self.data_nodes.contains(to_node):
        self.data_nodes.append(to_node)


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
    """What ``realise_output_type_and_size`` can read of ``op``'s inputs, and its output nodes: every input node
    (containers expanded) and each of its attributes' values, compared by identity (``id``s, compared in C; the
    objects are kept alive by the memo, so an id is never reused), a shape list by value (it may be edited in place).
    What the properties it reads (``tracable``, ``is_constant``, ``dtype`` of a container) return is a function of
    those attributes, so an unchanged fingerprint means an unchanged input."""
    from torch_to_nnef.torch_graph.ir_graph import _expand_node_containers_if_exists

    held: list = []
    shapes: list = []
    for node in _expand_node_containers_if_exists(op.inputs):
        attributes = node.__dict__
        held.append(node)
        held.extend(attributes.values())
        shape = attributes.get("shape")
        if type(shape) is list:
            shapes.append(tuple(shape))
    outputs = tuple(_expand_node_containers_if_exists(op.outputs))
    return held, outputs, (tuple(map(id, held)), tuple(shapes), tuple(map(id, outputs)))


def _inputs_unchanged(op, reads: tuple) -> bool:
    last = getattr(op, _LAST_RUN, None)
    return last is not None and last[0][2] == reads[2]


def _realise_unless_unchanged(op) -> bool:
    """``op.realise_output_type_and_size()``, or its last result when nothing it reads changed since it ran."""
    reads = _reads(op)
    if _inputs_unchanged(op, reads):
        return getattr(op, _LAST_RUN)[1]
    result = op.realise_output_type_and_size()
    object.__setattr__(op, _LAST_RUN, (_reads(op), result))
    return result
