"""Running an exported ``.onnx`` file: onnxruntime (CPU provider) or tract's ONNX loader, and a prefill/decode
session carrying the states (``in_*`` fed with the previous call's ``out_*``), like ``gdn_export.Session``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from gdn_export.errors import GdnExportError
from gdn_export.targets import ONNX_RUNNERS, numpy_dtype

RUNTIMES = ONNX_RUNNERS


def read_onnx_metadata(path) -> dict | None:
    """The ``gdn_export`` metadata stored in an ``.onnx`` file (None when absent)."""
    import onnx

    path = Path(path)
    if not path.is_file():
        raise GdnExportError(f"no file at {path} (expected a .onnx written by gdn-export)")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as err:  # protobuf's DecodeError and friends
        raise GdnExportError(f"{path} is not an ONNX file ({type(err).__name__})") from None
    from gdn_export.run.archive import check_metadata

    for entry in model.metadata_props:
        if entry.key == "gdn_export":
            where = f"{path}: its gdn_export metadata"
            try:
                metadata = json.loads(entry.value)
            except (ValueError, RecursionError) as err:
                raise GdnExportError(f"{where} is not valid JSON ({err})") from None
            return check_metadata(metadata, where)  # the schema an archive's gdn_export.json is read through
    return None


class _Runner:
    """One loaded model: ``run(feeds) -> {name: array}``."""

    def __init__(self, path: Path, runtime: str, threads: int | None = None) -> None:
        if runtime not in RUNTIMES:
            raise GdnExportError(f"ONNX runtime {runtime!r} is not one of {', '.join(RUNTIMES)}")
        self.runtime = runtime
        if runtime == "onnxruntime":
            import onnxruntime as ort

            options = ort.SessionOptions()
            if threads:
                options.intra_op_num_threads = threads
                options.inter_op_num_threads = 1
            self.session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
            self.inputs = [i.name for i in self.session.get_inputs()]
            self.outputs = [o.name for o in self.session.get_outputs()]
        else:
            import onnx
            import tract

            model = onnx.load(str(path), load_external_data=False)
            self.inputs = [i.name for i in model.graph.input if i.name not in {t.name for t in model.graph.initializer}]
            self.outputs = [o.name for o in model.graph.output]
            del model
            self.plan = tract.onnx().load(str(path)).into_model().into_runnable()

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self.runtime == "onnxruntime":
            return dict(zip(self.outputs, self.session.run(None, feeds)))
        values = self.plan.run([feeds[name] for name in self.inputs])
        return dict(zip(self.outputs, (v.to_numpy() for v in values)))


def run_model(path, inputs: list[np.ndarray], runtime: str = "onnxruntime") -> tuple[list[str], list[np.ndarray]]:
    """Every output of ``path`` on ``inputs`` (in the graph's input order): (names, arrays)."""
    runner = _Runner(Path(path), runtime)
    result = runner.run(dict(zip(runner.inputs, inputs)))
    return runner.outputs, [result[n] for n in runner.outputs]


class OnnxSession:
    """``prefill(ids) -> logits``, ``decode(ids) -> logits``, ``reset()`` over an exported ``.onnx`` file (a
    ``gdn_export.run.runner.Runner``)."""

    OPTIONS = ("runtime", "threads")  # what open_runner's offered passes (run.runner.Runner)

    def __init__(self, path, runtime: str = "onnxruntime", threads: int | None = None) -> None:
        self.path = Path(path)
        self.metadata = read_onnx_metadata(self.path)
        if not self.metadata or "states" not in self.metadata:
            raise GdnExportError(f"{self.path} was not written by gdn-export convert (no gdn_export metadata with "
                                 f"states)")
        self._runner = _Runner(self.path, runtime, threads)
        self.runtime = runtime
        self.states: dict[str, np.ndarray] | None = None

    def reset(self) -> None:
        self.states = None

    def _zeros(self, batch: int) -> dict[str, np.ndarray]:
        states = {}
        for spec in self.metadata["states"]:
            shape = [batch if d == "B" else 0 if d == "P" else int(d) for d in spec["shape"]]
            states[f"in_{spec['name']}"] = np.zeros(shape, dtype=numpy_dtype(spec["dtype"]))
        return states

    def prefill(self, input_ids: np.ndarray) -> np.ndarray:
        input_ids = np.ascontiguousarray(np.asarray(input_ids, dtype=np.int64))
        if input_ids.ndim != 2 or input_ids.shape[1] < 1:
            raise GdnExportError(f"input_ids must be [B, S] with S >= 1, got {list(input_ids.shape)}")
        vocab = self.metadata.get("vocab_size")
        if vocab is not None and (input_ids.min() < 0 or input_ids.max() >= vocab):
            raise GdnExportError(f"token ids must be in [0, {vocab}), got {input_ids.min()}..{input_ids.max()}")
        if self.states is None:
            self.states = self._zeros(input_ids.shape[0])
        out = self._runner.run({"input_ids": input_ids, **self.states})
        self.states = {f"in_{name[4:]}": value for name, value in out.items() if name.startswith("out_")}
        return out["logits"]

    decode = prefill
