"""A Qwen3.5-text checkpoint of a chosen size with random bfloat16 weights, written one shard at a time.

    python benchmarks/large_checkpoint.py DIR [--size-gb 3.2] [--layers N] [--hidden 2048] [--vocab 151936]
                                          [--intermediate N] [--tied] [--experts E [--expert-width I] [--top-k K]]
                                          [--mtp]
                                          [--shard-gb 1.0] [--seed 0]

Real shapes (Qwen3.5 2B-class text model: hidden 2048, intermediate 6144, vocab 151936, 16 linear key / value
heads of K = V = 128, 8 attention heads of 256 with 2 kv heads, 3 linear_attention layers per full_attention
layer, untied head); as many layers (a multiple of 4) as it takes to reach --size-gb of bf16 weights on disk,
or --layers. The parameter names and shapes come from transformers' model built on the meta device; the
tensors are then drawn one by one (N(0, 1/fan_in) matrices, norms near their identity, A_log = log U(1, 16) in
float32 as real checkpoints keep it, dt_bias = softplus^-1 of a log-uniform step in [1e-3, 1e-1]) and written
shard by shard with safetensors, plus model.safetensors.index.json and config.json: the builder holds about
one shard, never the whole model. bench_convert.py --large converts what this writes.

``--tied`` ties the head to the embedding table (``tie_word_embeddings: true``; no ``lm_head.weight`` is written,
as in published tied checkpoints) and ``--intermediate`` sets the MLP width: Qwen3.5 0.8B's text model is
``--layers 24 --hidden 1024 --intermediate 3584 --tied`` (bench_vs_llamacpp.py builds it so).

``--mtp`` adds an MTP head as published Qwen3.5 checkpoints carry one (``mtp_num_hidden_layers: 1``, random
``mtp.*`` under the published names: ``gdn_export/models/mtp.py``), which ``convert`` carries as ``mtp.nnef.tgz``.

``--experts E`` makes it Qwen3.5-MoE's text model instead (``qwen3_5_moe_text``): every feed-forward a routed MoE of
E SwiGLU experts of width ``--expert-width`` (default 512), ``--top-k`` of them per token (default 8), plus a shared
expert of the same width, the experts stored as published checkpoints store them: one tensor per expert and
matrix (``mlp.experts.<e>.gate_proj.weight`` ...), which transformers merges into ``gate_up_proj`` /
``down_proj`` stacks on load (Qwen3-30B-A3B's routed shape is ``--hidden 2048 --experts 128 --expert-width 768``).
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

GB = 1e9
PATTERN = ["linear_attention"] * 3 + ["full_attention"]
QWEN3_5_LARGE = dict(
    vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_attention_heads=8, num_key_value_heads=2,
    head_dim=256, rms_norm_eps=1e-6, linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_num_key_heads=16, linear_num_value_heads=16, tie_word_embeddings=False,
)
FLOAT32_NAMES = ("A_log",)  # kept in float32 in released Qwen3.5 / Qwen3-Next checkpoints
INDEX = "model.safetensors.index.json"
SHARD_GLOB = "model-[0-9][0-9][0-9][0-9][0-9]-of-[0-9][0-9][0-9][0-9][0-9].safetensors"  # what build() writes
CHUNK_ELEMENTS = 1 << 24  # float32 draws of 64 MB at most, cast into the bf16 tensor piece by piece


@dataclass
class Built:
    folder: Path
    layers: int
    shards: int
    parameters: int
    bytes: int  # tensor bytes on disk (bf16, A_log f32): the index's total_size
    float32_bytes: int  # the same parameters in float32
    seconds: float | None  # None: reused as found

    def __str__(self) -> str:
        return (f"{self.folder}: {self.layers} layers, {self.parameters / 1e9:.3f} B parameters, "
                f"{self.bytes / GB:.2f} GB bf16 in {self.shards} shard(s) (float32 {self.float32_bytes / GB:.2f} GB), "
                + ("reused" if self.seconds is None else f"built in {self.seconds:.1f}s"))


def make_config(layers: int, hidden: int | None = None, vocab: int | None = None, intermediate: int | None = None,
                tied: bool = False, experts: int | None = None, expert_width: int = 512, top_k: int = 8,
                mtp: bool = False):
    """The transformers config; a smaller --hidden scales the MLP with it (3x, as in the real shape); ``experts``:
    Qwen3.5-MoE's text model with that many routed experts; ``mtp``: with an MTP head (``mtp_num_hidden_layers: 1``,
    random ``mtp.*`` under the published names)."""
    import transformers

    fields = dict(QWEN3_5_LARGE)
    if hidden is not None:
        fields["hidden_size"] = hidden
        fields["intermediate_size"] = 3 * hidden
    if intermediate is not None:
        fields["intermediate_size"] = intermediate
    if vocab is not None:
        fields["vocab_size"] = vocab
    if tied:
        fields["tie_word_embeddings"] = True
    layer_types = (PATTERN * math.ceil(layers / len(PATTERN)))[:layers]
    if experts:
        fields.pop("intermediate_size")
        config = transformers.Qwen3_5MoeTextConfig(
            num_hidden_layers=layers, layer_types=layer_types, num_experts=experts, moe_intermediate_size=expert_width,
            shared_expert_intermediate_size=expert_width, num_experts_per_tok=top_k, **fields)
        config.architectures = ["Qwen3_5MoeForCausalLM"]
    else:
        config = transformers.Qwen3_5TextConfig(num_hidden_layers=layers, layer_types=layer_types, **fields)
        config.architectures = ["Qwen3_5ForCausalLM"]
    if mtp:
        config.mtp_num_hidden_layers = 1
    return config


# transformers' merged expert stack -> the per-expert matrices a published checkpoint stores (rows of the stack)
EXPERT_MATRICES = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


def parameter_specs(config) -> dict[str, tuple[tuple[int, ...], torch.dtype, str]]:
    """name -> (shape, dtype on disk, module class) from the model built on the meta device (no memory)."""
    import transformers

    with torch.device("meta"):
        model = getattr(transformers, config.architectures[0])(config)
    specs = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and getattr(config, "tie_word_embeddings", False):
            continue  # tied: the head is the embedding table, not stored (as transformers saves it)
        owner, leaf = name.rsplit(".", 1)
        module = model.get_submodule(owner)
        dtype = torch.float32 if leaf in FLOAT32_NAMES else torch.bfloat16
        if owner.endswith(".experts") and leaf in EXPERT_MATRICES:  # one tensor per expert and matrix
            parts = EXPERT_MATRICES[leaf]
            rows = tensor.shape[1] // len(parts)
            for e in range(tensor.shape[0]):
                for part in parts:
                    specs[f"{owner}.{e}.{part}.weight"] = ((rows, tensor.shape[2]), dtype, "Linear")
            continue
        specs[name] = (tuple(tensor.shape), dtype, type(module).__name__)
    if getattr(config, "mtp_num_hidden_layers", 0):  # --mtp: the published mtp.* head (models/mtp.py's names)
        from gdn_export.models.mtp import MTPConfig, MTPHead

        head_config = MTPConfig.from_config(config.to_dict())
        with torch.device("meta"):
            head = MTPHead(head_config, torch.empty(head_config.vocab_size, head_config.hidden_size), None)
            for name, tensor in head.published_state_dict().items():
                norm = tensor.dim() == 1 and "norm" in name
                specs[name] = (tuple(tensor.shape), torch.float32 if norm else torch.bfloat16,
                               "Qwen3_5RMSNorm" if norm else "Linear")
    return specs


def spec_bytes(specs: dict, dtype: torch.dtype | None = None) -> int:
    """Bytes of every tensor, each in its own dtype (or all in ``dtype``)."""
    return sum(math.prod(shape) * (dtype or own).itemsize for shape, own, _ in specs.values())


def layers_for_size(size_gb: float, hidden: int | None = None, vocab: int | None = None,
                    intermediate: int | None = None) -> int:
    """The fewest layers, a multiple of the 3:1 pattern, whose bf16 checkpoint is at least ``size_gb``."""
    one = spec_bytes(parameter_specs(make_config(len(PATTERN), hidden, vocab, intermediate)))
    two = spec_bytes(parameter_specs(make_config(2 * len(PATTERN), hidden, vocab, intermediate)))
    per_block, fixed = two - one, 2 * one - two  # embeddings, head and final norm
    blocks = max(1, math.ceil((size_gb * GB - fixed) / per_block))
    return blocks * len(PATTERN)


def _seed(name: str, seed: int) -> int:
    return zlib.crc32(name.encode()) ^ (seed * 0x9E3779B1 & 0xFFFFFFFF)


def _normal_into(out: torch.Tensor, std: float, mean: float, generator: torch.Generator) -> None:
    """Fill ``out`` with N(mean, std^2), drawing float32 a chunk of rows at a time."""
    flat = out.view(out.shape[0], -1) if out.dim() > 1 else out.view(1, -1)
    rows = max(1, CHUNK_ELEMENTS // max(1, flat.shape[1]))
    for start in range(0, flat.shape[0], rows):
        part = flat[start:start + rows]
        draw = torch.randn(part.shape, generator=generator)
        part.copy_(draw.mul_(std).add_(mean))


def random_tensor(name: str, shape: tuple[int, ...], dtype: torch.dtype, module: str, seed: int = 0) -> torch.Tensor:
    """One parameter, drawn the same way for the same name and seed."""
    generator = torch.Generator().manual_seed(_seed(name, seed))
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "A_log":  # decay rate A in [1, 16], as transformers' initialization draws it (from 0.01)
        return torch.empty(shape).uniform_(1.0, 16.0, generator=generator).log_().to(dtype)
    if leaf == "dt_bias":  # softplus(dt_bias) = a time step log-uniform in [1e-3, 1e-1]
        dt = torch.empty(shape).uniform_(math.log(1e-3), math.log(1e-1), generator=generator).exp_()
        return (dt + torch.log(-torch.expm1(-dt))).to(dtype)
    out = torch.empty(shape, dtype=dtype)
    if "Norm" in module:  # Qwen3_5RMSNorm scales by (1 + w) (w = 0 at init); the gated norm by w (1 at init)
        _normal_into(out, 0.02, 1.0 if "Gated" in module else 0.0, generator)
    else:  # matrices and the depthwise conv: N(0, 1/fan_in); embeddings and head over the hidden size
        fan_in = shape[-1] if len(shape) == 2 else math.prod(shape[1:])
        _normal_into(out, 1.0 / math.sqrt(fan_in), 0.0, generator)
    return out


def plan_shards(specs: dict, shard_bytes: int) -> list[list[str]]:
    """Names in state_dict order, cut into shards of at most ``shard_bytes`` (a bigger tensor gets one alone)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, (shape, dtype, _) in specs.items():
        nbytes = math.prod(shape) * dtype.itemsize
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def build(folder: Path, config, shard_gb: float = 1.0, seed: int = 0, log=print) -> Built:
    """Write config.json, the shards and the index into ``folder``; one shard's tensors in memory at a time."""
    from safetensors.torch import save_file

    start = time.perf_counter()
    folder.mkdir(parents=True, exist_ok=True)
    for stale in [*folder.glob(SHARD_GLOB), folder / INDEX]:  # an earlier build of another size (--keep DIR)
        stale.unlink(missing_ok=True)
    specs = parameter_specs(config)
    shards = plan_shards(specs, int(shard_gb * GB))
    weight_map = {}
    for i, names in enumerate(shards, 1):
        filename = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        tensors = {name: random_tensor(name, *specs[name], seed=seed) for name in names}
        save_file(tensors, str(folder / filename), metadata={"format": "pt"})
        shard_size = sum(t.nbytes for t in tensors.values())
        del tensors
        weight_map.update({name: filename for name in names})
        log(f"  {filename}: {len(names)} tensors, {shard_size / GB:.2f} GB ({time.perf_counter() - start:.1f}s)")
    total = spec_bytes(specs)
    parameters = sum(math.prod(shape) for shape, _, _ in specs.values())
    index = {"metadata": {"total_size": total, "total_parameters": parameters}, "weight_map": weight_map}
    (folder / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    fields = config.to_dict()
    fields["dtype"] = "bfloat16"
    (folder / "config.json").write_text(json.dumps(fields, indent=2, sort_keys=True) + "\n")
    return Built(folder, config.num_hidden_layers, len(shards), parameters, total,
                 spec_bytes(specs, torch.float32), time.perf_counter() - start)


def matches(folder: Path, config) -> bool:
    """``folder`` already holds a complete checkpoint built for ``config`` (reused by --keep)."""
    index, written = folder / INDEX, folder / "config.json"
    if not (index.is_file() and written.is_file()):
        return False
    fields = config.to_dict()
    fields["dtype"] = "bfloat16"
    on_disk = json.loads(written.read_text())
    shards = set(json.loads(index.read_text())["weight_map"].values())
    return on_disk == json.loads(json.dumps(fields)) and all((folder / s).is_file() for s in shards)


def existing(folder: Path, config) -> Built:
    specs = parameter_specs(config)
    shards = set(json.loads((folder / INDEX).read_text())["weight_map"].values())
    return Built(folder, config.num_hidden_layers, len(shards), sum(math.prod(s) for s, _, _ in specs.values()),
                 spec_bytes(specs), spec_bytes(specs, torch.float32), None)


def disk_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


def peak_rss_bytes() -> int:
    """This process's peak resident set so far (Linux reports kB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def add_shape_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--size-gb", type=float, default=3.2, help="bf16 checkpoint size to reach, GB (1e9 bytes)")
    parser.add_argument("--layers", type=int, default=None, help="layer count (default: as many as --size-gb needs)")
    parser.add_argument("--hidden", type=int, default=None, help="hidden size (default 2048; the MLP is 3x)")
    parser.add_argument("--vocab", type=int, default=None, help="vocabulary size (default 151936)")
    parser.add_argument("--intermediate", type=int, default=None, help="MLP width (default 3x the hidden size)")
    parser.add_argument("--tied", action="store_true", help="tie the head to the embedding table (none stored)")
    parser.add_argument("--experts", type=int, default=None, help="Qwen3.5-MoE: routed experts per layer")
    parser.add_argument("--expert-width", type=int, default=512, help="with --experts: each expert's width")
    parser.add_argument("--top-k", type=int, default=8, help="with --experts: experts per token")
    parser.add_argument("--mtp", action="store_true",
                        help="with an MTP head: random mtp.* under the published names, mtp_num_hidden_layers 1")
    parser.add_argument("--shard-gb", type=float, default=1.0, help="largest shard, GB")
    parser.add_argument("--seed", type=int, default=0)


def config_from_args(args: argparse.Namespace):
    intermediate, tied = getattr(args, "intermediate", None), getattr(args, "tied", False)
    moe = dict(experts=getattr(args, "experts", None), expert_width=getattr(args, "expert_width", 512),
               top_k=getattr(args, "top_k", 8))
    if moe["experts"] and not args.layers:
        raise SystemExit("--experts needs --layers (the size rule counts dense layers)")
    layers = args.layers or layers_for_size(args.size_gb, args.hidden, args.vocab, intermediate)
    return make_config(layers, args.hidden, args.vocab, intermediate, tied, **moe, mtp=getattr(args, "mtp", False))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path)
    add_shape_options(parser)
    args = parser.parse_args(argv)
    built = build(args.folder, config_from_args(args), args.shard_gb, args.seed,
                  log=lambda m: print(m, file=sys.stderr))
    print(f"{built}; {disk_bytes(args.folder) / GB:.2f} GB of files; builder peak RSS {peak_rss_bytes() / GB:.2f} GB")


if __name__ == "__main__":
    main()
