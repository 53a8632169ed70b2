"""Reading a Megatron-core checkpoint folder without executing anything from it.

Two layouts, as Megatron-LM's training loop writes them (``megatron/training/checkpointing.py``):

* ``torch_dist`` (``megatron.core.dist_checkpointing``): ``iter_NNNNNNN/`` holding ``.metadata`` (a pickled
  ``torch.distributed.checkpoint.metadata.Metadata``: every tensor's global shape, dtype and chunks, and where each
  chunk's bytes lie), ``__<rank>_<n>.distcp`` files (each stored item a ``torch.save`` blob at an offset) and the
  common state (``args``, ``checkpoint_version``, ``iteration``): in ``common.pt`` (older Megatron) or as the
  ``common_state`` object inside the ``.distcp`` files (newer). Tensors are global: Megatron cuts them into chunks
  (tensor-parallel shards, the two halves of a SwiGLU ``linear_fc1``) and stores each at its offsets.
* legacy ``iter_NNNNNNN/mp_rank_00/model_optim_rng.pt`` (one ``torch.save`` per model-parallel rank).

``latest_checkpointed_iteration.txt`` in the parent folder names the iteration; either folder may be given.

Nothing is unpickled with the standard unpickler: ``.metadata`` goes through ``RestrictedUnpickler`` (the
checkpoint dataclasses of ``torch.distributed.checkpoint``, ``torch.Size`` and dtypes; anything else is a
``MegatronCheckpointError``), and every ``torch.save`` blob through ``torch.load(weights_only=True)`` with
``argparse.Namespace`` (Megatron-LM's ``args``) as the one extra allowed class. torch's own
``FileSystemReader.read_metadata`` is not used: it calls ``pickle.load``.
"""

from __future__ import annotations

import argparse
import io
import itertools
import math
import os
import pickle
import re
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from gdn_export.hf.tensors import CheckpointError

TRACKER = "latest_checkpointed_iteration.txt"
LEGACY_FILE = "model_optim_rng.pt"
TORCH_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
BRIDGE_CONFIG = "run_config.yaml"
# a Bridge run_config.yaml is ~20 KB; PyYAML takes ~15 s a MiB of mappings in pure Python, so this bounds the read
BRIDGE_CONFIG_LIMIT = 256 << 10
# a torch_dist tensor's bounds, far above any model's, so that a hostile .metadata is one line, not a 2^64-element
# allocation or an hour of chunk comparisons: 2^40 elements (4 TiB of float32), 2^16 chunks
MAX_TENSOR_ELEMENTS = 1 << 40
MAX_CHUNKS = 1 << 16
LEGACY_RANK = re.compile(r"mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?")
# The names Megatron gives a routed expert's tensors, in one place (every reader of expert names goes through
# expert_names / stacked_expert_name / parse_legacy_expert): torch_dist stacks the experts of a layer
# (``<mlp>experts.experts.<linear>.<param>``, expert axis first); a legacy save holds one tensor per expert,
# SequentialMLP's ``<mlp>experts.local_experts.<i>.<linear>.<param>`` or TEGroupedMLP's
# ``<mlp>experts.<linear>.<param><i>`` (weight and bias alike), i local to the expert-parallel rank.
LEGACY_EXPERT = re.compile(r"(.*\.mlp\.experts\.)(?:local_experts\.(\d+)\.(.*)|(linear_fc[12]\.(?:weight|bias))(\d+))")


@dataclass(frozen=True)
class LegacyExpert:
    """A legacy per-expert tensor name, parsed: ``experts`` (the prefix up to ``experts.``), the expert's index,
    ``tensor`` (``linear_fc1.weight``, ``linear_fc2.bias``...) and whether TEGroupedMLP names it (index last)."""

    experts: str
    index: int
    tensor: str
    grouped: bool

    def name(self, index: int | None = None) -> str:
        """The name with ``index`` (default: its own) in the same layout."""
        return expert_names(self.experts, self.tensor, self.index if index is None else index)[self.grouped]

    @property
    def unnumbered(self) -> str:
        """The name without its expert index, as a layer's tensor (``...experts.linear_fc1.weight``)."""
        return f"{self.experts}{self.tensor}"


def parse_legacy_expert(name: str) -> LegacyExpert | None:
    """``name`` as a legacy per-expert tensor (``LEGACY_EXPERT``), None when it is none."""
    match = LEGACY_EXPERT.fullmatch(name)
    if match is None:
        return None
    if match[2] is not None:
        return LegacyExpert(match[1], int(match[2]), match[3], False)
    return LegacyExpert(match[1], int(match[5]), match[4], True)


def expert_names(experts: str, tensor: str, index: int) -> tuple[str, str]:
    """Expert ``index``'s ``tensor`` (``linear_fc1.weight``...) under ``experts`` (``<mlp>experts.``) as a legacy
    save names it: (SequentialMLP's, TEGroupedMLP's)."""
    return f"{experts}local_experts.{index}.{tensor}", f"{experts}{tensor}{index}"


def stacked_expert_name(experts: str, tensor: str) -> str:
    """A layer's routed experts' ``tensor`` stacked (torch_dist, expert axis first) under ``experts``."""
    return f"{experts}experts.{tensor}"


class MegatronCheckpointError(CheckpointError):
    """A Megatron checkpoint that is malformed, unsafe or unsupported."""


def _dcp_classes() -> dict[tuple[str, str], object]:
    from torch.distributed.checkpoint import filesystem, metadata, planner

    allowed = {}
    for module in (metadata, planner):
        for name in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                     "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING", "SavePlan",
                     "WriteItem", "WriteItemType", "TensorWriteData", "LoadPlan", "ReadItem", "LoadItemType"):
            if hasattr(module, name):
                allowed[(module.__name__, name)] = getattr(module, name)
    allowed[(filesystem.__name__, "_StorageInfo")] = filesystem._StorageInfo
    return allowed


class RestrictedUnpickler(pickle.Unpickler):
    """Unpickles a DCP ``.metadata`` file: only the classes a checkpoint's metadata is made of can be named."""

    def find_class(self, module: str, name: str):
        allowed = _dcp_classes()
        if (module, name) in allowed:
            return allowed[(module, name)]
        if module == "torch" and name == "Size":
            return torch.Size
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.memory_format)):
            return getattr(torch, name)
        if module == "torch.serialization" and name == "_get_layout":
            return torch.serialization._get_layout
        if module == "collections" and name == "OrderedDict":
            import collections

            return collections.OrderedDict
        raise MegatronCheckpointError(f"checkpoint metadata names {module}.{name}, which a Megatron checkpoint's "
                                      "metadata never holds (refusing to unpickle it)")


def restricted_loads(data: bytes, what: str):
    try:
        return RestrictedUnpickler(io.BytesIO(data)).load()
    except MegatronCheckpointError:
        raise
    except Exception as err:  # a truncated or garbled pickle
        raise MegatronCheckpointError(f"{what} is not a readable checkpoint metadata file: "
                                      f"{type(err).__name__}: {str(err)[:120]}") from None


class MegatronObject:
    """An inert stand-in for an object of one of Megatron's own classes inside the pickled ``args`` (e.g. the
    ``AttnBackend`` enum): it keeps what it was built from and runs nothing."""

    def __init__(self, *args) -> None:
        self.args = args

    def __setstate__(self, state) -> None:
        self.state = state


def _stand_ins(data) -> list[type]:
    """Stand-in classes for the ``megatron.*`` globals a ``torch.save`` blob names (weights_only refuses them):
    Megatron-LM's ``args`` holds a few of its enums. Any other unsafe global is still refused."""
    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(data)
    except Exception:  # not a readable torch.save file: torch.load reports it
        return []
    finally:
        if hasattr(data, "seek"):
            data.seek(0)
    classes = []
    for name in names:
        module, _, qualname = name.rpartition(".")
        if module.split(".")[0] == "megatron" and qualname.isidentifier():
            classes.append(type(qualname, (MegatronObject,), {"__module__": module, "__qualname__": qualname}))
    return classes


def safe_torch_load(data, what: str, mmap: bool = False):
    """``torch.load(weights_only=True)``, with Megatron-LM's ``argparse.Namespace`` and inert stand-ins for
    Megatron's own classes allowed; ``mmap`` (a file path): the tensors mapped from the file, their bytes read when
    used, not when loaded."""
    try:
        with torch.serialization.safe_globals([argparse.Namespace, *_stand_ins(data)]):
            return torch.load(data, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as err:
        message = str(err).strip().splitlines()
        detail = next((line for line in message if "GLOBAL" in line or "Unsupported" in line), message[0] if message
                      else type(err).__name__)
        raise MegatronCheckpointError(f"{what} cannot be read safely (weights_only): {detail[:200]}") from None


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


def find_iteration(folder: Path) -> Path | None:
    """The iteration folder of a Megatron checkpoint (``folder`` itself or the one its tracker names), or None
    when ``folder`` is no Megatron checkpoint."""
    if (folder / ".metadata").is_file() or (folder / "common.pt").is_file() or any(folder.glob("mp_rank_*")):
        return folder
    tracker = folder / TRACKER
    if tracker.is_file():
        text = tracker.read_text(errors="replace").strip()
        if text == "release":
            return folder / "release"
        if not text.isdigit():
            raise MegatronCheckpointError(f"{tracker} holds {text[:40]!r}, not an iteration number")
        return folder / f"iter_{int(text):07d}"
    iterations = sorted(folder.glob("iter_*"))
    return iterations[-1] if len(iterations) == 1 else None


def is_megatron_checkpoint(folder: str | os.PathLike) -> bool:
    folder = Path(folder)
    return folder.is_dir() and not (folder / "config.json").exists() and find_iteration(folder) is not None


def _has_args(state) -> bool:
    if isinstance(state, list) and state and isinstance(state[0], dict):
        state = state[0]
    return isinstance(state, dict) and state.get("args") is not None


# Megatron-Bridge's model provider (a TransformerConfig) names some arguments differently from Megatron-LM's args
_BRIDGE_RENAMED = {"num_moe_experts": "num_experts"}


def bridge_args(path: Path) -> dict:
    """Megatron-LM-style ``args`` from a Megatron-Bridge checkpoint's ``run_config.yaml`` (``ConfigContainer.to_yaml``:
    its ``model`` section holds the model provider's ``TransformerConfig`` fields). Read with ``yaml.safe_load``:
    ``_target_`` entries stay plain strings, nothing is imported or built; a python tag is an error."""
    import yaml

    size = path.stat().st_size
    if size > BRIDGE_CONFIG_LIMIT:
        raise MegatronCheckpointError(f"{path} is {size} bytes: a Megatron-Bridge run_config.yaml is at most "
                                      f"{BRIDGE_CONFIG_LIMIT} bytes")
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's when installed: the same rules, in C
    try:
        config = yaml.load(path.read_text(errors="replace"), Loader=loader)  # noqa: S506 (a safe loader)
    except yaml.YAMLError as err:
        raise MegatronCheckpointError(f"{path} is not a readable run_config.yaml: {str(err).splitlines()[0][:160]}") \
            from None
    except RecursionError:
        raise MegatronCheckpointError(f"{path} is nested too deeply to be a run_config.yaml") from None
    model = config.get("model") if isinstance(config, dict) else None
    if not isinstance(model, dict):
        raise MegatronCheckpointError(f"{path} has no 'model' section (Megatron-Bridge's model provider)")
    args = {_BRIDGE_RENAMED.get(key, key): value for key, value in model.items()}
    activation = model.get("activation_func")
    activation = activation.get("_target_") if isinstance(activation, dict) else activation
    gated = bool(model.get("gated_linear_unit"))
    args["swiglu"] = gated and activation == "torch.nn.functional.silu"
    args["squared_relu"] = not gated and isinstance(activation, str) and activation.endswith("squared_relu")
    if gated and not args["swiglu"]:
        raise MegatronCheckpointError(f"{path}: a gated MLP with activation {activation!r} (only SiLU, SwiGLU)")
    args["untie_embeddings_and_output_weights"] = not model.get("share_embeddings_and_output_weights", True)
    return args


def check_chunks(name: str, meta) -> None:
    """A torch_dist tensor's chunks (``TensorStorageMetadata.chunks``: offsets and sizes in the global tensor) tile
    its global shape exactly: each lies inside it, no two overlap, and together they cover it (disjoint boxes whose
    volumes sum to the whole). Otherwise a one-line error naming the chunk, before anything is read or written."""
    size = [int(n) for n in meta.size]
    if any(n < 0 for n in size) or math.prod(size) > MAX_TENSOR_ELEMENTS:
        raise MegatronCheckpointError(f"{name}: global shape {size} in the metadata (at most "
                                      f"{MAX_TENSOR_ELEMENTS} elements)")
    if len(meta.chunks) > MAX_CHUNKS:  # the overlap test below is quadratic in the count
        raise MegatronCheckpointError(f"{name}: {len(meta.chunks)} chunks in the metadata (at most {MAX_CHUNKS})")
    starts, stops = [], []
    for chunk in meta.chunks:
        offsets, sizes = [int(o) for o in chunk.offsets], [int(n) for n in chunk.sizes]
        if len(offsets) != len(size) or len(sizes) != len(size) or any(o < 0 for o in offsets) or \
                any(n <= 0 for n in sizes) or any(o + n > g for o, n, g in zip(offsets, sizes, size)):
            raise MegatronCheckpointError(f"{name}: the chunk at {offsets} of shape {sizes} exceeds the global shape "
                                          f"{size}")
        starts.append(offsets)
        stops.append([o + n for o, n in zip(offsets, sizes)])
    starts_ = np.array(starts, np.int64).reshape(len(starts), len(size))  # bounded by the global shape: no overflow
    stops_ = np.array(stops, np.int64).reshape(len(stops), len(size))
    for i in range(len(starts) - 1):  # boxes overlap when their intervals overlap on every axis
        overlap = ((starts_[i + 1:] < stops_[i]) & (stops_[i + 1:] > starts_[i])).all(axis=1)
        if overlap.any():
            j = i + 1 + int(np.argmax(overlap))
            raise MegatronCheckpointError(f"{name}: the chunks at {starts[i]} and {starts[j]} overlap")
    covered = sum(math.prod(n - o for o, n in zip(start, stop)) for start, stop in zip(starts, stops))
    total = math.prod(size)
    if covered != total:
        raise MegatronCheckpointError(f"{name}: its chunks cover {covered} of the {total} elements of its global "
                                      f"shape {size} (a gap)")


class MegatronCheckpoint:
    """A Megatron checkpoint's ``args`` and tensors (by name), read lazily one tensor at a time."""

    format: str
    args: dict
    saved_by: str = "Megatron"

    def __init__(self, folder: str | os.PathLike) -> None:
        root = Path(folder)
        iteration = find_iteration(root)
        if iteration is None or not iteration.is_dir():
            raise MegatronCheckpointError(f"{root} is no Megatron checkpoint (expected iter_*/ with .metadata + "
                                          f"*.distcp, or iter_*/mp_rank_00/{LEGACY_FILE})")
        self.folder = iteration
        self.blocks: dict[str, list[int]] = {}
        ranks = sorted(p.name for p in iteration.glob("mp_rank_*"))
        if (iteration / ".metadata").is_file():
            self.format = "torch_dist"
            self._open_dist()
        elif ranks:
            self.format = "legacy"
            self._open_legacy(iteration, ranks)
        else:
            raise MegatronCheckpointError(f"{iteration} has neither .metadata (torch_dist) nor mp_rank_00/ (legacy)")

    # --- torch_dist --------------------------------------------------------------------------------------------

    def _open_dist(self) -> None:
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

        path = self.folder / ".metadata"
        metadata = restricted_loads(path.read_bytes(), str(path))
        if not hasattr(metadata, "state_dict_metadata") or not hasattr(metadata, "storage_data"):
            raise MegatronCheckpointError(f"{path} is not a torch.distributed.checkpoint Metadata")
        self._storage = metadata.storage_data
        self._tensors: dict[str, TensorStorageMetadata] = {}
        self._objects: dict[str, BytesStorageMetadata] = {}
        for name, item in metadata.state_dict_metadata.items():
            if isinstance(item, TensorStorageMetadata):
                check_chunks(name, item)
                self._tensors[name] = item
            else:
                self._objects[name] = item
        for index, info in self._storage.items():
            if getattr(info, "transform_descriptors", None):
                raise MegatronCheckpointError(f"{index.fqn} is stored with transforms {info.transform_descriptors} "
                                              "(compressed?): only plain torch_dist storage is supported")
            file = self.folder / info.relative_path
            if Path(info.relative_path).name != info.relative_path or not file.is_file():
                raise MegatronCheckpointError(f"{self.folder} lacks {info.relative_path}, a shard the metadata lists "
                                              f"(it holds {index.fqn})")
            if info.offset + info.length > file.stat().st_size:
                raise MegatronCheckpointError(f"{file} is shorter than the metadata says ({index.fqn} ends at byte "
                                              f"{info.offset + info.length})")
        common = self.folder / "common.pt"
        bridge_config = self.folder / BRIDGE_CONFIG
        if common.is_file():
            state = safe_torch_load(str(common), str(common))
        else:
            keys = [k for k in self._objects if k.split("/")[0] == "common_state"]
            if not keys and not bridge_config.is_file():
                raise MegatronCheckpointError(f"{self.folder} has neither common.pt nor a common_state object: "
                                              "no model arguments")
            state = safe_torch_load(io.BytesIO(self._blob(keys[0])), f"{self.folder}'s common_state") if keys else {}
        if _has_args(state) or not bridge_config.is_file():
            self.args = self._args_of(state)
        else:  # Megatron-Bridge keeps no args in the checkpoint: its model provider's fields are in run_config.yaml
            self.args = bridge_args(bridge_config)
            self.saved_by = "Megatron-Bridge"

    def _entries(self, fqn: str):
        return [(index, info) for index, info in self._storage.items() if index.fqn == fqn]

    def _blob(self, fqn: str, index=None) -> bytes:
        for key, info in self._storage.items():
            if key.fqn == fqn and (index is None or key == index):
                with (self.folder / info.relative_path).open("rb") as handle:
                    handle.seek(info.offset)
                    return handle.read(info.length)
        raise MegatronCheckpointError(f"the checkpoint lists {fqn} but stores no bytes for it")

    def _read_dist(self, name: str) -> torch.Tensor:
        meta = self._tensors[name]
        out = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        covered = 0
        by_offset = {tuple(index.offset): (index, info) for index, info in self._entries(name)}
        for chunk in meta.chunks:
            found = by_offset.get(tuple(chunk.offsets))
            if found is None:
                raise MegatronCheckpointError(f"{name}: the chunk at {list(chunk.offsets)} is missing from the shards")
            value = safe_torch_load(io.BytesIO(self._blob(name, found[0])), f"{name} (chunk {list(chunk.offsets)})")
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(chunk.sizes):
                raise MegatronCheckpointError(f"{name}: the chunk at {list(chunk.offsets)} is not a tensor of shape "
                                              f"{list(chunk.sizes)}")
            region = tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))
            out[region] = value
            covered += value.numel()
        if covered != out.numel():
            raise MegatronCheckpointError(f"{name}: its chunks cover {covered} of {out.numel()} elements")
        return out

    # --- legacy ------------------------------------------------------------------------------------------------

    def _open_legacy(self, iteration: Path, ranks: list[str]) -> None:
        """Every ``mp_rank_<tp>[_<pp>][_<ep>]`` folder of the TP x PP x EP grid the args name (one missing or extra
        is an error): each stage's layers renumbered from their stage-local index to the global one, each
        expert-parallel rank's local experts to their global index (the non-expert tensors, which every
        expert-parallel rank holds, must agree), each tensor kept as its TP shards, merged when read (``read``)."""
        for name in ranks:
            if LEGACY_RANK.fullmatch(name) is None:
                raise MegatronCheckpointError(f"{iteration / name}: not a mp_rank_<tp:02d>[_<pp:03d>][_<ep:03d>] folder")
        first = sorted(ranks)[0] if ranks else None
        if first is None or not first.startswith("mp_rank_00"):
            raise MegatronCheckpointError(f"{iteration} lacks mp_rank_00 (or mp_rank_00_000), the first rank")
        states = {first: self._legacy_state(iteration / first / LEGACY_FILE)}
        self.args = self._args_of(states[first])
        tp = int(self.args.get("tensor_model_parallel_size", 1) or 1)
        pp = int(self.args.get("pipeline_model_parallel_size", 1) or 1)
        ep = int(self.args.get("expert_model_parallel_size", 1) or 1)
        etp = int(self.args.get("expert_tensor_parallel_size") or tp)
        experts = int(self.args.get("num_experts") or 0)
        remat = {key: int(self.args.get(key) or 1) for key in ("gtp_weight_remat_size", "expert_gtp_weight_remat_size")}
        if any(size != 1 for size in remat.values()):  # Megatron-LM's --tensor-parallel-num-weight-shards
            raise MegatronCheckpointError(f"{iteration}: a legacy checkpoint with weights sharded over data-parallel "
                                          f"ranks ({', '.join(f'{k} {v}' for k, v in remat.items())}; Transformer "
                                          "Engine's generalized tensor parallelism) is not read: which rank's file "
                                          "holds which shard is not verified by a fixture")
        # the args' sizes, bounded by the folders there are (one missing is named below)
        grid = max(tp, ep) if experts and etp != tp else tp * ep  # files a stage has at least
        if tp < 1 or pp < 1 or ep < 1 or etp < 1 or grid * pp > len(ranks) + 1:
            raise MegatronCheckpointError(f"{iteration} holds {len(ranks)} mp_rank folders; its args say tensor-parallel "
                                          f"size {tp} x pipeline-parallel size {pp} x expert-parallel size {ep}")
        # (tensor-parallel rank, expert-parallel rank) of each rank file -> the expert tensor-parallel rank of its
        # experts: the whole TP x EP grid when the experts are split like the dense layers, else the files the
        # ranks that save a legacy checkpoint write
        writers = _legacy_writers(self.args, tp, ep, etp, iteration) if experts and etp != tp else \
            {(t, e): t for t in range(tp) for e in range(ep)}
        expected = {(t, s, e): f"mp_rank_{t:02d}" + (f"_{s:03d}" if pp > 1 else "") + (f"_{e:03d}" if ep > 1 else "")
                    for t, e in writers for s in range(pp)}
        present = set(ranks)
        for folder in expected.values():
            if folder not in present:
                grid = f"mp_rank_00..{tp - 1:02d}" + (f" x _000..{pp - 1:03d}" if pp > 1 else "") + \
                    (f" x _000..{ep - 1:03d}" if ep > 1 else "") if etp == tp or not experts else \
                    f"{', '.join(sorted(expected.values()))} (those the saving ranks write)"
                raise MegatronCheckpointError(f"{iteration} lacks {folder}: the args say tensor-parallel size {tp} x "
                                              f"pipeline-parallel size {pp}" + (f" x expert-parallel size {ep}"
                                                                                if ep > 1 else "")
                                              + (f" (experts' tensor-parallel size {etp})" if etp != tp and experts
                                                 else "") + f", so {grid} must all be there")
        extra = sorted(present - set(expected.values()))
        if extra:
            raise MegatronCheckpointError(f"{iteration} holds {extra[0]}, outside the tensor-parallel size {tp} x "
                                          f"pipeline-parallel size {pp}" + (f" x expert-parallel size {ep}" if ep > 1
                                                                            else "") + " grid of its args")
        virtual = _virtual_stages(states[first], iteration / first / LEGACY_FILE, self.args)
        chunks = pipeline_chunks(self.args, pp, virtual)
        if experts and experts % ep:  # Megatron asserts it: each expert-parallel rank holds num_experts / EP
            raise MegatronCheckpointError(f"{iteration}: num_experts {experts} is not a multiple of the "
                                          f"expert-parallel size {ep} (each expert-parallel rank holds an equal share)")
        local_experts = experts // ep
        hidden = int(self.args.get("hidden_size") or 0)
        # the dense layers' shards by tensor-parallel rank, the experts' by expert tensor-parallel rank
        dense: list[dict[str, torch.Tensor]] = [{} for _ in range(tp)]
        expert: list[dict[str, torch.Tensor]] = [{} for _ in range(etp)]
        for (t, e), et in sorted(writers.items()):
            for s in range(pp):
                folder = expected[(t, s, e)]
                path = iteration / folder / LEGACY_FILE
                state = states.pop(folder, None) or self._legacy_state(path)
                stage = self._stage_model(state, path, s, chunks[s])
                for name, value in _split_grouped_mlp(stage, local_experts, hidden, path).items():
                    name = _global_expert(name, e, local_experts, path) if ep > 1 else name
                    merged = expert[et] if parse_legacy_expert(name) else dense[t]
                    if name in merged and not torch.equal(merged[name], value):
                        raise MegatronCheckpointError(f"{name} differs between the pipeline stages or "
                                                      f"expert-parallel ranks of tensor-parallel rank {t}")
                    merged[name] = value
        self._shards: dict[str, list[torch.Tensor]] = {}
        for what, ranks_ in (("tensor-parallel", dense), ("expert tensor-parallel", expert)):
            for rank, merged in enumerate(ranks_):
                if rank and set(merged) != set(ranks_[0]):
                    odd = sorted(set(merged) ^ set(ranks_[0]))[0]
                    raise MegatronCheckpointError(f"{what} rank {rank} and rank 0 hold different tensors ({odd})")
                for name, value in merged.items():
                    self._shards.setdefault(name, []).append(value)
        self.tensor_parallel = tp

    @staticmethod
    def _legacy_state(path: Path):
        if not path.is_file():
            raise MegatronCheckpointError(f"{path} is missing")
        # mapped, not loaded: a rank's file is read tensor by tensor as the conversion reads them (the page cache
        # holds what was read), so a checkpoint of several ranks is not held in memory at once
        # torch maps only its zip format (torch.save since 1.6); a file of the older format is loaded whole
        state = safe_torch_load(str(path), str(path), mmap=zipfile.is_zipfile(path))
        if not isinstance(state, dict) or not (isinstance(state.get("model"), dict) or
                                               isinstance(state.get("model0"), dict)):
            raise MegatronCheckpointError(f"{path} holds no 'model' state dict (nor model0, model1... of virtual "
                                          "pipeline stages)")
        return state

    @staticmethod
    def _stage_model(state, path: Path, stage: int, chunks: list[tuple[int, int]]) -> dict[str, torch.Tensor]:
        """A stage's tensors with their global layer numbers: each of its model chunks (``model``, or ``model0``,
        ``model1``... with virtual pipelines) numbers its layers from 0; a chunk holding other than the layers
        ``chunks`` gives it is an error."""
        keys = ["model"] if len(chunks) == 1 else [f"model{v}" for v in range(len(chunks))]
        out = {}
        for key, (start, count) in zip(keys, chunks):
            model = state.get(key)
            if not isinstance(model, dict):
                raise MegatronCheckpointError(f"{path} lacks {key}, the state of model chunk {key[5:] or 0} of "
                                              f"{len(chunks)}")
            seen = set()
            for name, value in model.items():
                if not isinstance(value, torch.Tensor) or "_extra_state" in name:
                    continue
                if name.startswith("decoder.layers."):
                    index, _, rest = name[len("decoder.layers."):].partition(".")
                    if not index.isdigit() or int(index) >= count >= 0:
                        raise MegatronCheckpointError(f"{path}: {key}'s {name} is outside the {count} layers the "
                                                      f"args give pipeline stage {stage}"
                                                      + (f", chunk {key[5:]}" if len(chunks) > 1 else ""))
                    seen.add(int(index))
                    name = f"decoder.layers.{start + int(index)}.{rest}"
                if name in out:
                    raise MegatronCheckpointError(f"{path}: {name} is held by two model chunks")
                out[name] = value
            if len(seen) != count >= 0:
                raise MegatronCheckpointError(f"{path}: {key} holds {len(seen)} layers, the args give pipeline stage "
                                              f"{stage}" + (f", chunk {key[5:]}," if len(chunks) > 1 else "")
                                              + f" {count} (layers {start}..{start + count - 1})")
        return out

    # --- common ------------------------------------------------------------------------------------------------

    @staticmethod
    def _args_of(state) -> dict:
        if isinstance(state, list) and state and isinstance(state[0], dict):  # newer Megatron: one per rank
            state = state[0]
        args = state.get("args") if isinstance(state, dict) else None
        if isinstance(args, argparse.Namespace):
            return vars(args)
        if isinstance(args, dict):
            return args
        raise MegatronCheckpointError("the checkpoint's common state has no 'args' (Megatron-LM's arguments)")

    def names(self) -> list[str]:
        return list(self._tensors) if self.format == "torch_dist" else list(self._shards)

    def info(self, name: str) -> TensorInfo:
        if self.format == "torch_dist":
            meta = self._tensors[name]
            return TensorInfo(name, tuple(meta.size), meta.properties.dtype)
        shards = self._shards[name]
        shape = list(shards[0].shape)
        axis = tensor_parallel_axis(name) if len(shards) > 1 else None
        if axis is not None:
            shape[axis] = sum(shard.shape[axis] if shard.dim() > axis else 0 for shard in shards)
        return TensorInfo(name, tuple(shape), shards[0].dtype)

    def has(self, name: str) -> bool:
        return name in (self._tensors if self.format == "torch_dist" else self._shards)

    def read(self, name: str) -> torch.Tensor:
        if self.format == "torch_dist":
            return self._read_dist(name)
        shards = self._shards[name]
        return shards[0] if len(shards) == 1 else merge_tensor_parallel(name, shards, self.blocks.get(name))


def _legacy_writers(args: dict, tp: int, ep: int, etp: int, iteration: Path) -> dict[tuple[int, int], int]:
    """``{(tensor-parallel rank, expert-parallel rank): expert tensor-parallel rank}`` of the rank files a legacy
    checkpoint holds when the experts' tensor-parallel size ``etp`` differs from the dense layers' ``tp``: Megatron-LM's
    ``save_checkpoint`` has every rank of data-parallel rank 0 (in the data-parallel group without the
    context-parallel ranks: every CP rank of it writes, the same replica) or of expert-data-parallel rank 0 write
    ``mp_rank_<tp>[_<pp>][_<ep>]`` (named by its dense TP rank and its expert-parallel rank), and
    ``initialize_model_parallel`` numbers the ranks of a pipeline stage ``tp-cp-dp`` (dense) and ``etp-ep-edp``
    (experts), the first fastest. The tp-pp-dp order (``use_tp_pp_dp_mapping``: ``tp-cp-ep-pp-dp``) numbers them
    alike: with PP > 1 Megatron asserts the experts' data-parallel size equal to the dense one, so the pipeline rank
    takes the same place in both numberings, and with PP = 1 the orders are one. Two ranks writing one file with
    different expert shards (``etp`` > ``tp``: the format then keeps one of them) is an error."""
    pp = int(args.get("pipeline_model_parallel_size") or 1)
    cp = int(args.get("context_parallel_size") or 1)
    # Megatron-LM's data_parallel_size is world_size / (TP x PP x CP)
    dp = int(args.get("data_parallel_size") or 0) or int(args.get("world_size") or 0) // max(1, tp * pp * cp)
    stage = tp * cp * dp  # ranks in a pipeline stage
    if cp < 1 or dp < 1 or stage > 1 << 20 or stage % (etp * ep):
        raise MegatronCheckpointError(f"the args' data-parallel size {dp} x context-parallel size {cp} x tensor-parallel "
                                      f"size {tp} is no multiple of the experts' tensor-parallel size {etp} x "
                                      f"expert-parallel size {ep}")
    if args.get("use_tp_pp_dp_mapping") and pp > 1 and etp * ep != tp * cp:
        raise MegatronCheckpointError(f"the args' tp-pp-dp rank order with pipeline-parallel size {pp} needs the "
                                      f"experts' tensor- x expert-parallel size ({etp} x {ep}) equal to the tensor- x "
                                      f"context-parallel size ({tp} x {cp}), as Megatron asserts: no Megatron run "
                                      "saved these args")
    writers: dict[tuple[int, int], int] = {}
    for rank in range(stage):
        t, d = rank % tp, rank // (tp * cp)
        et, e, ed = rank % etp, (rank // etp) % ep, rank // (etp * ep)
        if d and ed:
            continue
        if writers.setdefault((t, e), et) != et:
            raise MegatronCheckpointError(f"{iteration}: expert tensor-parallel size {etp} > tensor-parallel size {tp}: "
                                          f"ranks of expert tensor-parallel ranks {writers[(t, e)]} and {et} both write "
                                          f"mp_rank_{t:02d}, so the legacy format kept only one of their expert shards")
    return writers


def _split_grouped_mlp(tensors: dict[str, torch.Tensor], local: int, hidden: int, path: Path) \
        -> dict[str, torch.Tensor]:
    """A rank's tensors with the old ``GroupedMLP``'s ``experts.weight1`` / ``weight2`` (megatron-core <= 0.16,
    ``--moe-grouped-gemm`` without Transformer Engine) cut into one tensor per local expert, as ``TEGroupedMLP``
    names them (``linear_fc1.weight<i>`` ``[2I/TP, H]``, ``linear_fc2.weight<i>`` ``[H, I/TP]``), so the TP
    merge and the expert-parallel renumbering read them like any other. ``GroupedMLP`` keeps ``weight1`` as ``[H,
    local · 2I/TP]`` but computes with its memory viewed as ``[local, H, 2I/TP]`` (its ``forward``: ``w1 =
    weight1.view(num_local_experts, hidden_size, -1)``, then ``x @ w1[e]``, the GLU's gate the first half of the
    columns) and ``weight2`` as ``[local · I/TP, H]`` viewed as ``[local, I/TP, H]``: expert i's ``linear_fc1`` is
    ``w1[i].T`` (its rank's ``[gate; up]`` rows) and its ``linear_fc2`` ``w2[i].T``, as its ``sharded_state_dict``
    maps them onto ``SequentialMLP``'s layout."""
    out = {}
    for name, value in tensors.items():
        match = re.fullmatch(r"(.*\.mlp\.experts\.)weight([12])", name)
        if match is None:
            out[name] = value
            continue
        if local < 1 or hidden < 1 or value.dim() != 2 or value.numel() % (local * hidden):
            raise MegatronCheckpointError(f"{path}: {name} {list(value.shape)} is no GroupedMLP weight of {local} "
                                          f"local experts of hidden size {hidden}")
        stacked = value.reshape(local, hidden, -1) if match[2] == "1" else value.reshape(local, -1, hidden)
        for i in range(local):
            out[expert_names(match[1], f"linear_fc{match[2]}.weight", i)[1]] = stacked[i].t()
    return out


def _virtual_stages(state: dict, path: Path, args: dict) -> int:
    """The model chunks a legacy rank file holds: ``model`` (1) or ``model0`` .. ``model<V-1>`` (Megatron-LM's
    ``generate_state_dict`` with V virtual pipeline stages), which must be the args'
    ``virtual_pipeline_model_parallel_size``."""
    found = sum(1 for key in state if re.fullmatch(r"model\d+", str(key)))
    chunks = 1 if "model" in state else found
    if found if "model" in state else any(f"model{v}" not in state for v in range(chunks)):
        raise MegatronCheckpointError(f"{path} holds model chunks {sorted(k for k in state if str(k).startswith('model'))}"
                                      ": expected 'model' or model0..model<V-1>")
    stated = int(args.get("virtual_pipeline_model_parallel_size") or 1)
    if chunks != stated:
        raise MegatronCheckpointError(f"{path} holds {chunks} model chunk(s) but the args say "
                                      f"virtual_pipeline_model_parallel_size {stated}")
    return chunks


def _global_expert(name: str, rank: int, local: int, path: Path) -> str:
    """A legacy expert tensor's name with its expert-parallel rank's local index made global (``rank · local + i``);
    other names unchanged. A local index outside the rank's ``local`` experts is an error."""
    expert = parse_legacy_expert(name)
    if expert is None:
        return name
    if expert.index >= local:
        raise MegatronCheckpointError(f"{path}: {name} is outside the {local} experts of an expert-parallel rank")
    return expert.name(rank * local + expert.index)


def _layout_layers(layout: str) -> list[int]:
    """The decoder layers (``t``) of each stage of a ``pipeline_model_parallel_layout`` string, as Megatron's
    ``PipelineParallelLayerLayout.parse_str_to_list`` reads it: commas dropped, ``(…)*n`` and ``x*n`` unrolled, stages
    split at ``|``, each stage of ``E`` (embedding), ``t`` (decoder layer), ``m`` (MTP layer), ``L`` (loss)."""
    text = str(layout).replace(",", "")
    if len(text) > 4096:
        raise MegatronCheckpointError(f"pipeline_model_parallel_layout of {len(text)} characters")
    limit = 1 << 20  # characters once unrolled: a million layers

    def unroll(match: re.Match) -> str:
        size[0] += len(match.group(1)) * (int(match.group(2)) - 1)
        if size[0] > limit:
            raise MegatronCheckpointError("pipeline_model_parallel_layout unrolls to over a million layers")
        return match.group(1) * int(match.group(2))

    for pattern in (r"\(([^)]+)\)\*(\d{1,7})", r"(.)\*(\d{1,7})"):
        size = [len(text)]  # the length the text grows to, counted before each repetition is made
        text = re.sub(pattern, unroll, text)
    stages = text.split("|")
    for stage in stages:
        if set(stage) - set("Etm L"):
            raise MegatronCheckpointError(f"pipeline_model_parallel_layout {str(layout)[:80]!r}: stage {stage[:40]!r} "
                                          "holds other than E, t, m, L")
    return [stage.count("t") for stage in stages]


def _chunk_counts(args: dict, stages: int, virtual: int, layers: int, hybrid: bool) -> list[int]:
    """The decoder layers of each model chunk, in the order Megatron numbers them (chunk v of every stage, then
    chunk v + 1: index ``v * stages + s``), by Megatron's rules: a HybridModel's ``select_pipeline_segment`` (the
    pattern's ``|`` segments, or its layers split over the stages, the first / last stage's count given), a
    GPTModel's ``pipeline_model_parallel_layout`` or ``get_num_layers_to_build`` (even, uneven first / last stage,
    the embedding and the loss counted as a layer each)."""
    first = args.get("decoder_first_pipeline_num_layers", args.get("num_layers_in_first_pipeline_stage"))
    last = args.get("decoder_last_pipeline_num_layers", args.get("num_layers_in_last_pipeline_stage"))
    first, last = (None if n is None else int(n) for n in (first, last))
    layout = None if hybrid else args.get("pipeline_model_parallel_layout")
    chunks = stages * virtual
    where = f"{stages} pipeline stages" + (f" of {virtual} virtual stages" if virtual > 1 else "")
    if layout is not None:
        counts = _layout_layers(layout)
        if len(counts) != chunks:
            raise MegatronCheckpointError(f"pipeline_model_parallel_layout {str(layout)[:80]!r} has {len(counts)} "
                                          f"stages, the checkpoint {where}")
        return counts
    if first is not None or last is not None:
        if hybrid and virtual > 1:
            raise MegatronCheckpointError("uneven pipeline stages with virtual stages in a HybridModel (Megatron "
                                          "needs '|' in the pattern for virtual stages)")
        given = [n for n in (first, last) if n is not None]
        middle_stages = stages - len(given)
        if middle_stages < 0 or (virtual > 1 and middle_stages == 0 and len(given) == 2):
            # one stage given both sizes: Megatron's TransformerConfig refuses it; virtual stages with no middle
            # stage: its get_transformer_layer_offset divides by the 0 middle stages (no run saves either)
            raise MegatronCheckpointError(f"{first} layers on the first pipeline stage and {last} on the last with "
                                          f"{where}: Megatron cannot place them (no middle stage)")
        middle = layers - sum(given)
        if any(n <= 0 or n % virtual for n in given) or middle < 0 or (middle_stages == 0) != (middle == 0) or \
                (middle_stages and middle % (middle_stages * virtual)):
            raise MegatronCheckpointError(f"{layers} layers cannot be split over {where} with {first} layers on the "
                                          f"first stage and {last} on the last (as Megatron would refuse)")
        per_stage = [middle // middle_stages if middle_stages else 0] * stages
        if first is not None:
            per_stage[0] = first
        if last is not None:
            per_stage[-1] = last
        return [per_stage[s] // virtual for v in range(virtual) for s in range(stages)]
    embedding = not hybrid and bool(args.get("account_for_embedding_in_pipeline_split"))
    loss = not hybrid and bool(args.get("account_for_loss_in_pipeline_split"))
    total = layers + embedding + loss
    if total % (stages * virtual):
        raise MegatronCheckpointError(f"cannot tell which of the {layers} layers each of the {where} holds (no '|' "
                                      "in the layer pattern, no uneven stage sizes, and no even split)")
    counts = [total // chunks] * chunks
    counts[0] -= embedding  # the embedding counted as a layer of the first chunk, the loss of the last
    counts[-1] -= loss
    return counts


def pipeline_chunks(args: dict, stages: int, virtual: int = 1) -> list[list[tuple[int, int]]]:
    """``[stage][chunk] = (first global layer, layer count)`` of each pipeline stage's model chunks (a legacy rank
    file numbers each chunk's layers from 0; virtual pipelines hold several chunks, ``model0``, ``model1``...), as
    Megatron lays them out: chunk v of stage s holds the ``v * stages + s``-th run of layers (its
    ``select_pipeline_segment``, ``get_transformer_layer_offset`` and ``PipelineParallelLayerLayout`` all number
    them so), each run's length by ``_chunk_counts``. A split that does not add up to the model's layers is an
    error."""
    pattern = args.get("hybrid_layer_pattern") or args.get("hybrid_override_pattern") or ""
    main = pattern.split("/")[0]
    hybrid = bool(pattern)
    layers = len(main.replace("|", "")) if hybrid else int(args.get("num_layers") or 0)
    if stages == 1 and virtual == 1:
        return [[(0, layers if layers else -1)]]  # -1: not known from the args, not checked
    if "|" in main:
        counts = [len(segment) for segment in main.split("|")]
        if args.get("decoder_first_pipeline_num_layers") or args.get("decoder_last_pipeline_num_layers"):
            raise MegatronCheckpointError("uneven pipeline stage sizes and '|' in the layer pattern (Megatron "
                                          "refuses both)")
        if len(counts) != stages * virtual:
            raise MegatronCheckpointError(f"layer pattern {pattern!r} has {len(counts)} pipeline segments but the "
                                          f"checkpoint has {stages} pipeline stages" +
                                          (f" of {virtual} virtual stages" if virtual > 1 else ""))
    else:
        if not layers:
            raise MegatronCheckpointError("the args give no layer count (num_layers or a layer pattern)")
        if hybrid and virtual > 1:
            raise MegatronCheckpointError(f"{virtual} virtual pipeline stages but no '|' in the layer pattern "
                                          f"{pattern!r} (Megatron's HybridModel needs them to place the stages)")
        counts = _chunk_counts(args, stages, virtual, layers, hybrid)
    if sum(counts) != layers or min(counts) < 0:
        raise MegatronCheckpointError(f"the pipeline split {counts} of the args does not hold the model's {layers} "
                                      "layers")
    starts = [0, *itertools.accumulate(counts[:-1])]
    return [[(starts[v * stages + s], counts[v * stages + s]) for v in range(virtual)] for s in range(stages)]


# How Megatron's parallel layers split a tensor over tensor-parallel ranks (by the parameter's name):
# ColumnParallelLinear / VocabParallelEmbedding and the mixers' per-head parameters on axis 0, RowParallelLinear on
# axis 1, norms replicated. A fused projection (packed in_proj, conv1d, SwiGLU linear_fc1) is split per part: each
# rank holds its slice of every part, so its rows are merged through the block layout the model's arguments give.
# Biases (add_bias_linear, LayerNorm): a ColumnParallelLinear's split as its output rows, a RowParallelLinear's
# (added after the all-reduce) and a norm's replicated.
_ROW_PARALLEL = ("out_proj.weight", "linear_proj.weight", "linear_fc2.weight")
_COLUMN_PARALLEL = ("word_embeddings.weight", "output_layer.weight", "linear_qkv.weight", "linear_qkv.bias", "A_log",
                    "dt_bias", "in_proj.weight", "conv1d.weight", "conv1d.bias", "conv1d_weight", "conv1d_bias",
                    "mixer.D", "linear_fc1.weight", "linear_fc1.bias", "mixer.norm.weight")
_REPLICATED = ("layer_norm_weight", "layernorm.weight", "final_norm.weight", "out_norm.weight", "norm.weight",
               "layer_norm_bias", "norm.bias", "linear_proj.bias", "linear_fc2.bias",
               "router.weight", "router.bias", "router.expert_bias", "gate_weight")
_BLOCKED = ("in_proj.weight", "conv1d.weight", "conv1d.bias", "conv1d_weight", "conv1d_bias")


def tensor_parallel_axis(name: str) -> int | None:
    """The axis Megatron splits ``name`` over tensor-parallel ranks, None when it is replicated."""
    expert = parse_legacy_expert(name)
    if expert is not None and expert.grouped:  # TEGroupedMLP's per-expert linear_fc1.weight<e> / bias<e>
        name = expert.unnumbered
    if name.endswith(_ROW_PARALLEL):
        return 1
    if name.endswith(_COLUMN_PARALLEL):
        return 0
    if name.endswith(_REPLICATED):
        return None
    raise MegatronCheckpointError(f"{name}: how Megatron splits it over tensor-parallel ranks is not known here "
                                  "(only the layers gdn_export reads)")


def merge_tensor_parallel(name: str, shards: list[torch.Tensor], blocks: list[int] | None) -> torch.Tensor:
    """The global tensor from its TP shards, in rank order; ``blocks`` = the global sizes of the parts of a fused
    projection (each rank holding 1/TP of every part, in part order)."""
    axis, ranks = tensor_parallel_axis(name), len(shards)
    first = shards[0]
    if any(shard.dim() != first.dim() or shard.dtype != first.dtype for shard in shards):
        raise MegatronCheckpointError(f"{name}: its tensor-parallel shards differ in rank or dtype")
    if axis is None:
        if any(not torch.equal(shard, first) for shard in shards[1:]):
            raise MegatronCheckpointError(f"{name} is replicated over tensor-parallel ranks but its copies differ")
        return first
    if any(shard.shape[:axis] + shard.shape[axis + 1:] != first.shape[:axis] + first.shape[axis + 1:]
           or shard.shape[axis] != first.shape[axis] for shard in shards):
        raise MegatronCheckpointError(f"{name}: tensor-parallel shards of unequal shapes "
                                      f"{[list(s.shape) for s in shards]}")
    if blocks is None:
        expert = parse_legacy_expert(name)
        if name.endswith(_BLOCKED) or (expert is not None and expert.tensor.startswith("linear_fc1.")):
            raise MegatronCheckpointError(f"{name}: a fused projection without a known part layout")
        return torch.cat(shards, dim=axis)
    if any(size % ranks for size in blocks) or sum(blocks) != first.shape[0] * ranks:
        raise MegatronCheckpointError(f"{name}: {ranks} shards of {first.shape[0]} rows cannot hold parts "
                                      f"{blocks} split evenly over {ranks} tensor-parallel ranks")
    local = [size // ranks for size in blocks]
    parts = [shard.split(local, dim=0) for shard in shards]
    return torch.cat([parts[r][p] for p in range(len(blocks)) for r in range(ranks)], dim=0)


Piece = tuple[str, object]  # (checkpoint tensor, the rows taken from it: a slice, a list of row indices, or None)


@dataclass
class MegatronSource:
    """One model parameter's value: the rows ``pieces`` name (whole tensors, a section of a fused projection, the
    query rows of every group of ``linear_qkv``) concatenated on the first axis and reshaped to ``shape``; the
    interface of ``hf.tensors.TensorEntry`` (``name``, ``dtype``, ``shape``, ``nbytes``, ``read``, ``rows``)."""

    checkpoint: MegatronCheckpoint
    pieces: list[Piece]
    shape: tuple[int, ...]
    offset: float = 0.0  # added to every value: 1 for a zero-centred norm weight (Megatron computes with 1 + w)
    _whole: np.ndarray | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        first = self.pieces[0][0]
        return first if len(self.pieces) == 1 and self.pieces[0][1] is None else f"{first} (+{len(self.pieces) - 1})"

    @property
    def dtype(self) -> str:
        return TORCH_DTYPES.get(self.checkpoint.info(self.pieces[0][0]).dtype, "F32")

    @property
    def nbytes(self) -> int:
        bits = torch.finfo(self.checkpoint.info(self.pieces[0][0]).dtype).bits
        return int(np.prod(self.shape, dtype=np.int64)) * bits // 8

    def read(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        parts = []
        for tensor, rows in self.pieces:
            value = self.checkpoint.read(tensor)
            parts.append(value if rows is None else value[rows])
        value = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        if value.numel() != int(np.prod(self.shape, dtype=np.int64)):
            raise MegatronCheckpointError(f"{self.name}: {list(value.shape)} in the checkpoint, {list(self.shape)} "
                                          "expected from the model's arguments")
        if self.offset:
            return (value.reshape(self.shape).float() + self.offset).to(dtype)
        return value.reshape(self.shape).to(dtype)

    def rows(self, start: int, stop: int, target: np.dtype) -> np.ndarray:
        """Rows ``start:stop`` as ``target``, flat: the whole value is read once (a .distcp item is one
        ``torch.save`` blob) and kept until ``release``, as the writers read a slice of rows at a time."""
        if self._whole is None or self._whole.dtype != np.dtype(target):
            dtype = {np.dtype(np.float32): torch.float32, np.dtype(np.float16): torch.float16}[np.dtype(target)]
            self._whole = self.read(dtype).numpy()
        return self._whole[start:stop].reshape(-1)

    def release(self) -> None:
        self._whole = None

