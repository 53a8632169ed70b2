"""An archive's multi-token-prediction (MTP) head, run in tract: what ``--speculative mtp`` drafts with.

An archive converted from a checkpoint with an MTP head (``mtp.*`` of Qwen3.5, Qwen3.5-MoE, Qwen3-Next:
docs/CONVERTING.md) carries it as a member of its own, ``mtp.nnef.tgz``: a second graph (``gdn_export/models/mtp.py``
traced) with inputs ``hidden [B, S, H]`` (the main graph's ``hidden`` output: states after the final norm),
``next_ids [B, S]`` (the token after each position) and its KV cache ``in_mtp_key``/``in_mtp_value``
``[B, Hkv, P, D]``; outputs ``logits [B, S, V]`` (predicting the token two ahead), ``mtp_hidden [B, S, H]`` (a chained
draft's next ``hidden``) and the extended cache. The main archive's digests cover the member; the member is itself
an archive gdn-export wrote (its own digests, checked when tract loads it).

``MTPRunner`` keeps one sequence's MTP cache (batch 1) and cuts it by length: an attention cache is exact under a
cut, so drafts that were not kept cost nothing to take back.
"""

from __future__ import annotations

import shutil
import tarfile
import tempfile
from pathlib import Path

import numpy as np

from gdn_export.errors import GdnExportError
from gdn_export.run.integrity import ArchiveCache, check_archive

MEMBER = "mtp.nnef.tgz"
PIECE = 128  # positions per call of the head at most (the prompt pieces' unit, generation.executor.PROMPT_PIECE)
INPUTS = ["hidden", "next_ids", "in_mtp_key", "in_mtp_value"]
OUTPUTS = ["logits", "mtp_hidden", "out_mtp_key", "out_mtp_value"]

_PLANS = ArchiveCache()  # the MTP graphs' tract plans (batch 1) by archive file, made on first use


def no_mtp_message(path: Path) -> str:
    return (f"{path.name} carries no MTP head (--speculative mtp drafts with the mtp.* weights of a Qwen3.5, "
            "Qwen3.5-MoE or Qwen3-Next checkpoint, converted unquantized with every position's logits); use "
            "--speculative ngram or draft")


def mtp_plan(path: Path, metadata: dict):
    """The MTP graph of archive ``path`` planned for batch 1 (once per process and archive file, shared by every
    runner; a failure is remembered too: a malformed member is not planned again on every request): the member is
    copied out to a temporary file, which tract loads (and gdn-export checks: digests, states) and is removed."""
    member = (metadata.get("mtp") or {}).get("member")
    if member != MEMBER:
        raise GdnExportError(no_mtp_message(Path(path)))
    return _PLANS.get(path, lambda: _plan_member(Path(path), metadata, member))


def _plan_member(path: Path, metadata: dict, member: str):
    from gdn_export.run.runtime import load_tract_model

    check_archive(path, metadata)  # the member's size and digest as recorded, before a byte of it is copied out
    with tempfile.TemporaryDirectory(prefix="gdn_mtp_") as folder:
        copy = Path(folder) / MEMBER
        with tarfile.open(path, "r:gz") as tar:
            try:
                source = tar.extractfile(tar.getmember(member))
            except KeyError:
                raise GdnExportError(f"{path}: gdn_export.json names an MTP head but the archive lacks {member}; "
                                     "convert it again") from None
            with open(copy, "wb") as out:
                shutil.copyfileobj(source, out, 8 << 20)
        try:
            return load_tract_model(copy, {"B": 1}, expect_outputs=OUTPUTS)
        except GdnExportError as err:  # named by the archive and its member, not by the temporary copy
            raise GdnExportError(f"{path}: its MTP head ({member}) cannot be planned: "
                                 f"{str(err).removeprefix(f'{copy}: ')}") from None


class MTPRunner:
    """One sequence's MTP head: ``run(hidden [S, H], next_ids [S]) -> (logits [S, V], mtp_hidden [S, H])`` at the
    positions after those its cache holds (extending it), ``truncate(n)`` keeps the first n positions."""

    def __init__(self, path: Path, metadata: dict, plan=None) -> None:
        """``plan``: the MTP graph already planned (a benchmark's head exported alone), else the archive's member's."""
        mtp = metadata.get("mtp")
        if not isinstance(mtp, dict) or "hidden" not in metadata.get("outputs", ()):
            raise GdnExportError(no_mtp_message(Path(path)))
        self.plan = plan if plan is not None else mtp_plan(Path(path), metadata)
        self.dtype = np.float16 if mtp.get("dtype") == "float16" else np.float32
        self.cache_shape = (1, int(mtp["num_key_value_heads"]), 0, int(mtp["head_dim"]))
        self.reset()

    def reset(self) -> None:
        self.key = np.zeros(self.cache_shape, self.dtype)
        self.value = np.zeros(self.cache_shape, self.dtype)

    @property
    def length(self) -> int:
        """Positions in the cache."""
        return self.key.shape[2]

    def run(self, hidden: np.ndarray, next_ids) -> tuple[np.ndarray, np.ndarray]:
        from gdn_export.run.runtime import run_tract_tensors

        hidden, ids = np.asarray(hidden, self.dtype), np.asarray(next_ids, np.int64)
        # in pieces, as the main model's prompt: a drafter's first call catches up over the whole prompt, whose
        # attention scores in one call would grow with its square
        for start in range(0, max(len(ids), 1), PIECE):
            piece = slice(start, start + PIECE)
            outputs = run_tract_tensors(self.plan, [hidden[None, piece], ids[None, piece], self.key, self.value])
            logits, mtp_hidden, self.key, self.value = (o.to_numpy() for o in outputs)
        return logits[0], mtp_hidden[0]

    def truncate(self, length: int) -> None:
        self.key, self.value = self.key[:, :, :length], self.value[:, :, :length]


def forget_plans() -> None:
    """Drop the planned MTP graphs and remembered failures (tests; a long-lived process keeps them)."""
    _PLANS.clear()


__all__ = ["MEMBER", "INPUTS", "OUTPUTS", "MTPRunner", "mtp_plan", "no_mtp_message", "forget_plans"]
