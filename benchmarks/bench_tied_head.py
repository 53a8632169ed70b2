"""A head tied to the embedding table, as exported before and now, against an untied head (issue 12).

    python benchmarks/bench_tied_head.py [--layers 4] [--vocab 151936] [--prompt 128] [--decode 8] [--rounds 3]

Builds one Qwen3.5 checkpoint of the 0.8B's shape (hidden 1024, vocab 151936, K = V = 128, 3 GDN layers per
full-attention layer, ``--layers`` of them (the last one full attention), random weights, ``tie_word_embeddings: true``, f32) and converts it
three ways (``check=False``):

- ``tied, as before``: the head reading the table directly (``hf.lm_head(x)``: the export before
  ``gdn_export.models.decoder.vocab_projection``, restored here by patching ``TransformersLM.lm_head``);
- ``tied, now``: the conversion as it is (the head reads the table through two slices);
- ``untied``: the same checkpoint with ``tie_word_embeddings: false`` and a head of its own (another random
  matrix: with an equal copy of the table tract would merge the two constants into one, i.e. tied again).

The three Sessions (tract, one thread, ``steady_allocator``) are timed side by side in one process, in
interleaved rounds: prefill of ``--prompt`` tokens from empty states (tokens/s) and single-token decode steps
after it (median ms/step). Also: archive sizes, the peak RSS of a fresh process that loads each archive and runs
the same prefill + decode (``VmHWM``), the largest logit difference of ``tied, now`` against ``tied, as
before`` on the same tokens, and ``tied, now`` against transformers' eager model (the float32 rule of
``gdn-export check``).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import gdn_export  # noqa: E402
from gdn_export.hf.check import check_against_transformers, sample_tokens  # noqa: E402
from gdn_export.hf.checkpoint import load_model, read_config  # noqa: E402
from gdn_export.hf.families import family_for  # noqa: E402
from gdn_export.hf.families.base import TransformersLM  # noqa: E402
from gdn_export.run.session import Session  # noqa: E402
from bench_lowerings import add_allocator_option, apply_allocator_option  # noqa: E402

QWEN3_5_08B = dict(  # Qwen3.5 0.8B's text config, but for the number of layers
    vocab_size=151936, hidden_size=1024, intermediate_size=3584, num_attention_heads=8, num_key_value_heads=2,
    head_dim=256, max_position_embeddings=4096, rms_norm_eps=1e-6, linear_conv_kernel_dim=4,
    linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=16,
)


def checkpoints(folder: Path, layers: int, vocab: int) -> tuple[Path, Path]:
    """(tied, untied) checkpoints of the same weights, the untied one with a random head of its own."""
    import transformers

    # 3 GDN layers per full-attention layer, the last layer full attention at least (transformers' cache needs one)
    kinds = [("full_attention" if i % 4 == 3 or i == layers - 1 else "linear_attention") for i in range(layers)]
    fields = dict(QWEN3_5_08B, vocab_size=vocab, num_hidden_layers=layers, layer_types=kinds)
    torch.manual_seed(0)
    model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**fields, tie_word_embeddings=True)).eval()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    model.save_pretrained(folder / "tied", safe_serialization=True)
    untied = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**fields, tie_word_embeddings=False))
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    gen = torch.Generator().manual_seed(1)
    state["lm_head.weight"] = torch.randn(model.lm_head.weight.shape, generator=gen) * 0.02
    untied.load_state_dict(state, strict=True)
    assert not torch.equal(untied.lm_head.weight, untied.model.embed_tokens.weight)
    untied.save_pretrained(folder / "untied", safe_serialization=True)
    return folder / "tied", folder / "untied"


def convert_as_before(checkpoint: Path, out: Path):
    """The conversion with the head reading the tied table directly, as gdn_export exported it before."""
    now = TransformersLM.lm_head
    TransformersLM.lm_head = lambda self, x: self.hf.lm_head(x)
    try:
        return gdn_export.convert(checkpoint, out, check=False, force=True)
    finally:
        TransformersLM.lm_head = now


def run_once(session: Session, tokens: np.ndarray, prompt: int, decode: int) -> tuple[float, list[float], np.ndarray]:
    """(prefill seconds, decode seconds per step, the prefill's logits) from empty states."""
    session.reset()
    start = time.perf_counter()
    logits = session.prefill(tokens[:, :prompt])
    prefill = time.perf_counter() - start
    steps = []
    for i in range(decode):
        start = time.perf_counter()
        session.decode(tokens[:, prompt + i:prompt + i + 1])
        steps.append(time.perf_counter() - start)
    return prefill, steps, logits


def peak_rss_mib(archive: Path, prompt: int, decode: int) -> float:
    """Peak resident size (``VmHWM``, KiB) of a fresh process that loads ``archive`` and runs a prefill and
    ``decode`` steps (not ``ru_maxrss``: Linux carries that over from the parent through fork and exec)."""
    code = f"""
import sys
import numpy as np
sys.path.insert(0, {str(ROOT)!r})
from gdn_export.run.session import Session
session = Session({str(archive)!r})
tokens = np.random.default_rng(0).integers(0, session.metadata["vocab_size"], (1, {prompt + decode}))
session.prefill(tokens[:, :{prompt}])
for i in range({decode}):
    session.decode(tokens[:, {prompt} + i:{prompt} + i + 1])
print(next(line.split()[1] for line in open("/proc/self/status") if line.startswith("VmHWM:")))
"""
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    return int(out.split()[-1]) / 1024


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--decode", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of prefill + decode per archive")
    add_allocator_option(parser)
    args = parser.parse_args(argv)
    apply_allocator_option(args)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="bench_tied_head_") as tmp:
        tmp = Path(tmp)
        start = time.perf_counter()
        tied, untied = checkpoints(tmp, args.layers, args.vocab)
        print(f"checkpoints written in {time.perf_counter() - start:.0f} s", file=sys.stderr)
        archives, convert_s = {}, {}
        for name, make in (("tied, as before", lambda out: convert_as_before(tied, out)),
                           ("tied, now", lambda out: gdn_export.convert(tied, out, check=False, force=True)),
                           ("untied", lambda out: gdn_export.convert(untied, out, check=False, force=True))):
            out = tmp / f"{name.replace(', ', '_').replace(' ', '_')}.nnef.tgz"
            start = time.perf_counter()
            make(out)
            convert_s[name] = time.perf_counter() - start
            archives[name] = out
            print(f"converted {name} in {convert_s[name]:.0f} s", file=sys.stderr)
        sessions = {name: Session(path, steady_allocator=False) for name, path in archives.items()}  # applied above
        tokens = sample_tokens(args.vocab, 1, args.prompt + args.decode, seed=0)
        for session in sessions.values():  # plan and warm up
            run_once(session, tokens, 8, 1)
        prefill = {name: [] for name in sessions}
        steps = {name: [] for name in sessions}
        logits = {}
        for _ in range(args.rounds):  # side by side: one round of every archive, then the next round
            for name, session in sessions.items():
                seconds, per_step, logits[name] = run_once(session, tokens, args.prompt, args.decode)
                prefill[name].append(seconds)
                steps[name] += per_step
        sessions.clear()
        diff = float(np.abs(logits["tied, now"] - logits["tied, as before"]).max())
        scale = float(np.abs(logits["tied, as before"]).max())
        print("measuring peak RSS in fresh processes", file=sys.stderr)
        rss = {name: peak_rss_mib(path, args.prompt, args.decode) for name, path in archives.items()}
        sizes = {name: path.stat().st_size / 1e6 for name, path in archives.items()}
        config = read_config(tied)
        hf_model = load_model(tied, family_for(config["model_type"]), config)
        check = check_against_transformers(archives["tied, now"], hf_model, prompt_len=8, decode_steps=2)

    decode_ms = {name: 1e3 * statistics.median(s) for name, s in steps.items()}
    prefill_tps = {name: args.prompt / statistics.median(s) for name, s in prefill.items()}
    base = "tied, as before"
    print(f"Qwen3.5 0.8B shape, {args.layers} layers (hidden 1024, vocab {args.vocab}, f32, random weights); tract "
          f"{gdn_export.run.runtime.tract_version()}, 1 thread; prefill S={args.prompt} from empty states (median of "
          f"{args.rounds}), decode: median of {args.rounds} x {args.decode} single-token steps after it; the three "
          "archives timed side by side in one process, interleaved (x = speed-up over 'tied, as before', same run)\n")
    print("| conversion | decode ms/step | prefill tokens/s | archive MB | peak RSS MiB | convert s |")
    print("|---|---|---|---|---|---|")
    for name in archives:
        print(f"| {name} | {decode_ms[name]:.1f} ({decode_ms[base] / decode_ms[name]:.2f}x) | {prefill_tps[name]:.0f} "
              f"({prefill_tps[name] / prefill_tps[base]:.2f}x) | {sizes[name]:.0f} | {rss[name]:.0f} | "
              f"{convert_s[name]:.0f} |")
    print(f"\nprefill logits, 'tied, now' against 'tied, as before': max |difference| {diff:.1e} (max |logit| "
          f"{scale:.1f})")
    print(f"'tied, now' against transformers' eager model (prefill 8 + 2 decode steps): {check}")


if __name__ == "__main__":
    main()
