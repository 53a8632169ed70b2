"""A checkpoint's safetensors tensors, indexed from the file headers and read one at a time from memory maps.

Nothing here loads a whole checkpoint: ``TensorIndex`` reads only the headers (names, dtypes, shapes, byte
ranges) of every file, one file or shards through ``model.safetensors.index.json``, and checks them against
each other; a tensor's bytes are read when asked (``TensorEntry.read``), or copied into an NNEF ``.dat`` file
in slices of rows (``TensorEntry.write_nnef``), cast on the way: tract has no bfloat16, and a bfloat16 value
widens to float32 exactly (its 16 bits are the top half of the float32).
"""

from __future__ import annotations

import json
import mmap
import os
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable, Iterator

import numpy as np
import torch

from gdn_export.errors import GdnExportError
from gdn_export.weights.encoding import write_array

INDEX_FILE = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# safetensors dtype -> numpy dtype of its raw items (bfloat16 read as uint16 and widened)
SOURCE_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}
TORCH_TO_NUMPY = {torch.float32: np.float32, torch.float16: np.float16}
SLICE_BYTES = 64 << 20  # a .dat is written in slices of rows of about this size


class CheckpointError(GdnExportError):
    """The checkpoint folder is missing, malformed, unsupported or inconsistent."""


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's bytes lie: ``path`` from byte ``begin`` (absolute) to ``end``."""

    name: str
    path: Path
    dtype: str  # safetensors' name: F32, F16, BF16
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    def rows(self, start: int, stop: int, target: np.dtype) -> np.ndarray:
        """Rows ``start:stop`` (of the first axis) as ``target``, read through a memory map of just those bytes."""
        row = self.numel // self.shape[0] if self.shape and self.shape[0] else self.numel
        item = np.dtype(SOURCE_DTYPES[self.dtype]).itemsize
        offset = self.begin + start * row * item
        length = (stop - start) * row * item if self.shape else item
        if length == 0:
            return np.empty(0, target)
        aligned = offset - offset % mmap.ALLOCATIONGRANULARITY
        with self.path.open("rb") as handle, \
                mmap.mmap(handle.fileno(), length + offset - aligned, offset=aligned, access=mmap.ACCESS_READ) as view:
            raw = np.frombuffer(view, SOURCE_DTYPES[self.dtype], count=length // item, offset=offset - aligned)
            if self.dtype == "BF16":  # widened in one pass (astype then shift made two copies: 5x slower)
                values = np.left_shift(raw, 16, out=np.empty(raw.shape, np.uint32), dtype=np.uint32).view(np.float32)
            else:
                values = raw.copy()
            del raw  # the map closes only once no array views it
        return values.astype(target, copy=False)

    def read(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The whole tensor in ``dtype`` (float32 or float16)."""
        values = self.rows(0, self.shape[0] if self.shape else 1, np.dtype(TORCH_TO_NUMPY[dtype]))
        return torch.from_numpy(values.reshape(self.shape))


def write_nnef_rows(file: BinaryIO, shape: tuple[int, ...], target: np.dtype,
                    read_rows: Callable[[int, int], np.ndarray]) -> None:
    """An NNEF tensor file of ``shape`` in ``target``, its values read a slice of the first axis at a time
    (``read_rows(start, stop)``: those rows in ``target``): memory stays at one slice of about ``SLICE_BYTES``."""
    shape = tuple(shape)
    write_nnef_header(file, shape, target)
    rows = shape[0] if shape else 1
    row_bytes = max(1, int(np.prod(shape[1:], dtype=np.int64)) if shape else 1) * 4
    step = max(1, SLICE_BYTES // row_bytes)
    for start in range(0, rows, step):
        write_array(file, np.ascontiguousarray(read_rows(start, min(rows, start + step)), dtype=target))


def write_nnef_array(file: BinaryIO, value: np.ndarray) -> None:
    """A float array as a whole NNEF tensor file (header, then its values)."""
    write_nnef_header(file, value.shape, value.dtype)
    write_array(file, value)


def write_nnef_header(file: BinaryIO, shape: tuple[int, ...], dtype: np.dtype) -> None:
    """The 128-byte header of an NNEF tensor file (the layout ``nnef.write_tensor`` writes) for a float tensor."""
    if len(shape) > 8:
        raise GdnExportError(f"an NNEF tensor has at most 8 axes, got shape {shape}")
    count = int(np.prod(shape, dtype=np.int64))
    header = np.zeros(32, np.uint32)
    header[0] = np.frombuffer(bytes([0x4E, 0xEF, 1, 0]), np.uint32)[0]
    header[1], header[2] = count * dtype.itemsize, len(shape)
    header[3 : 3 + len(shape)] = shape
    header[11], header[12] = dtype.itemsize * 8, 0  # bits per item, item type 0: float
    file.write(header.tobytes())


class TensorIndex:
    """Every tensor of a checkpoint folder by name, from the safetensors headers; checked on construction:
    whole files, a consistent index (each shard present and holding what the index says), no tensor twice,
    only float32/float16/bfloat16 tensors."""

    def __init__(self, checkpoint_dir: str | os.PathLike) -> None:
        self.folder = Path(checkpoint_dir)
        files = sorted(self.folder.glob("*.safetensors"))
        index = self._read_index(files)
        if not files:
            pickles = sorted(p.name for p in self.folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
            if pickles:
                raise CheckpointError(
                    f"{self.folder} holds only pickle weights ({', '.join(pickles)}); gdn_export reads safetensors "
                    "only (pickle files can run code when loaded). Convert them to safetensors first.")
            raise CheckpointError(f"{self.folder} has no *.safetensors weights")
        self.entries: dict[str, TensorEntry] = {}
        for path in files:
            if index is not None and path.name not in set(index.values()):
                continue  # a file the index does not name is not part of this checkpoint (transformers ignores it)
            for entry in _header_entries(path):
                if entry.name in self.entries:
                    raise CheckpointError(f"tensor {entry.name} appears in both {self.entries[entry.name].path.name} "
                                          f"and {path.name}")
                self.entries[entry.name] = entry
        if index is not None:
            self._match_index(index)

    def _read_index(self, files: list[Path]) -> dict[str, str] | None:
        path = self.folder / INDEX_FILE
        if not path.is_file():
            return None
        try:
            weight_map = json.loads(path.read_text())["weight_map"]
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise TypeError
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError, KeyError, TypeError):
            raise CheckpointError(f"{path} is not a valid safetensors index (expected JSON with a weight_map)") from None
        shards = sorted(set(weight_map.values()))
        missing = [name for name in shards if not (self.folder / name).is_file()]
        if missing:
            raise CheckpointError(f"{self.folder} is missing {len(missing)} of the {len(shards)} shards named in "
                                  f"{INDEX_FILE}: {', '.join(missing[:3])}" + (" ..." if len(missing) > 3 else ""))
        return weight_map

    def _match_index(self, weight_map: dict[str, str]) -> None:
        for name, shard in weight_map.items():
            entry = self.entries.get(name)
            if entry is None or entry.path.name != shard:
                found = f"it is in {entry.path.name}" if entry is not None else "no shard holds it"
                raise CheckpointError(f"{INDEX_FILE} puts tensor {name} in {shard}, but {found}")
        extra = sorted(set(self.entries) - set(weight_map))
        if extra:
            raise CheckpointError(f"{self.entries[extra[0]].path.name} holds tensor {extra[0]}, which {INDEX_FILE} "
                                  f"does not list" + (f" (+{len(extra) - 1} more)" if len(extra) > 1 else ""))

    def __iter__(self) -> Iterator[TensorEntry]:
        return iter(self.entries.values())

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())


MAX_HEADER_BYTES = 100_000_000  # the safetensors library's bound on a header


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _header_entries(path: Path) -> list[TensorEntry]:
    """The tensors a safetensors file's header declares, checked as the safetensors library checks them: a header
    of at most 100 MB that is a JSON object, every entry a known dtype, a shape of sizes >= 0 and byte offsets that
    match it, and the data offsets, sorted, contiguous from 0 to the end of the file (no overlap, no gap, nothing
    outside it)."""
    size = path.stat().st_size
    with path.open("rb") as handle:
        head = handle.read(8)
        header_len = int.from_bytes(head, "little") if len(head) == 8 else -1
        if header_len < 0 or 8 + header_len > size:
            raise CheckpointError(f"{path.name} is truncated or not a safetensors file (no complete header)")
        if header_len > MAX_HEADER_BYTES:
            raise CheckpointError(f"{path.name}: its safetensors header claims {header_len} bytes, more than the "
                                  f"{MAX_HEADER_BYTES} the format allows")
        try:
            header = json.loads(handle.read(header_len))
            if not isinstance(header, dict):
                raise TypeError
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError, TypeError):
            raise CheckpointError(f"{path.name} has a malformed safetensors header") from None
    start = 8 + header_len
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
            if not (isinstance(shape, list) and all(_is_count(d) for d in shape) and isinstance(offsets, list)
                    and len(offsets) == 2 and all(_is_count(o) for o in offsets)):
                raise TypeError
            shape, (begin, end) = tuple(shape), offsets
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path.name}: tensor {name} has a malformed header entry (expected dtype, a shape "
                                  "of sizes >= 0 and data_offsets [begin, end] >= 0)") from None
        if dtype not in SOURCE_DTYPES:
            raise CheckpointError(f"{path.name}: tensor {name} is {dtype}; gdn_export reads F32, F16 and BF16 weights")
        expected = int(np.prod(shape, dtype=object)) * np.dtype(SOURCE_DTYPES[dtype]).itemsize
        if end - begin != expected:
            raise CheckpointError(f"{path.name}: tensor {name} of shape {list(shape)} {dtype} needs {expected} bytes, "
                                  f"its header gives {end - begin}")
        if start + end > size:
            raise CheckpointError(f"{path.name} is truncated: its header needs {end} bytes of data for {name}, the file "
                                  f"has {size - start}")
        entries.append(TensorEntry(name, path, dtype, shape, start + begin, start + end))
    covered = 0  # the data section, tensor after tensor in offset order
    for entry in sorted(entries, key=lambda e: (e.begin, e.end)):
        if entry.begin != start + covered:
            what = "overlaps the tensor before it" if entry.begin < start + covered else "leaves a gap before it"
            raise CheckpointError(f"{path.name}: tensor {entry.name}'s data (offsets {entry.begin - start}-"
                                  f"{entry.end - start}) {what}: its tensors' data must be contiguous and "
                                  "non-overlapping, as the safetensors format requires")
        covered = entry.end - start
    if start + covered != size:
        raise CheckpointError(f"{path.name}: its tensors' data ends at byte {covered} of a data section of "
                              f"{size - start} bytes (the safetensors format has nothing after the last tensor)")
    return entries
