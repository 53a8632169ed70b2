"""``Session``: prefill and decode through an exported model in tract, carrying every state between calls."""

from __future__ import annotations

import functools
import os
import time
from pathlib import Path
from typing import Callable

import numpy as np

from gdn_export.errors import GdnExportError
from gdn_export.run.archive import first_line, json_member, read_metadata, text_member
from gdn_export.run.runtime import load_tract_model, run_tract_tensors
from gdn_export.run.runtime import steady_allocator as keep_buffers_mapped
from gdn_export.targets import numpy_dtype



class Session:
    """An exported gdn_export language model, run in tract.

    ``prefill(input_ids [B, S]) -> logits [B, S, vocab]`` (``[B, 1, vocab]``, the last position's, for an archive
    converted with ``logits="last"``) and ``decode(input_ids [B, 1]) -> logits [B, 1, vocab]``
    both continue from the states the previous call left (conv and recurrent states of GDN layers, key and
    value caches of attention layers); ``reset()`` starts over. The batch size is fixed by the first call
    after a reset. ``progress(message)``, when given, is told when tract starts loading and planning the model (the
    user waits meanwhile: seconds at the 0.8B shape) and how long it took (also ``load_seconds``).

    Speed choices, each exact (the states carry between calls):
    - the model is planned for the batch size of the first call after a reset (tract's symbol ``B`` fixed):
      ops over a symbolic batch skip tract's fast kernels (a GDN decode step measured 1.9 ms against 0.5 ms);
      a later reset to another batch size plans the model again;
    - ``prefill_piece`` (default 128 tokens; None: one call) splits a long prompt into calls of that many
      tokens: tract's matmuls over 512 tokens at once measured 1.5x slower per token than over 128
      (benchmarks/RESULTS.md);
    - ``steady_allocator`` (default on) keeps glibc from unmapping tract's big per-call buffers between calls
      (``gdn_export.run.runtime.steady_allocator``: process-wide; without it a decode step measured up to 3.5x
      slower, depending on the process's allocation history; the cost is that freed memory stays with the
      process);
    - the states stay tract tensors between calls (``states`` copies them out on demand): a numpy round trip of
      every state per call measured 5-10% of a Q4_0 decode step of the 580M shape.
    """

    OPTIONS = ("steady_allocator", "prefill_piece", "progress")  # what open_runner's offered passes (run.runner.Runner)

    def __init__(self, path: str | os.PathLike, steady_allocator: bool = True, prefill_piece: int | None = 128,
                 progress: Callable[[str], None] | None = None) -> None:
        if steady_allocator:
            keep_buffers_mapped()
        if prefill_piece is not None and prefill_piece < 1:
            raise GdnExportError(f"prefill_piece must be a positive number of tokens or None, got {prefill_piece}")
        self.path = Path(path)
        metadata = read_metadata(self.path)  # no file there: said as such
        if not metadata or "states" not in metadata:
            raise GdnExportError(f"{self.path} was not written by gdn-export convert (no gdn_export.json with states)")
        self.metadata = metadata
        self.state_specs = metadata["states"]
        self.prefill_piece = prefill_piece
        self.progress = progress  # told when tract loads and plans (seconds: the user waits meanwhile)
        self.load_seconds: float | None = None  # tract's load and planning of the last plan made, once made
        self._planned: tuple[int, object] | None = None  # (batch size, runnable planned for it), at first call
        self._generation: dict | None = None
        self._states: list | None = None  # tract tensors (a serving session's caches: numpy), in graph order
        self._batch = 0  # the batch size of the states, once there are states
        self.position = 0  # tokens of the sequence so far, pending ones (below) included
        self._pending: np.ndarray | None = None  # [B, n] tokens kept by commit() not yet run: the next call runs them
        self._verified: tuple | None = None  # (the states, position and pending before verify(), its input_ids)
        # an archive with an MTP head: the graph's last output is "hidden" (every new position's state after the final
        # norm); told to on_hidden(first position, hidden [B, n, H]) after every call (speculative.MTPDrafter)
        self.on_hidden: Callable[[int, np.ndarray], None] | None = None

    @property
    def states(self) -> list[np.ndarray] | None:
        """The states the last call left (copies, in the graph's state order), or None before the first call; pending
        tokens (``commit``) are not in them until the next call (``run_pending``)."""
        if self._states is None:
            return None
        return [state.copy() if isinstance(state, np.ndarray) else state.to_numpy() for state in self._states]

    def _generation_files(self) -> dict[str, bytes]:
        """The checkpoint files for generation the archive carries (``metadata["generation_files"]``), read once."""
        if self._generation is None:
            from gdn_export.run.archive import read_members

            self._generation = read_members(self.path, self.metadata.get("generation_files", []))
        return self._generation

    @functools.cached_property
    def tokenizer(self):
        """The checkpoint's tokenizer (a ``tokenizers.Tokenizer``, parsed once), or None when the archive carries
        none."""
        data = self._generation_files().get("tokenizer.json")
        if data is None:
            return None
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise GdnExportError("reading the archive's tokenizer needs the tokenizers package: pip install tokenizers") from None
        try:
            return Tokenizer.from_str(text_member(data, "tokenizer.json", self.path))
        except Exception as err:  # tokenizers raises plain Exceptions
            raise GdnExportError(f"{self.path}: tokenizer.json does not load ({first_line(err)})") from None

    @property
    def chat_template(self) -> str | None:
        """The checkpoint's chat template (chat_template.jinja, or tokenizer_config.json's), or None."""
        files = self._generation_files()
        if "chat_template.jinja" in files:
            return text_member(files["chat_template.jinja"], "chat_template.jinja", self.path)
        for name in ("chat_template.json", "tokenizer_config.json"):
            if name in files:
                template = json_member(files[name], name, self.path).get("chat_template")
                if isinstance(template, list):  # named templates (transformers): the "default" one
                    template = next((t.get("template") for t in template if isinstance(t, dict)
                                     and t.get("name") == "default"), None)
                if template:
                    if not isinstance(template, str):
                        raise GdnExportError(f"{self.path}: {name}'s chat_template must be a string")
                    return template
        return None

    @property
    def generation_config(self) -> dict | None:
        """The checkpoint's generation_config.json (sampling defaults, stop tokens), or None."""
        data = self._generation_files().get("generation_config.json")
        return json_member(data, "generation_config.json", self.path) if data is not None else None

    def _runnable(self, batch: int):
        if self._planned is None or self._planned[0] != batch:
            self._planned = None  # release the previous plan before loading the next
            batch_is_symbolic = any("B" in spec["shape"] for spec in self.state_specs)
            if self.progress is not None:
                self.progress(f"loading {self.path.name} into tract and planning it for batches of {batch}")
            start = time.perf_counter()
            self._planned = (batch, load_tract_model(self.path, {"B": batch} if batch_is_symbolic else None))
            self.load_seconds = time.perf_counter() - start
            if self.progress is not None:
                self.progress(f"loaded and planned in {self.load_seconds:.1f} s")
        return self._planned[1]

    def reset(self) -> None:
        self._states = None
        self.position = 0
        self._pending = self._verified = None
        self.on_hidden = None  # a request's MTP drafter listens until the next reset

    def _initial_states(self, batch: int) -> list:
        import tract

        check_state_memory(self.path, self.state_specs, batch)
        return [
            tract.Tensor.from_numpy(np.zeros([batch if d == "B" else 0 if d == "P" else d for d in spec["shape"]],
                                             numpy_dtype(spec["dtype"])))
            for spec in self.state_specs
        ]

    def prefill(self, input_ids) -> np.ndarray:
        """Run S >= 1 new tokens; returns their logits and keeps the updated states."""
        ids = np.asarray(input_ids)
        if ids.ndim != 2 or ids.shape[0] < 1 or ids.shape[1] < 1 or not np.issubdtype(ids.dtype, np.integer):
            raise GdnExportError(f"input_ids must be integers of shape [B, S] with B, S >= 1, got {ids.dtype} "
                                 f"{list(ids.shape)}")
        vocab = self.metadata.get("vocab_size")
        if vocab is not None and (ids.min() < 0 or ids.max() >= vocab):  # tract would abort the process
            bad = int(ids.min()) if ids.min() < 0 else int(ids.max())
            raise GdnExportError(f"token id {bad} is outside this model's vocabulary [0, {vocab})")
        if self._states is not None and ids.shape[0] != self._batch:
            raise GdnExportError(f"batch size {ids.shape[0]} differs from this session's {self._batch}; "
                                 "call reset() first")
        runnable = self._runnable(ids.shape[0])  # the archive checked (states against the graph) before allocating
        if self._states is None:
            self._states = self._initial_states(ids.shape[0])
            self._batch = ids.shape[0]
        self._verified = None  # a verify call's prefix can be committed only before any other call
        new_tokens, pending = ids.shape[1], self._pending
        if pending is not None:  # tokens commit() kept: run first, in this call (their logits are not returned)
            ids, self._pending = np.concatenate([pending, ids.astype(pending.dtype)], axis=1), None
        past = self.position - (0 if pending is None else pending.shape[1])  # tokens in the states
        piece = self.prefill_piece or ids.shape[1]
        logits = []
        for begin in range(0, ids.shape[1], piece):
            chunk = ids[:, begin:begin + piece].astype(np.int64)
            # a serving graph's per-row inputs: every row has the same past and all of the chunk's tokens
            served = {"past_len": past + begin, "seq_len": chunk.shape[1]}
            served = [np.full(ids.shape[0], served[name], np.int64) for name in self.serving_inputs]
            if self.takes_past_len:
                outputs = run_tract_tensors(runnable, [chunk] + served + self._padded_caches())
                self._states = self._append_caches(outputs[1:1 + len(self.state_specs)])
            else:
                outputs = run_tract_tensors(runnable, [chunk] + served + self._states)
                self._states = outputs[1:1 + len(self.state_specs)]
            logits.append(outputs[0].to_numpy())
            if self.on_hidden is not None and self.emits_hidden:
                self.on_hidden(past + begin, outputs[-1].to_numpy())
        self.position = past + ids.shape[1]
        if len(logits) == 1 or self.metadata.get("logits") == "last":  # an archive of last-position logits
            logits = logits[-1]
        else:
            logits = np.concatenate(logits, axis=1)
        return logits if logits.shape[1] == 1 else logits[:, logits.shape[1] - new_tokens:]

    # --- speculative decoding: calls whose prefix may be taken back (docs/GENERATING.md) -------------------------

    @property
    def every_position(self) -> bool:
        """Whether the graph returns every new position's logits (not an archive converted with ``logits="last"``)."""
        return self.metadata.get("logits") != "last"

    @property
    def emits_hidden(self) -> bool:
        """Whether the graph's last output is ``hidden`` (an archive carrying an MTP head: docs/CONVERTING.md)."""
        return "hidden" in self.metadata.get("outputs", ())

    @property
    def mtp(self) -> dict | None:
        """The archive's MTP head (``gdn_export.json``'s ``mtp``: its member and sizes), or None."""
        mtp = self.metadata.get("mtp")
        return mtp if isinstance(mtp, dict) and self.emits_hidden else None

    @property
    def pending(self) -> int:
        """Tokens ``commit(..., recompute=False)`` kept that the next call runs first (0: none)."""
        return 0 if self._pending is None else self._pending.shape[1]

    def verify(self, input_ids) -> np.ndarray:
        """Run k >= 1 new tokens per sequence (``[B, k]``; typically a sampled token and its drafts) as a call whose
        prefix may be taken back: returns every one's logits ``[B, k, vocab]``; ``commit(j)`` then keeps the first
        j of them (j < k: the states are as if only those j had run), before any other call."""
        if not self.every_position:
            raise GdnExportError(f"{self.path} returns the last position's logits only (converted with logits="
                                 "\"last\"): verifying drafts needs every position's (convert without --logits last)")
        if self._states is None:
            raise GdnExportError("verify needs a prefill first (the session has no state)")
        before = self.checkpoint()
        logits = self.prefill(input_ids)
        self._verified = (before, np.asarray(input_ids))
        return logits

    def checkpoint(self) -> tuple:
        """The session's states and position now, to ``restore`` later (kept, not copied: tract never writes a tensor
        it was given, and every call returns new ones)."""
        return self._states, self.position, self._pending, self._batch

    def restore(self, checkpoint: tuple) -> None:
        """Go back to a ``checkpoint`` of this session (after any number of calls since)."""
        self._states, self.position, self._pending, self._batch = checkpoint
        self._verified = None

    def commit(self, count: int, recompute: bool = False) -> None:
        """Keep the first ``count`` tokens of the last ``verify`` call (0 <= count <= k; the same count for every
        row). ``count == k`` keeps the states that call left. Otherwise the states go back to those before it (they
        are kept, not copied: tract never writes a tensor it was given, and a call returns new ones) and the kept
        tokens are *pending*: the next call runs them first, in the same call as its own tokens (one call instead of
        two; their logits are not returned again), or at once with ``recompute=True``. Attention caches, recurrent
        states and short-conv windows are then exactly those of the kept prefix."""
        if self._verified is None:
            raise GdnExportError("commit needs a verify call before it")
        before, ids = self._verified
        if not 0 <= count <= ids.shape[1]:
            raise GdnExportError(f"commit takes 0 to {ids.shape[1]} tokens (the verify call's), got {count}")
        self._verified = None
        if count == ids.shape[1]:
            return
        self.restore(before)
        pending = self._pending
        if count:
            kept = ids[:, :count].astype(np.int64)
            self._pending = kept if pending is None else np.concatenate([pending, kept], axis=1)
            self.position += count
        if recompute and self._pending is not None:
            self.run_pending()

    def run_pending(self) -> None:
        """Run the pending tokens now (``states`` then holds them)."""
        if self._pending is None:
            return
        pending, self._pending = self._pending, None
        self.position -= pending.shape[1]
        self.prefill(pending)

    @property
    def serving(self) -> bool:
        """A serving graph's archive (``convert(serving=True)``), which ``gdn_export.Engine`` batches."""
        return bool(self.metadata.get("serving"))

    @property
    def serving_inputs(self) -> list[str]:
        """The graph's inputs between ``input_ids`` and the states: a serving graph's ``past_len`` (with attention
        caches) and ``seq_len`` (``Decoder.split_inputs``); none in any other graph."""
        return [name for name in ("past_len", "seq_len") if name in self.metadata.get("inputs", ())]

    @property
    def takes_past_len(self) -> bool:
        """A serving graph with attention caches: it takes ``past_len`` and returns each cache's new positions only,
        which the session appends here (a graph without caches is the same served or not)."""
        return "past_len" in self.metadata.get("inputs", ())

    def _padded_caches(self) -> list:
        """The states with one padding position after each cache's own (a serving graph's caches are never empty:
        docs/SERVING.md); ``past_len`` masks it. A serving session keeps its caches as numpy arrays (they are
        extended on the host every call), the other states as tract tensors."""
        padded = []
        for spec, state in zip(self.state_specs, self._states):
            if "P" in spec["shape"]:
                axis, state = spec["shape"].index("P"), _numpy(state)
                state = np.concatenate([state, np.zeros(_one_position(state.shape, axis), state.dtype)], axis=axis)
            padded.append(state)
        return padded

    def _append_caches(self, outputs: list) -> list:
        """The new states: each cache extended by its new positions (numpy), the others as tract returned them."""
        appended = []
        for spec, old, new in zip(self.state_specs, self._states, outputs):
            if "P" in spec["shape"]:
                new = np.concatenate([_numpy(old), new.to_numpy()], axis=spec["shape"].index("P"))
            appended.append(new)
        return appended

    def decode(self, input_ids) -> np.ndarray:
        """Run one new token per sequence (``[B, 1]``); returns logits ``[B, 1, vocab]``."""
        ids = np.asarray(input_ids)
        if ids.ndim != 2 or ids.shape[1] != 1:
            raise GdnExportError(f"decode takes input_ids of shape [B, 1], got {list(ids.shape)}")
        if self._states is None:
            raise GdnExportError("decode needs a prefill first (the session has no state)")
        return self.prefill(ids)

    # --- sharing one tract plan (gdn_export.run.generation's worker pool) -----------------------------------------

    @classmethod
    def sharing_plan(cls, other: Session, batch: int = 1) -> Session:
        """A new Session over ``other``'s archive and its tract plan for ``batch`` (planned now if it has none):
        the weights are loaded once, the states are the new Session's own. tract spawns a fresh execution state
        for every call of a runnable, so Sessions sharing one may run in different threads at once (tract's calls
        release the GIL). A later call with another batch size plans anew for that Session alone."""
        other._runnable(batch)
        new = cls.__new__(cls)
        new.path, new.metadata, new.state_specs = other.path, other.metadata, other.state_specs
        new.prefill_piece = other.prefill_piece
        new.progress, new.load_seconds = None, other.load_seconds
        new._planned = other._planned
        new._generation = other._generation_files()  # read-only
        new._states, new._batch = None, 0
        new.position = 0
        new._pending = new._verified = None
        new.on_hidden = None
        return new


def check_state_memory(path: Path, specs: list[dict], batch: int, positions: int = 0) -> None:
    """The states of ``batch`` rows (``positions`` cache positions) refused before they are allocated when they
    would take more memory than the machine has available (/proc/meminfo's MemAvailable, and the address-space
    limit): a one-line error rather than an allocation the system refuses or kills the process for."""
    total = 0
    for spec in specs:
        count = 1
        for d in spec["shape"]:
            count *= batch if d == "B" else positions if d == "P" else 1 if d == "S" else d
        total += count * numpy_dtype(spec["dtype"]).itemsize
    available = available_memory()
    if available is not None and total > available:
        raise GdnExportError(f"{path}: the states of {batch} row(s) take {total / (1 << 30):.1f} GiB, more than the "
                             f"{available / (1 << 30):.1f} GiB of memory available")


def available_memory() -> int | None:
    """Bytes this process may still allocate: MemAvailable (Linux), bounded by RLIMIT_AS less what is mapped; None
    where neither is known."""
    import resource

    bounds = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                bounds.append(int(line.split()[1]) * 1024)
    except OSError:
        pass
    limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    if limit != resource.RLIM_INFINITY:
        try:
            mapped = int(Path("/proc/self/statm").read_text().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError):
            mapped = 0
        bounds.append(max(limit - mapped, 0))
    return min(bounds) if bounds else None


def _numpy(state) -> np.ndarray:
    """A state as numpy: a tract tensor copied out, a numpy array (a serving session's cache) as it is."""
    return state if isinstance(state, np.ndarray) else state.to_numpy()


def _one_position(shape, axis: int) -> list[int]:
    return [1 if i == axis else d for i, d in enumerate(shape)]
