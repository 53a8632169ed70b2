"""The compatibility module (gdn_export/backends/compat): every patch of third-party internals is applied for one
conversion only, asserts the version it was written for, and has a canary here that fails the day upstream changes
the code it replaces or wraps (a digest of that code's source as of the version in ``compat.WRITTEN_FOR``).

A failing canary means: read the new upstream code, check the patch (and its Quirk in gdn_export/tract_quirks.py)
still holds, then update the digest."""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import inspect

import pytest

from gdn_export.backends import compat
from gdn_export.backends.compat import torch_to_nnef as t2n


def digest(obj) -> str:
    return hashlib.sha256(inspect.getsource(obj).encode()).hexdigest()[:16]


def upstream(quirk: str, what: str, obj, expected: str) -> None:
    found = digest(obj)
    assert found == expected, (
        f"{what} changed upstream (source digest {found}, patched against {expected}): re-check the patch of "
        f"tract_quirks.{quirk} in gdn_export/backends/compat/ and update this digest")


# --- torch-to-nnef: what the order, shape and registry patches replace ------------------------------
def test_t2n_set_order_names():
    import torch_to_nnef.export as t2n_export
    from torch_to_nnef.tensor.updater import ModTensorUpdater
    from torch_to_nnef.torch_graph.ir_graph import TorchModuleIRGraph

    upstream("T2N_SET_ORDER_NAMES", "TorchModuleIRGraph._filter_nodes_not_in_trace_between_inputs_and_outputs",
             TorchModuleIRGraph._filter_nodes_not_in_trace_between_inputs_and_outputs, "ed961a11f4971458")
    upstream("T2N_SET_ORDER_NAMES", "ModTensorUpdater.__init__", ModTensorUpdater.__init__, "2d87e19eac0f1612")
    upstream("T2N_SET_ORDER_NAMES", "torch_to_nnef.export._build_nnef_graph_and_fragments",
             t2n_export._build_nnef_graph_and_fragments, "3ce8352131164eff")


def test_t2n_quadratic_shape_inference():
    from torch_to_nnef.torch_graph.ir_graph import TorchModuleIRGraph

    upstream("T2N_QUADRATIC_SHAPE_INFERENCE", "TorchModuleIRGraph._infer_missing_shapes_from_ops_outputs",
             TorchModuleIRGraph._infer_missing_shapes_from_ops_outputs, "411515d4b3a81a9c")


def test_t2n_quadratic_graph_edits():
    from torch_to_nnef.nnef_graph import TorchToNGraphExtractor
    from torch_to_nnef.torch_graph.ir_graph import TorchModuleIRGraph
    from torch_to_nnef.torch_graph.ir_op import TorchOp

    upstream("T2N_QUADRATIC_GRAPH_EDITS", "TorchModuleIRGraph.remap_node", TorchModuleIRGraph.remap_node,
             "18818fad3b5763d9")
    # the ops' field-by-field __eq__ (a dataclass) and the two places that compare ops with it
    upstream("T2N_QUADRATIC_GRAPH_EDITS", "TorchOp", TorchOp, "5faefca2bec8ff25")
    upstream("T2N_QUADRATIC_GRAPH_EDITS", "TorchModuleIRGraph._merge_subraph", TorchModuleIRGraph._merge_subraph,
             "e4cce984505ae2b6")
    upstream("T2N_QUADRATIC_GRAPH_EDITS", "TorchToNGraphExtractor._add_operators",
             TorchToNGraphExtractor._add_operators, "6fd7b176ad945c9b")


def test_t2n_registry_register():
    from torch_to_nnef.op import extras

    upstream("T2N_REGISTRY_REFUSES_SECOND_HANDLER", "OpRegistry.register", type(extras._T2N_EXTRA_REGISTRY).register,
             "b30dc09d2c402d8c")


def test_t2n_download():
    from torch_to_nnef.inference_target.tract import TractCli

    upstream("T2N_TARGET_DOWNLOADS_TRACT", "TractCli.download", TractCli.download, "216d566ddf5b9387")


def test_t2n_streamed_weight_hooks():
    from torch_to_nnef.nnef_io import writer
    from torch_to_nnef.op.aten import math
    from torch_to_nnef.tensor.named import NamedTensor

    upstream("T2N_READS_WEIGHT_VALUES", "writer.write_nnef_tensor", writer.write_nnef_tensor, "0e1d3b778d36b360")
    upstream("T2N_READS_WEIGHT_VALUES", "aten.math.remap_if_neutral_op", math.remap_if_neutral_op, "fd4a89ae2d492eb6")
    upstream("T2N_CLONES_TENSORS_PER_OP", "NamedTensor.clone", NamedTensor.clone, "2c5f44e0c6933be6")
    upstream("T2N_CLONES_TENSORS_PER_OP", "NamedTensor.__torch_function__", NamedTensor.__torch_function__,
             "0b0b6b74385874ff")


def test_t2n_post_trace_runs_before_writing(tmp_path):
    """tract_quirks.T2N_POST_TRACE_BEFORE_WRITE: the export's graph passes (backends/nnef/target.py) see
    torch-to-nnef's translated graph before it is written. Found there: the float16 weight the graph only casts to
    float32; given there: the datum_type of a gather over a (here pretended) Q4_0 table, printed in graph.nnef
    (torch-to-nnef gives one only to its own quantized tensors)."""
    import logging

    import torch
    from torch_to_nnef import export_model_to_nnef

    from gdn_export.backends.nnef.target import OfflineTractTarget
    from gdn_export.weights.casts import weights_cast_before_use
    from gdn_export.weights.streamed import annotate_compressed_gathers

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.table = torch.nn.Embedding(8, 4)
            self.inner = torch.nn.Linear(4, 4, bias=False).half()

        def forward(self, ids):
            return torch.nn.functional.linear(self.table(ids), self.inner.weight.float())

    found: dict = {}
    target = OfflineTractTarget("0.23.9", graph_passes=[lambda g: found.update(weights_cast_before_use(g)),
                                                        lambda g: annotate_compressed_gathers(g, {"table.weight": "f32"})])
    with torch.no_grad(), t2n.conversion():
        export_model_to_nnef(model=Tiny(), args=(torch.tensor([[1, 2]]),), file_path_export=tmp_path / "m.nnef",
                             inference_target=target, input_names=["ids"], output_names=["y"],
                             compression_level=None, log_level=logging.ERROR)
    graph = (tmp_path / "m.nnef" / "graph.nnef").read_text()
    assert found == {"inner.weight": "f32"}, found
    gathers = [line for line in graph.splitlines() if "tract_core_gather(" in line]
    assert len(gathers) == 1 and gathers[0].endswith("axis = 0, datum_type = 'f32');"), gathers


def test_t2n_compiles_at_import():
    module = importlib.import_module(t2n._CompileHeldBack.MODULE)
    upstream("T2N_COMPILES_AT_IMPORT", t2n._CompileHeldBack.MODULE, module, "819aaf58af03f76e")
    assert "torch.compile" in inspect.getsource(module), "torch-to-nnef no longer compiles at import: drop the finder"


# --- torch: the ONNX passes the streamed ONNX writer hooks ------------------------------------------
def test_torch_onnx_passes_hooked():
    import torch
    from torch.onnx._internal.torchscript_exporter import utils

    from gdn_export.backends.compat.torch_onnx import PASSES

    source = inspect.getsource(utils)
    for name in PASSES:
        assert hasattr(torch._C, name), f"torch._C.{name} is gone: re-check tract_quirks.TORCH_ONNX_PASSES_HOOKED"
        assert f"_C.{name}(" in source, (
            f"torch's TorchScript ONNX exporter no longer calls _C.{name} through the module attribute: the hook of "
            "tract_quirks.TORCH_ONNX_PASSES_HOOKED would not be seen")


# --- the mechanism ------------------------------------------------------------------------------------
def test_patches_are_scoped_to_the_conversion():
    from torch_to_nnef.op import extras
    from torch_to_nnef.torch_graph.ir_graph import TorchModuleIRGraph

    original = TorchModuleIRGraph.__dict__["_infer_missing_shapes_from_ops_outputs"]
    theirs = extras._T2N_EXTRA_REGISTRY._registry.get("gated_delta_scan")
    ours = {"gated_delta_scan": lambda *a, **k: None, "gdn_export_probe": lambda *a, **k: None}
    with t2n.conversion(ours):
        with t2n.conversion(ours):  # nested (or a second thread): one installation, counted
            assert TorchModuleIRGraph._infer_missing_shapes_from_ops_outputs is t2n._infer_missing_shapes
        assert TorchModuleIRGraph._infer_missing_shapes_from_ops_outputs is t2n._infer_missing_shapes
        assert extras._T2N_EXTRA_REGISTRY._registry["gated_delta_scan"] is ours["gated_delta_scan"]
    assert TorchModuleIRGraph.__dict__["_infer_missing_shapes_from_ops_outputs"] is original
    assert extras._T2N_EXTRA_REGISTRY._registry.get("gated_delta_scan") is theirs
    assert "gdn_export_probe" not in extras._T2N_EXTRA_REGISTRY._registry
    assert compat.installed_patches() == []


def test_a_patch_is_restored_when_the_conversion_fails():
    from torch_to_nnef.tensor.named import NamedTensor

    original = NamedTensor.__dict__["clone"]
    with pytest.raises(RuntimeError, match="inside"):
        with compat.patched(*t2n.streamed_weight_patches(lambda f: f, lambda f: f, lambda f: "replaced")):
            assert NamedTensor.__dict__["clone"] == "replaced"
            raise RuntimeError("inside")
    assert NamedTensor.__dict__["clone"] is original


def test_an_unexpected_version_is_a_one_line_error(monkeypatch):
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version",
                        lambda name: "0.25.0" if name == "torch_to_nnef" else real(name))
    with pytest.raises(compat.CompatError) as raised:
        compat.require("torch_to_nnef")
    message = str(raised.value)
    assert "\n" not in message and "torch_to_nnef 0.25.0 is installed" in message and "0.24.12" in message
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "2.14.1" if name == "torch" else real(name))
    with pytest.raises(compat.CompatError, match=r"torch 2\.14\.1 is installed; .* as of 2\.13"):
        compat.require("torch")
    assert compat.require("torch_to_nnef") == real("torch_to_nnef")  # the installed one passes


def test_every_patch_names_its_quirk():
    from gdn_export import tract_quirks
    from gdn_export.backends.compat.torch_onnx import onnx_pass_patches

    patches = [*t2n.order_and_shape_patches(), *t2n.handler_patches({"probe": print}), t2n.no_download(print),
               *t2n.streamed_weight_patches(print, print, print), *onnx_pass_patches(print, print, print)]
    for patch in patches:
        quirk = getattr(tract_quirks, patch.quirk, None)
        assert isinstance(quirk, tract_quirks.Quirk), f"{patch.attribute}: no Quirk {patch.quirk}"
        assert any("backends/compat/" in module for module in quirk.applied_in), (
            f"{patch.quirk} does not list the compat module that applies it")
