"""The checkpoint's multi-token-prediction head in the archive: what ``convert`` adds for ``--speculative mtp``.

A Qwen3.5, Qwen3.5-MoE or Qwen3-Next checkpoint with ``mtp.*`` tensors converts into an archive that carries

- a last output ``hidden`` ``[B, S, H]`` of the main graph: every new position's state after the final norm (the
  state vLLM's MTP heads read: ``gdn_export/models/mtp.py``); archives without an MTP head are
  unchanged, byte for byte;
- the head itself as the member ``mtp.nnef.tgz``: ``models.mtp.MTPHead`` exported by ``gdn_export.export`` (its own
  graph, its own KV cache as inputs and outputs, the model's embedding table and LM head copied in: tract shares no
  constant between two models), checked in tract against the torch head before it is stored; the main archive's
  digests cover it;
- ``gdn_export.json``'s ``mtp``: the member, its inputs and outputs, the cache's sizes and the state it reads.

Left out, and said so in the report: with ``--logits last`` (drafts are verified on every position's logits), with
``--quantize`` (the head would be the only unquantized part; not written yet), with ``--format onnx``, without
``mtp_num_hidden_layers`` in the config, and where the ``mtp.*`` tensors are not the published layout this head
reads (another layer count, dedicated embeddings: the reason is the report's line).
"""

from __future__ import annotations

from pathlib import Path

import torch

from gdn_export.hf.mtp import MTP_FAMILIES, has_mtp, read_mtp_head
from gdn_export.hf.tensors import CheckpointError, TensorIndex
from gdn_export.models.mtp import MTPHead

MEMBER = "mtp.nnef.tgz"  # = gdn_export.run.mtp.MEMBER (the run side imports nothing of the converter)
INPUTS = ["hidden", "next_ids", "in_mtp_key", "in_mtp_value"]
OUTPUTS = ["logits", "mtp_hidden", "out_mtp_key", "out_mtp_value"]


def mtp_decision(checkpoint_dir: str | Path, model_type: str, config: dict, *, logits: str, quantize: str | None,
                 dtype: torch.dtype) -> tuple[MTPHead | None, str | None]:
    """(the checkpoint's MTP head in ``dtype``, None) when the archive carries it; (None, why not) when the checkpoint
    has one that is left out; (None, None) when it has none."""
    index = TensorIndex(checkpoint_dir)
    if model_type not in MTP_FAMILIES or not has_mtp(index):
        return None, None
    if "mtp_num_hidden_layers" not in config:  # published heads say how many layers they have
        return None, "MTP head left out: mtp.* tensors but no mtp_num_hidden_layers in config.json"
    if logits == "last":
        return None, "MTP head left out: --logits last (drafts are verified on every position's logits)"
    if quantize is not None:
        return None, f"MTP head left out: --quantize {quantize} (a quantized MTP head is not written yet)"
    try:
        return read_mtp_head(checkpoint_dir, torch.float32, index).to(dtype), None
    except CheckpointError as err:  # the model converts as before; the report says why its head does not come along
        return None, f"MTP head left out: {str(err).removeprefix(f'{checkpoint_dir}: ')}"


def example_inputs(head: MTPHead, batch: int = 1, seq: int = 3, past: int = 2) -> tuple[torch.Tensor, ...]:
    """Traced example: a non-empty past (P a real axis) and random values (so the check means something)."""
    gen = torch.Generator().manual_seed(0)
    config, dtype = head.config, head.fc.weight.dtype
    cache = (batch, config.num_key_value_heads, past, config.head_dim)
    return (torch.randn(batch, seq, config.hidden_size, generator=gen).to(dtype),
            torch.randint(0, config.vocab_size, (batch, seq), generator=gen),
            (0.1 * torch.randn(cache, generator=gen)).to(dtype), (0.1 * torch.randn(cache, generator=gen)).to(dtype))


def export_head(head: MTPHead, path: Path, *, tract_version: str | None, runtime: str, check: bool):
    """Write ``head`` as a ``.nnef.tgz`` at ``path`` (checked in tract against the head unless ``check`` is False);
    returns (the export report, the ``mtp`` metadata of the main archive)."""
    from gdn_export.pipeline.export import export

    dynamic = {"hidden": {0: "B", 1: "S"}, "next_ids": {0: "B", 1: "S"}, "in_mtp_key": {0: "B", 2: "P"},
               "in_mtp_value": {0: "B", 2: "P"}}
    config = head.config
    dtype = str(head.fc.weight.dtype).removeprefix("torch.")
    cache = ["B", config.num_key_value_heads, "P", config.head_dim]
    states = [{"name": name, "shape": cache, "dtype": dtype, "kind": kind, "layer": 0}
              for name, kind in (("mtp_key", "key"), ("mtp_value", "value"))]
    own = {"family": "MTP head", "inputs": INPUTS, "outputs": OUTPUTS, "states": states, "dtype": dtype,
           "vocab_size": config.vocab_size}
    report = export(head, example_inputs(head), path, tract_version=tract_version, input_names=INPUTS,
                    output_names=OUTPUTS, dynamic_axes=dynamic, metadata=own, check=check, runtime=runtime)
    recorded = {"member": MEMBER, "inputs": INPUTS, "outputs": OUTPUTS, "dtype": dtype,
                "hidden_size": config.hidden_size, "num_key_value_heads": config.num_key_value_heads,
                "head_dim": config.head_dim, "layers": config.num_layers, "reads": head.reads,
                "decisions": [d.summary() for d in report.decisions]}
    return report, recorded
