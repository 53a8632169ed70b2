"""The checkpoint's multi-token-prediction head in the archive: what ``convert`` adds for ``--speculative mtp``.

A Qwen3.5, Qwen3.5-MoE or Qwen3-Next checkpoint with ``mtp.*`` tensors converts into an archive that carries

- a last output ``hidden`` ``[B, S, H]`` of the main graph: every new position's state after the final norm (the
  state vLLM's MTP heads read: ``gdn_export/models/mtp.py``); archives without an MTP head are
  unchanged, byte for byte;
- the head itself as the member ``mtp.nnef.tgz``: ``models.mtp.MTPHead`` exported by ``gdn_export.export`` (its own
  graph, its own KV cache as inputs and outputs, the model's embedding table and LM head copied in: tract shares no
  constant between two models), checked in tract against the torch head before it is stored; the main archive's
  digests cover it. Its ``logits`` are the LAST position's only (``[B, 1, V]``): a drafter reads nothing else (it
  drafts from the last position's logits and chains on the last ``mtp_hidden``), and the vocabulary projection,
  the head's largest cost, then runs on one row whatever the number of positions a call catches up on (a prompt's
  first call: all of them);
- ``gdn_export.json``'s ``mtp``: the member, its inputs and outputs, the cache's sizes, the state it reads, its
  weight format and ``logits: "last"``.

Under ``--quantize`` the head is written in the main graph's weight format through the same path
(``hf.weight_writers``: ``separate_tied_head``, ``plan_writes``, the codec's encodings and graph passes), its
weights read from the head in memory instead of the checkpoint, and checked in tract against the torch head on the
same stored weights (``dequantized_view``; int8: the inputs rounded as the graph rounds them, judged against the
rounding envelope) by the rule ``convert`` applies to the main graph's logits (``hf.check.compare_logits``). Its
decisions (what was stored in the format, what kept) are the report's MTP line. Not calibrated: a calibration
measures the main model's layers only (Q4_0's search runs unweighted on the head's weights).

Left out, and said so in the report: with ``--logits last`` (drafts are verified on every position's logits), with
``--fold-scales`` (a folded final norm changes the ``hidden`` the head reads), with ``--format onnx``, without
``mtp_num_hidden_layers`` in the config, and where the ``mtp.*`` tensors are not the published layout this head
reads (another layer count, dedicated embeddings: the reason is the report's line).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from gdn_export.checkpoints import source_for
from gdn_export.errors import ParityError
from gdn_export.hf.check import LogitCheck
from gdn_export.hf.mtp import MTP_FAMILIES, has_mtp, read_mtp_head
from gdn_export.hf.tensors import CheckpointError, TensorIndex
from gdn_export.models.mtp import CARRIED, SKIPPED, MTPHead

MEMBER = "mtp.nnef.tgz"  # = gdn_export.run.mtp.MEMBER (the run side imports nothing of the converter)
INPUTS = ["hidden", "next_ids", "in_mtp_key", "in_mtp_value"]
OUTPUTS = ["logits", "mtp_hidden", "out_mtp_key", "out_mtp_value"]


def mtp_decision(checkpoint_dir: str | Path, model_type: str, config: dict, *, logits: str, dtype: torch.dtype,
                 fold_scales: bool = False, weights=None) -> tuple[MTPHead | None, str | None]:
    """(the checkpoint's MTP head in ``dtype``, None) when the archive carries it; (None, why not) when the checkpoint
    has one that is left out; (None, None) when it has none. ``fold_scales``: a scale was folded into the final norm
    (the head is then left out); ``weights``: the checkpoint as the conversion opened it (a source with an MTP layout
    of its own reads the head through it, without opening the folder again); a carried head's tensors are then
    counted as carried in its summary (``CheckpointWeights.carry_apart``)."""
    head, why = _decide(checkpoint_dir, model_type, config, logits, dtype, fold_scales, weights)
    if head is not None and hasattr(weights, "carry_apart"):
        weights.carry_apart(SKIPPED, CARRIED)
    return head, why


def _decide(checkpoint_dir, model_type, config, logits, dtype, fold_scales, weights):
    source = source_for(checkpoint_dir).load()
    own = getattr(source, "read_mtp_head", None)  # a source with an MTP layout of its own (Megatron's MTP block)
    if own is not None:
        if not source.has_mtp(Path(checkpoint_dir), weights):
            return None, None
    else:
        index = TensorIndex(checkpoint_dir)
        if model_type not in MTP_FAMILIES or not has_mtp(index):
            return None, None
        if "mtp_num_hidden_layers" not in config:  # published heads say how many layers they have
            return None, "MTP head left out: mtp.* tensors but no mtp_num_hidden_layers in config.json"
    if logits == "last":
        return None, "MTP head left out: --logits last (drafts are verified on every position's logits)"
    if fold_scales:  # the head's pre-fc norm is no per-channel-scale invariant: it would read another state
        return None, ("MTP head left out: --fold-scales folded a scale into the final norm (it would change the "
                      "hidden state the head reads)")
    try:
        if own is not None:
            return own(Path(checkpoint_dir), torch.float32, weights).to(dtype), None
        return read_mtp_head(checkpoint_dir, torch.float32, index).to(dtype), None
    except CheckpointError as err:  # the model converts as before; the report says why its head does not come along
        return None, f"MTP head left out: {str(err).removeprefix(f'{checkpoint_dir}: ')}"


def example_inputs(head: MTPHead, batch: int = 1, seq: int = 3, past: int = 2) -> tuple[torch.Tensor, ...]:
    """Traced example: a non-empty past (P a real axis) and random values (so the check means something)."""
    gen = torch.Generator().manual_seed(0)
    config, dtype = head.config, head.norm.weight.dtype
    cache = (batch, config.num_key_value_heads, past, config.head_dim)
    return (torch.randn(batch, seq, config.hidden_size, generator=gen).to(dtype),
            torch.randint(0, config.vocab_size, (batch, seq), generator=gen),
            (0.1 * torch.randn(cache, generator=gen)).to(dtype), (0.1 * torch.randn(cache, generator=gen)).to(dtype))


@dataclass(frozen=True)
class HeadTensor:
    """A parameter of the head in memory, read as ``plan_writes`` reads a checkpoint tensor (rows, whole)."""

    name: str
    value: torch.Tensor

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.value.shape)

    def rows(self, start: int, stop: int, target: np.dtype) -> np.ndarray:
        return self.value[start:stop].detach().float().numpy().astype(target, copy=False).reshape(-1)

    def read(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.value.detach().to(dtype)


@dataclass(frozen=True)
class HeadWeights:
    """``plan_writes``'s ``weights`` of a head in memory: every parameter under its name."""

    entries: dict


def quantized_writes(head: MTPHead, quantize: str, *, quantize_embeddings: bool = False, q4_rule: str | None = None,
                     int8_passes: int = 1):
    """The head's weights in weight format ``quantize`` through the main graph's own path: a tied head gets a copy
    of the table (``separate_tied_head``, in place), then ``plan_writes`` with the head as both the traced module and
    the model its weights are named by (read from memory: ``HeadWeights``). Returns (``StreamedWeights``,
    ``QuantizationReport``, ``HeadWeights``)."""
    from gdn_export.hf.weight_writers import plan_writes, separate_tied_head

    separate_tied_head(head, quantize, quantize_embeddings)
    weights = HeadWeights({name: HeadTensor(name, param) for name, param in head.named_parameters()})
    writers, report = plan_writes(head, head, weights, head.norm.weight.dtype, quantize, quantize_embeddings,
                                  q4_rule=q4_rule, int8_passes=int8_passes)
    return writers, report, weights


CHECK_POSITIONS, CHECK_PAST = 8, 4  # a quantized head's check: positions of one call after a cache of CHECK_PAST


def check_quantized_head(path: Path, head: MTPHead, report=None, weights: HeadWeights | None = None) -> LogitCheck:
    """The exported head at ``path`` in tract against the torch head on the weights as stored (``dequantized_view``:
    what tract computes with; int8: each stored layer's input rounded as the graph rounds it), by the rule
    ``convert`` judges the main graph's logits with (``hf.check.compare_logits``): float32 (Q4_0 and float16
    weights in a float32 graph: the same products), the float16 rule in a float16 graph, int8 against the
    reference's own rounding envelope (``int8.rounding_envelope``), as ``check_archive`` does. One call of
    ``CHECK_POSITIONS`` positions after a random cache, every position's logits (the member's ``last_only`` off).
    ``report`` None: a head stored in its own dtype (no weight format; ``weights`` its parameters), judged by the
    float32 or float16 rule alone (no quality line)."""
    if report is None:
        from gdn_export.hf.weight_writers import QuantizationReport

        weights = HeadWeights({name: HeadTensor(name, param) for name, param in head.named_parameters()})
        report = QuantizationReport(None)
    from gdn_export.hf.check import F32_TOLERANCE, HALF_DTYPES, compare_logits
    from gdn_export.hf.weight_writers import dequantized_view, int8_reference_linears
    from gdn_export.run.runtime import load_tract_model, run_tract
    from gdn_export.weights import int8

    def head_of(entries: dict) -> MTPHead:  # a head of its own (the exported one's tensors are torch-to-nnef's now)
        made = head.rebuilt(entries["embed_tokens.weight"].read(),
                            entries["lm_head.weight"].read() if "lm_head.weight" in entries else None).split_fc().eval()
        with torch.no_grad():
            for name, param in made.named_parameters():
                param.copy_(entries[name].read(torch.float32).as_subclass(torch.Tensor))
        return made

    # every position's logits, against the member's last ones of each prefix
    reference = head_of(dequantized_view(weights, report).entries)
    hidden, next_ids, key, value = example_inputs(head, 1, CHECK_POSITIONS, CHECK_PAST)
    dtype = str(head.norm.weight.dtype).removeprefix("torch.")
    rounded = int8_reference_linears(report)

    def logits(model: MTPHead, rounded: frozenset, jitter_seed: int | None = None,
               in_dtype: torch.dtype = torch.float32) -> np.ndarray:
        handles = int8.reference_hooks(model, rounded, jitter_seed, report.own.get("int8_passes", 1))
        try:
            with torch.no_grad():
                out = model(hidden.to(in_dtype), next_ids, key.to(in_dtype), value.to(in_dtype))[0]
        finally:
            for handle in handles:
                handle.remove()
        return out.float().numpy()

    # the member computes the last position's logits: it runs once per prefix of the positions
    plan = load_tract_model(path, {"B": 1})
    actual = np.concatenate([run_tract(plan, [t[:, :end].numpy() if t is hidden or t is next_ids else t.numpy()
                                              for t in (hidden, next_ids, key, value)])[0]
                             for end in range(1, CHECK_POSITIONS + 1)], axis=1)
    expected = logits(reference, rounded)
    if rounded:
        runs = [logits(reference, rounded, seed) for seed in range(int8.ROUNDING_SEEDS)]
        result = compare_logits(actual, expected, "float32 (int8 rounding)", int8.rounding_envelope(expected, runs),
                                allowance=F32_TOLERANCE)
    elif dtype in HALF_DTYPES:
        result = compare_logits(actual, expected, dtype, logits(reference.to(HALF_DTYPES[dtype]), rounded, None,
                                                               HALF_DTYPES[dtype]))
    else:
        result = compare_logits(actual, expected, "float32")
    del reference
    if report.scheme is not None:  # the float head, no activation rounding: what the format costs, reported, not
        # judged (as the main graph's quality)
        result.quality = compare_logits(actual, logits(head_of(weights.entries), frozenset()), "float32")
    return result


def check_member(path: Path, metadata: dict, checkpoint_dir: str | Path, model_type: str, config: dict) -> LogitCheck:
    """``gdn-export check`` of an archive's MTP head (``metadata["mtp"]``): the head read again from
    ``checkpoint_dir`` as ``convert`` read it, in the member's form (split fc, the archive's dtype, its weight
    format re-applied by the rule the archive records), then the member in tract against it
    (``check_quantized_head``: the rule ``convert`` judges a quantized head by, float heads by the float32 / float16
    rule). A checkpoint without the head the archive carries is a one-line error."""
    import tarfile
    import tempfile

    from gdn_export.errors import GdnExportError
    from gdn_export.run.integrity import check_archive
    from gdn_export.weights.formats import weight_format

    recorded = metadata["mtp"]
    dtype = getattr(torch, recorded.get("dtype") or "float32")
    head, why = mtp_decision(checkpoint_dir, model_type, config, logits="all", dtype=dtype)
    if head is None:
        raise GdnExportError(f"{path} carries an MTP head ({recorded.get('member')}) but {checkpoint_dir} gives none "
                             f"to check it against{': ' + why if why else ''}")
    head.split_fc()
    quantize = recorded.get("quantize")
    report = weights = None
    if quantize is not None:
        options = weight_format(quantize).options_from_metadata(metadata)
        _, report, weights = quantized_writes(head, quantize,
                                              quantize_embeddings=bool(metadata.get("quantize_embeddings", False)),
                                              q4_rule=options.get("q4_rule"),
                                              int8_passes=options.get("int8_passes", 1))
    check_archive(path, metadata)  # the member's digest as recorded, before it is copied out
    with tempfile.TemporaryDirectory(prefix="gdn_check_mtp_") as folder, tarfile.open(path) as tar:
        member = Path(folder) / MEMBER
        try:
            source = tar.extractfile(recorded.get("member"))
        except KeyError:
            raise GdnExportError(f"{path}: gdn_export.json names an MTP head but the archive lacks "
                                 f"{recorded.get('member')}") from None
        member.write_bytes(source.read())
        return check_quantized_head(member, head, report, weights)


def export_head(head: MTPHead, path: Path, *, tract_version: str | None, runtime: str, check: bool,
                quantize: str | None = None, quantize_embeddings: bool = False, q4_rule: str | None = None,
                int8_passes: int = 1):
    """Write ``head`` as a ``.nnef.tgz`` at ``path`` (checked in tract against the head unless ``check`` is False),
    its logits and ``mtp_hidden`` of the last position (``MTPHead.last_only``); with ``quantize`` (and that format's
    options, as ``convert`` takes them) in that weight format (``quantized_writes``, checked by
    ``check_quantized_head``). Returns (the export report, the ``mtp`` metadata of the main archive, the report's
    words on the head: its weights and its check)."""
    from gdn_export.pipeline.export import export

    dynamic = {"hidden": {0: "B", 1: "S"}, "next_ids": {0: "B", 1: "S"}, "in_mtp_key": {0: "B", 2: "P"},
               "in_mtp_value": {0: "B", 2: "P"}}
    config = head.config
    dtype = str(head.norm.weight.dtype).removeprefix("torch.")
    cache = ["B", config.num_key_value_heads, "P", config.head_dim]
    states = [{"name": name, "shape": cache, "dtype": dtype, "kind": kind, "layer": 0}
              for name, kind in (("mtp_key", "key"), ("mtp_value", "value"))]
    own = {"family": "MTP head", "inputs": INPUTS, "outputs": OUTPUTS, "states": states, "dtype": dtype,
           "vocab_size": config.vocab_size, "logits": "last", "quantize": quantize}
    head.last_only = True
    head.split_fc()  # (tract_quirks.MATMUL_OF_CONCAT_SPLIT)
    writers = quantization = weights = None
    if quantize is not None:
        writers, quantization, weights = quantized_writes(head, quantize, quantize_embeddings=quantize_embeddings,
                                                          q4_rule=q4_rule, int8_passes=int8_passes)
    report = export(head, example_inputs(head), path, tract_version=tract_version, input_names=INPUTS,
                    output_names=OUTPUTS, dynamic_axes=dynamic, metadata=own, check=check and writers is None,
                    runtime=runtime, weights=writers)
    words = f", checked in tract against torch: {report.parity}" if report.parity else ""
    if quantization is not None:
        words = f"; {quantization}"
        if check:
            outcome = check_quantized_head(path, head, quantization, weights)
            if not outcome.ok:
                raise ParityError({"logits": outcome.error}, {"logits": outcome.tolerance},
                                  f"the MTP head in {quantize} does not match the torch head on the same stored "
                                  f"weights: {outcome}")
            words += (f"; checked in tract against torch on the same stored weights: {outcome}; quality vs the float "
                      f"head (reported, not judged): mean KL {outcome.quality.mean_kl:.2e} nats, top-1 agreement "
                      f"{100 * outcome.quality.top1_all:.1f}%")
    recorded = {"member": MEMBER, "inputs": INPUTS, "outputs": OUTPUTS, "dtype": dtype,
                "hidden_size": config.hidden_size, "num_key_value_heads": config.num_key_value_heads,
                "head_dim": config.head_dim, "layers": config.num_layers, "reads": head.reads, "logits": "last",
                "quantize": quantize, "quantized": len(quantization.quantized) if quantization is not None else 0,
                "decisions": [d.summary() for d in report.decisions]}
    return report, recorded, words
