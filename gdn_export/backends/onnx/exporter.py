"""``export(..., format="onnx")``: a torch module to a checked ``.onnx`` file (onnxruntime, tract's ONNX loader).

Why the TorchScript exporter (``torch.onnx.export(..., dynamo=False)``) and not the dynamo one: the exportable
modules are written to be traced (torch-to-nnef traces them with ``torch.jit.trace`` too): shapes come from tensor
shapes, so the traced graph is generic in B, S and P, and ``dynamic_axes`` names them; the custom ops reach the
exporter as single nodes (``register_custom_op_symbolic``), which become placeholders that ``rewrite`` replaces
by the decided form, written with ``onnx.helper`` (a ``Scan`` body is a plain subgraph there). The dynamo exporter
would need ``torch.export`` to prove the models' shape guards for symbolic B, S, P (the HF families' masks and
cache concatenations), a second set of constraints the families were never written for.

The file is validated (``onnx.checker``, then shape inference with type checking) before it appears; it is
written next to its final name in a temporary folder, then renamed (``OUT.onnx.data`` first when the weights go
to external data: above ``EXTERNAL_DATA_BYTES`` of initializers, and always past protobuf's 2 GB limit; always too
when the weights are streamed from their sources, ``gdn_export.backends.onnx.streamed``).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import warnings
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Mapping, Sequence

import numpy as np
import torch

from gdn_export.errors import GdnExportError
from gdn_export.backends.onnx.registry import SHAPED, validate

if TYPE_CHECKING:
    from gdn_export.backends.onnx.streamed import Source

METADATA_KEY = "gdn_export"
EXTERNAL_DATA_BYTES = 1 << 30  # initializers above this go to OUT.onnx.data (protobuf's hard limit is 2 GB)


def onnx_path(path) -> Path:
    path = Path(path)
    if path.suffix != ".onnx":
        raise GdnExportError(f"output path {path} must end with .onnx for format='onnx'")
    return path


@dataclass
class OnnxExportReport:
    path: Path
    runtime: str
    decisions: list = field(default_factory=list)
    parity: object = None
    external_data: Path | None = None
    seconds: dict = field(default_factory=dict)

    def lowerings(self) -> list[str]:
        return [d.lowering for d in self.decisions]

    def __str__(self) -> str:
        from gdn_export.backends.onnx.symbolics import OPSET

        lines = [f"wrote {self.path} (ONNX opset {OPSET}, runtime {self.runtime})"
                 + (f", weights in {self.external_data.name}" if self.external_data else "")]
        lines += [f"  {d.node} ({d.entry}): {d.lowering} - {d.reason}" for d in self.decisions]
        if self.parity is not None:
            lines.append(str(self.parity))
        return "\n".join(lines)


def _initializer_bytes(model) -> int:
    total = 0
    for t in model.graph.initializer:
        total += len(t.raw_data) if t.HasField("raw_data") else t.ByteSize()
    return total


def write_onnx(module: torch.nn.Module, args: Sequence[torch.Tensor], folder: Path, name: str, *,
               input_names: Sequence[str], output_names: Sequence[str] | None, dynamic_axes: dict | None,
               runtime: str, lowering: str, metadata: dict | None = None,
               output_dims: dict[str, list] | None = None,
               sources: Mapping[int, Source] | None = None) -> tuple[Path, Path | None, list, dict]:
    """Export, rewrite the placeholders, validate and write ``folder/name`` (and ``name.data``).
    ``sources``: the storage data_ptr of each parameter traced as a placeholder -> where its values are read
    (``gdn_export.backends.onnx.streamed``): the weights are then written from there into ``name.data``, never held.
    Returns (file, external data file or None, decisions, seconds)."""
    import onnx

    from gdn_export.backends.onnx import rewrite, streamed, symbolics

    symbolics.register()
    seconds = {}
    start = time.perf_counter()
    traced = _operand_shapes(module, args)
    raw = folder / f"raw_{name}"
    axes = {k: dict(v) for k, v in (dynamic_axes or {}).items()}
    with torch.no_grad(), warnings.catch_warnings(), \
            (streamed.capture(sources, module) if sources else nullcontext()) as record:
        warnings.simplefilter("ignore")
        try:
            torch.onnx.export(module, tuple(args), str(raw), dynamo=False, input_names=list(input_names),
                              output_names=list(output_names) if output_names else None, dynamic_axes=axes,
                              opset_version=symbolics.OPSET, do_constant_folding=True,
                              export_params=not sources)
        except (GdnExportError, KeyboardInterrupt):
            raise
        except Exception as err:  # the exporter's own errors, one line
            raise GdnExportError(f"torch.onnx.export failed: {type(err).__name__}: "
                                 f"{str(err).strip().splitlines()[0] if str(err).strip() else ''}") from err
    seconds["trace"] = time.perf_counter() - start
    start = time.perf_counter()
    model = onnx.load(str(raw), load_external_data=True)
    for f in folder.iterdir():  # the exporter's own files (and external data of a large model)
        if f.name != name and f.name != f"{name}.data":
            f.unlink()
    decisions = rewrite.rewrite(model, runtime, lowering, traced)
    for output in model.graph.output:
        dims = (output_dims or {}).get(output.name)
        if dims is not None:
            shape = output.type.tensor_type.shape
            del shape.dim[:]
            for d in dims:
                entry = shape.dim.add()
                if isinstance(d, int):
                    entry.dim_value = d
                elif d:
                    entry.dim_param = d
    if metadata is not None:
        entry = model.metadata_props.add()
        entry.key = METADATA_KEY
        entry.value = json.dumps({**metadata, "decisions": [d.summary() for d in decisions]})
    model.producer_name = "gdn_export"
    path = folder / name
    if sources:  # every initializer from its recipe, the weights from their sources: always external data
        initializers = streamed.plan(record, [i.name for i in model.graph.input])
        data = folder / f"{name}.data"
        streamed.write(model, initializers, data)
        onnx.save_model(model, str(path))
        del model
        validate_file(path)
        seconds["write"] = time.perf_counter() - start
        return path, data, decisions, seconds
    external = _initializer_bytes(model) > EXTERNAL_DATA_BYTES
    data = folder / f"{name}.data" if external else None
    if external:
        onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=data.name, size_threshold=1024)
    else:
        onnx.save_model(model, str(path))
    del model
    validate_file(path)
    seconds["write"] = time.perf_counter() - start
    return path, data, decisions, seconds


def _operand_shapes(module, args) -> dict[str, list]:
    """Run ``module(*args)`` once, recording the tensor operands' shapes of each gated delta-rule call, in order:
    the TorchScript graph's types can leave a size symbolic that is static (a head count of a view to -1)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    calls: dict[str, list] = {}

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            op = SHAPED.get(func._schema.name)  # the ops whose rewriters read operand sizes
            if op is not None:
                calls.setdefault(op, []).append([list(a.shape) for a in args if isinstance(a, torch.Tensor)])
            return func(*args, **(kwargs or {}))

    with torch.no_grad(), Record():
        module(*args)
    return calls


def validate_file(path: Path) -> None:
    """``onnx.checker`` (full) and shape inference with type checks on the written file; GdnExportError if not."""
    import onnx

    try:
        onnx.checker.check_model(str(path))
        inferred = path.with_name(path.name + ".inferred")
        try:
            onnx.shape_inference.infer_shapes_path(str(path), str(inferred), check_type=True, data_prop=True)
        finally:
            inferred.unlink(missing_ok=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as err:
        raise GdnExportError(f"the ONNX graph for {path.name} is not valid: {str(err).strip().splitlines()[0]}") from err
    placeholders = [n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node
                    if n.domain == "gdn_export"]
    if placeholders:
        raise GdnExportError(f"placeholders left in the ONNX graph: {sorted(set(placeholders))}")


def export_onnx(module: torch.nn.Module, args: Sequence[torch.Tensor], path, *, input_names=None, output_names=None,
                dynamic_axes=None, check: bool = True, metadata: dict | None = None, runtime: str = "any",
                lowering: str = "auto", output_dims: dict | None = None) -> OnnxExportReport:
    """Export ``module(*args)`` to ``path`` (``.onnx``). ``runtime``: "onnxruntime" (its contrib ops where they
    compute exactly the node), "tract-onnx" or "any" (the portable forms). With ``check``, the file runs in
    onnxruntime on ``args`` (tract's ONNX loader for ``runtime="tract-onnx"``) and every output is compared with
    torch (ParityError beyond tolerance). The file appears at ``path`` only once written, validated and checked."""
    validate(runtime, lowering)
    path = onnx_path(path)
    args = tuple(args)
    input_names = list(input_names) if input_names else [f"input_{i}" for i in range(len(args))]
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".gdn_export_", dir=path.parent) as tmp:
        staged, data, decisions, seconds = write_onnx(
            module, args, Path(tmp), path.name, input_names=input_names, output_names=output_names,
            dynamic_axes=dynamic_axes, runtime=runtime, lowering=lowering, metadata=metadata,
            output_dims=output_dims)
        report = OnnxExportReport(path, runtime, decisions, seconds=seconds,
                                  external_data=path.with_name(data.name) if data else None)
        if check:
            report.parity = check_against_torch(module, args, staged, runtime)
            report.parity.raise_if_failed()
        publish(staged, data, path)
    return report


def publish(staged: Path, data: Path | None, path: Path) -> None:
    """Rename the staged file (and its external data, first) to ``path``."""
    if data is not None:
        os.replace(data, path.with_name(data.name))
    else:
        path.with_name(path.name + ".data").unlink(missing_ok=True)  # an older export's data
    os.replace(staged, path)


def check_against_torch(module, args: tuple, path: Path, runtime: str):
    from gdn_export.run.onnx_session import run_model
    from gdn_export.parity import RELATIVE_TOLERANCE, check_parity

    with torch.no_grad():
        expected = module(*args)
    expected = [expected] if isinstance(expected, torch.Tensor) else list(expected)
    names, actual = run_model(path, [a.detach().numpy() for a in args], "tract-onnx" if runtime == "tract-onnx"
                              else "onnxruntime")
    half = any(isinstance(a, torch.Tensor) and a.dtype == torch.float16 for a in args)
    relative = RELATIVE_TOLERANCE[np.dtype(np.float16 if half else np.float32)]
    return check_parity(names, [e.detach().numpy() for e in expected], actual, relative)
