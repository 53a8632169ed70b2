"""gdn_export against llama.cpp on one Qwen3.5 checkpoint: speed and quality, each format, one run (issue 12 item 6).

    python benchmarks/bench_vs_llamacpp.py [--llama-cpp DIR [--llama-cpp-build DIR]] [--layers 24] [--formats f32,f16,q4_0]
                                           [--prompt 512] [--decode 64] [--reps 3] [--cpu 0]
                                           [--workdir DIR] [--keep] [--markdown]

What it does, in this order, all in one run:

1. Builds Qwen3.5 0.8B's text model with random bf16 weights (``large_checkpoint.py``: hidden 1024, intermediate
   3584, ``--layers`` of them, 3 gated delta-rule layers per full-attention layer, 16 linear heads of K = V = 128,
   8 attention heads of 256 with 2 kv heads, vocab 151936, head tied to the embedding table) plus a synthetic
   tokenizer (below), in ``--workdir``.
2. transformers' float32 model (``AutoModelForCausalLM``, eager attention, the same folder) computes the
   reference logits of ``--prompt`` + ``--decode`` random token ids (in a child process, freed after).
3. Converts every format: gdn_export with ``gdn-export convert --no-check --logits last`` (the head on the last
   position only, as llama.cpp computes logits and as generation needs them; f32 ``--dtype float32``, f16
   ``--quantize f16`` (float16 weights, float32 graph), f16-graph ``--dtype float16``, q4_0 ``--dtype float32 --quantize q4_0``: linear layers in Q4_0; the table says what the
   tied embedding / head got), llama.cpp with ``convert_hf_to_gguf.py --outtype f32|f16`` of the same folder and
   Q4_0 by ``llama-quantize`` of the F32 GGUF (its default recipe, which keeps some tensors in other types: the
   table says which type the tied ``token_embd`` got; its conversion time includes the F32 GGUF's).
4. Then per format, gdn_export and llama.cpp back to back (close in time, as the machine may be shared):
   gdn_export: a child process pinned with ``taskset -c CPU`` runs ``gdn_export.Session`` (tract, one thread: the
   Python bindings' default): a warm-up, then ``--reps`` rounds of a prefill of the ``--prompt`` tokens from empty
   states and ``--decode`` single-token steps after it (median tokens/s of the rounds; the first round's logits
   are the ones compared: the prompt's last position and each decode step's). llama.cpp: ``taskset -c CPU llama-bench -t 1``, prefill ``-p 512 -n 0`` and
   decode ``-p 0 -n 64 -d 512`` (decode after the prompt, as the gdn_export side decodes; ``-r --reps``, median of
   llama-bench's samples; its defaults otherwise: f16 KV cache, flash attention auto); logits by a small C
   program (below). Each archive / GGUF is deleted once measured, unless ``--keep``.
5. Prints one table: per engine and format, the file size, conversion time, prefill tokens/s at ``--prompt``
   tokens, decode tokens/s, and against the float32 reference on the same tokens, at the positions generation
   reads (the prompt's last and every decode step's; llama.cpp's logits of all the ids, those rows): the largest |logit
   difference|, the mean KL divergence of the next-token distribution (mean over positions of KL(P_ref ||
   P_model) in nats, llama.cpp's ``--kl-divergence`` figure) and top-1 agreement. Plus the machine (lscpu).

Without ``--llama-cpp`` (or $LLAMA_CPP_DIR) the llama.cpp rows are skipped with a message; everything else runs. The
build folder is ``--llama-cpp-build`` ($LLAMA_CPP_BUILD; default the tree's build/): docs/PERFORMANCE.md says how to make one.

Reading the quality columns: the weights are random, so the logits are small (|logit| < ~6, nearly flat over
151936 tokens) and a deep random network amplifies perturbations: a 4-bit model's logits decorrelate from the
reference (mean KL ~0.5 nats at 24 layers, for both engines alike) and its top-1 agreement is near chance, where a
trained model's is not. Compare engines at one format; do not read these as the published model's figures.

Choices that needed one, and why:

- **Tokenizer.** ``convert_hf_to_gguf.py`` needs a tokenizer and the checkpoint is random, so the benchmark
  writes a synthetic Qwen2-style byte-level BPE tokenizer with the ``tokenizers`` library: the 256 byte
  symbols, every pair of them, then pair + byte triples, 151643 tokens, Qwen2's split regex and NFC normalizer,
  and ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>`` at 151643-151645 as in Qwen2/3.5 (the GGUF pads the
  rest of the 151936 rows). The converter identifies the pre-tokenizer by hashing the token ids of a fixed text
  and refuses an unknown hash, which a synthetic vocabulary always is. Rather than edit the llama.cpp tree, the
  converter runs through a few-line wrapper (written into the work folder) that replaces
  ``get_vocab_base_pre`` by the original, falling back to ``"qwen35"`` (Qwen3.5's pre-tokenizer, what the
  published checkpoints get) when it raises ``NotImplementedError``, then runs ``convert_hf_to_gguf.py`` as
  ``__main__``. The pre-tokenizer only matters for text; both engines are fed token ids here. The converter also
  gets ``--no-mtp``: published Qwen3.5 checkpoints carry a multi-token-prediction layer, which its Qwen3.5 class
  otherwise requires; this checkpoint has none (transformers and gdn_export use none either).
- **llama.cpp's logits.** llama-bench returns none. ``llama-perplexity --kl-divergence`` reads text, not ids
  (the ids would go through the synthetic tokenizer and its own chunking: only the second half of each chunk
  is scored), and ``llama-eval-callback`` / ``llama-embedding`` print tensors or hidden states, not all logits.
  The least fragile way is a ~50-line C program against the tree's own ``include/llama.h`` and its shared
  ``libllama`` (``build/bin``): load the GGUF with the library defaults (CPU, f16 KV cache, flash attention auto:
  the same defaults as llama-bench), decode the token ids in one batch with every position's logits requested,
  write ``llama_get_logits_ith`` for each position. It uses only the public C API (``llama_model_load_from_file``,
  ``llama_init_from_model``, ``llama_batch_init``, ``llama_decode``), compiles in a second with ``cc``, and
  needs no Python binding matched to the tree's struct layouts. It runs pinned to the same core, one thread.
- **Pinning.** Both engines run on one thread pinned to ``--cpu`` (``taskset -c``), each measurement in its own
  process (the gdn_export measurement in a child of this script), after every conversion of that format.
  The machine may be shared: the load average before each measurement is printed to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import large_checkpoint  # noqa: E402

HIDDEN, INTERMEDIATE, VOCAB = 1024, 3584, 151936  # Qwen3.5 0.8B's text model
TOKENIZER_SIZE = 151643  # BPE tokens; the three specials follow, as in Qwen2 / Qwen3.5
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
               r"|\s+(?!\S)|\s+")
# f16: float16 weights, float32 graph (--quantize f16, the CPU's f16 format); f16-graph: the float16 graph (--dtype
# float16, activations in f16 too: what tract's CUDA runtime wants), both against llama.cpp's F16
GDN_FORMATS = {"f32": ["--dtype", "float32"], "f16": ["--dtype", "float32", "--quantize", "f16"],
               "f16-graph": ["--dtype", "float16"],
               "q4_0": ["--dtype", "float32", "--quantize", "q4_0"], "int8": ["--dtype", "float32", "--quantize", "int8"],
               "int8x2": ["--dtype", "float32", "--quantize", "int8", "--int8-passes", "2"]}
# int8 against llama.cpp's Q8_0 (int8x2, inputs rounded in two passes, too: Q8_0 made and measured again beside it)
GGUF_FORMATS = {"f32": "F32", "f16": "F16", "f16-graph": "F16", "q4_0": "Q4_0", "int8": "Q8_0", "int8x2": "Q8_0"}
QUANTIZED = ("q4_0", "int8", "int8x2")  # GGUFs made by llama-quantize of the F32 one

CONVERT_WRAPPER = '''"""Run llama.cpp's convert_hf_to_gguf.py, accepting an unknown BPE pre-tokenizer hash as "qwen35".

Written by gdn_export's benchmarks/bench_vs_llamacpp.py: its tokenizer is synthetic, so the converter's hash of
the tokenized check text matches no known model. Usage: python THIS LLAMA_CPP_DIR CONVERTER_ARGS...
"""
import logging, os, runpy, sys
tree = sys.argv[1]
fallback = os.environ.get("GDN_GGUF_PRE", "qwen35")  # bench_quality.py: the trained tokenizer splits as Qwen2
sys.path.insert(0, tree)
sys.path.insert(1, tree + "/gguf-py")
import conversion.base as base
owner = next(c for c in vars(base).values() if isinstance(c, type) and "get_vocab_base_pre" in vars(c))
original = owner.get_vocab_base_pre
def get_vocab_base_pre(self, tokenizer):
    try:
        return original(self, tokenizer)
    except NotImplementedError:
        logging.getLogger("bench_vs_llamacpp").warning("unknown tokenizer: pre-tokenizer set to %s", fallback)
        return fallback
owner.get_vocab_base_pre = get_vocab_base_pre
sys.argv = [tree + "/convert_hf_to_gguf.py", *sys.argv[2:]]
runpy.run_path(sys.argv[0], run_name="__main__")
'''

LOGITS_C = r'''/* Logits of every position for token ids read from a file: llama.cpp's public C API only.
   Written by gdn_export's benchmarks/bench_vs_llamacpp.py.
   Usage: llama_logits MODEL.gguf TOKENS.i32 OUT.f32 THREADS  (TOKENS: int32 ids; OUT: n x n_vocab float32) */
#include "llama.h"
#include <stdio.h>
#include <stdlib.h>

int main(int argc, char ** argv) {
    if (argc != 5) { fprintf(stderr, "usage: %s MODEL TOKENS OUT THREADS\n", argv[0]); return 2; }
    FILE * f = fopen(argv[2], "rb");
    if (!f) { perror(argv[2]); return 1; }
    fseek(f, 0, SEEK_END); long n = ftell(f) / 4; fseek(f, 0, SEEK_SET);
    int32_t * ids = malloc(n * 4);
    if (fread(ids, 4, n, f) != (size_t) n) { fprintf(stderr, "short read\n"); return 1; }
    fclose(f);
    int threads = atoi(argv[4]);

    llama_backend_init();
    struct llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    struct llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) { fprintf(stderr, "cannot load %s\n", argv[1]); return 1; }
    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = n; cp.n_batch = n; cp.n_ubatch = n; cp.n_seq_max = 1;
    cp.n_threads = threads; cp.n_threads_batch = threads;
    struct llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) { fprintf(stderr, "cannot make a context\n"); return 1; }
    int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));

    struct llama_batch batch = llama_batch_init(n, 0, 1);
    for (long i = 0; i < n; i++) {
        batch.token[i] = ids[i]; batch.pos[i] = i; batch.n_seq_id[i] = 1; batch.seq_id[i][0] = 0; batch.logits[i] = 1;
    }
    batch.n_tokens = n;
    int rc = llama_decode(ctx, batch);
    if (rc != 0) { fprintf(stderr, "llama_decode returned %d\n", rc); return 1; }
    FILE * out = fopen(argv[3], "wb");
    if (!out) { perror(argv[3]); return 1; }
    for (long i = 0; i < n; i++) {
        const float * row = llama_get_logits_ith(ctx, i);
        if (!row || fwrite(row, 4, n_vocab, out) != (size_t) n_vocab) {
            fprintf(stderr, "no logits at %ld\n", i); return 1;
        }
    }
    fclose(out);
    fprintf(stderr, "%ld positions x %d logits\n", n, n_vocab);
    llama_batch_free(batch);
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
'''

START = time.perf_counter()


def log(message: str) -> None:
    print(f"[{time.perf_counter() - START:7.1f}s] {message}", file=sys.stderr, flush=True)


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def machine() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no lscpu)"
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    name = fields.get("Model name", "unknown").strip()
    flags = fields.get("Flags", "").split()
    isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{name}, {os.cpu_count()} cores, {isa}, {mem:.0f} GiB"


# ----------------------------------------------------------------------------------------------- the checkpoint

def write_tokenizer(folder: Path) -> None:
    """A Qwen2-style byte-level BPE tokenizer of TOKENIZER_SIZE tokens + 3 specials (see the module docstring)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=ord)
    vocab = {symbol: i for i, symbol in enumerate(alphabet)}
    merges = []
    for a in alphabet:  # every pair of byte symbols
        for b in alphabet:
            vocab[a + b] = len(vocab)
            merges.append((a, b))
    pairs = [a + b for a in alphabet for b in alphabet]
    for pair in pairs:  # then pair + byte, until the size is reached
        for c in alphabet:
            if len(vocab) == TOKENIZER_SIZE:
                break
            vocab[pair + c] = len(vocab)
            merges.append((pair, c))
        if len(vocab) == TOKENIZER_SIZE:
            break
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(SPECIALS)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Qwen2Tokenizer", "model_max_length": 32768, "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "bos_token": None, "unk_token": None, "add_prefix_space": False,
        "errors": "replace", "clean_up_tokenization_spaces": False}, indent=2) + "\n")


def build_checkpoint(folder: Path, layers: int, seed: int) -> large_checkpoint.Built:
    config = large_checkpoint.make_config(layers, HIDDEN, VOCAB, INTERMEDIATE, tied=True)
    config.eos_token_id = TOKENIZER_SIZE + 2
    if large_checkpoint.matches(folder, config):
        built = large_checkpoint.existing(folder, config)
    else:
        built = large_checkpoint.build(folder, config, shard_gb=2.0, seed=seed, log=log)
    write_tokenizer(folder)
    return built


# ----------------------------------------------------------------------------------------------- workers (children)

def worker_reference(checkpoint: Path, tokens_path: Path, out: Path) -> None:
    """transformers' float32 eager model: logits of every position."""
    import torch
    import transformers

    tokens = np.fromfile(tokens_path, dtype=np.int32).astype(np.int64)
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    with torch.no_grad():
        logits = model(torch.from_numpy(tokens)[None]).logits[0].float().numpy()
    np.save(out, logits)


def worker_gdn(archive: Path, tokens_path: Path, prompt: int, decode: int, reps: int, out: Path) -> None:
    """Session (tract, one thread): prefill tokens/s and decode tokens/s, medians of ``reps`` rounds; logits saved."""
    from gdn_export.run.session import Session

    tokens = np.fromfile(tokens_path, dtype=np.int32).astype(np.int64)[None]
    load = time.perf_counter()
    session = Session(archive)
    session.prefill(tokens[:, :8])  # warm-up: the plan for batch 1 and first calls of both lengths
    session.decode(tokens[:, 8:9])
    load = time.perf_counter() - load
    prefills, decodes, logits = [], [], None
    for _ in range(reps):
        session.reset()
        start = time.perf_counter()
        out_logits = session.prefill(tokens[:, :prompt])
        prefills.append(prompt / (time.perf_counter() - start))
        steps = [out_logits[0, -1]]  # the prompt's last position (a --logits last archive returns only it)
        start = time.perf_counter()
        for t in range(prompt, prompt + decode):
            steps.append(session.decode(tokens[:, t:t + 1])[0, -1])
        decodes.append(decode / (time.perf_counter() - start))
        if logits is None:
            logits = np.stack(steps).astype(np.float32)  # positions prompt - 1 .. prompt + decode - 1
    np.save(out.with_suffix(".npy"), logits)
    out.with_suffix(".json").write_text(json.dumps({"prefill": statistics.median(prefills), "decode":
                                                    statistics.median(decodes), "prefills": prefills,
                                                    "decodes": decodes, "load_s": load}))


def worker_main(argv: list[str]) -> int:
    kind, *rest = argv
    if kind == "reference":
        worker_reference(Path(rest[0]), Path(rest[1]), Path(rest[2]))
    elif kind == "gdn":
        worker_gdn(Path(rest[0]), Path(rest[1]), int(rest[2]), int(rest[3]), int(rest[4]), Path(rest[5]))
    else:
        raise SystemExit(f"unknown worker {kind}")
    return 0


def call(command: list[str]) -> subprocess.CompletedProcess:
    """Run ``command``, its output captured; a failure raises with the end of its stderr."""
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command[:3])} ... failed ({result.returncode}):\n{result.stderr[-4000:]}")
    return result


def run_worker(args: list[str], cpu: int | None) -> None:
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", *args]
    if cpu is not None:
        command = ["taskset", "-c", str(cpu), *command]
    call(command)


# ----------------------------------------------------------------------------------------------- quality

def compare(reference: np.ndarray, logits: np.ndarray) -> dict:
    """Max |logit difference|, mean KL(P_ref || P) in nats over positions, top-1 agreement."""
    if logits.shape != reference.shape:
        raise ValueError(f"logits of shape {logits.shape}, reference {reference.shape}")
    kls, err, agree = [], 0.0, 0
    for start in range(0, reference.shape[0], 64):
        ref = reference[start:start + 64].astype(np.float64)
        got = logits[start:start + 64].astype(np.float64)
        err = max(err, float(np.abs(got - ref).max()))
        ref_log = ref - ref.max(-1, keepdims=True)
        ref_log -= np.log(np.exp(ref_log).sum(-1, keepdims=True))
        got_log = got - got.max(-1, keepdims=True)
        got_log -= np.log(np.exp(got_log).sum(-1, keepdims=True))
        kls.extend((np.exp(ref_log) * (ref_log - got_log)).sum(-1).tolist())
        agree += int((ref.argmax(-1) == got.argmax(-1)).sum())
    return {"max_err": err, "kl": float(np.mean(kls)), "top1": agree / reference.shape[0]}


# ----------------------------------------------------------------------------------------------- llama.cpp

def add_llama_cpp_options(parser: argparse.ArgumentParser, required: bool = False) -> None:
    """``--llama-cpp DIR`` (the source tree: convert_hf_to_gguf.py, include/) and ``--llama-cpp-build DIR`` (its
    cmake build folder: bin/, libllama.so; default DIR/build), defaulting to $LLAMA_CPP_DIR and $LLAMA_CPP_BUILD
    (docs/PERFORMANCE.md says how to build one)."""
    tree, build = os.environ.get("LLAMA_CPP_DIR"), os.environ.get("LLAMA_CPP_BUILD")
    parser.add_argument("--llama-cpp", type=Path, default=Path(tree) if tree else None,
                        required=required and not tree, help="a llama.cpp source tree (default $LLAMA_CPP_DIR); "
                        "without one the llama.cpp rows are skipped")
    parser.add_argument("--llama-cpp-build", type=Path, default=Path(build) if build else None,
                        help="its cmake build folder holding bin/ (default $LLAMA_CPP_BUILD, else TREE/build)")


class LlamaCpp:
    """A llama.cpp source tree and its build: the converter, llama-quantize, llama-bench and small C programs
    compiled against its public C API (``compile``)."""

    def __init__(self, tree: Path, workdir: Path, build: Path | None = None):
        self.tree = tree.resolve()
        if not (self.tree / "convert_hf_to_gguf.py").is_file():
            raise SystemExit(f"--llama-cpp {tree}: no convert_hf_to_gguf.py there")
        self.build = (build or self.tree / "build").resolve()
        self.bin = self.build / "bin"
        missing = [t for t in ("llama-bench", "llama-quantize") if not (self.bin / t).is_file()]
        libs = sorted(self.build.rglob("libllama.so"))
        if missing or not libs:
            lacking = ", ".join(missing) or "libllama.so"
            raise SystemExit(f"--llama-cpp-build {self.build}: lacks {lacking}; build it as docs/PERFORMANCE.md says "
                             "(cmake -DBUILD_SHARED_LIBS=ON, targets llama llama-bench llama-quantize)")
        self.libdir = libs[0].parent
        self.workdir = workdir
        self.wrapper = workdir / "convert_hf_to_gguf_any_pre.py"
        self.wrapper.write_text(CONVERT_WRAPPER)
        self.logits_exe = self.compile(LOGITS_C, "llama_logits")

    def compile(self, source_text: str, name: str) -> Path:
        """``source_text`` (C against include/llama.h) compiled into the work folder, linked to this build's
        libllama; the executable's path."""
        source = self.workdir / f"{name}.c"
        source.write_text(source_text)
        exe = self.workdir / name
        includes = [f"-I{self.tree / 'include'}", f"-I{self.tree / 'ggml' / 'include'}"]
        libs = [f"-L{self.libdir}", f"-Wl,-rpath,{self.libdir}", "-lllama", "-lggml", "-lggml-base"]
        subprocess.run(["cc", "-O2", "-o", str(exe), str(source), *includes, *libs], check=True)
        return exe

    def version(self) -> str:
        out = subprocess.run([str(self.bin / "llama-bench"), "--version"], capture_output=True, text=True)
        return (out.stdout + out.stderr).strip().splitlines()[0] if (out.stdout + out.stderr).strip() else "?"

    def convert(self, checkpoint: Path, out: Path, outtype: str) -> None:
        # --no-mtp: the checkpoint has no multi-token-prediction layer (transformers and gdn_export use none)
        call([sys.executable, str(self.wrapper), str(self.tree), str(checkpoint), "--outtype", outtype, "--no-mtp",
              "--outfile", str(out)])

    def quantize(self, source: Path, out: Path, kind: str) -> None:
        call([str(self.bin / "llama-quantize"), str(source), str(out), kind, "2"])

    def bench(self, gguf: Path, cpu: int, prompt: int, decode: int, reps: int) -> tuple[float, float]:
        def run(extra: list[str]) -> float:
            command = ["taskset", "-c", str(cpu), str(self.bin / "llama-bench"), "-m", str(gguf), "-t", "1",
                       "-r", str(reps), "-o", "json", *extra]
            (test,) = json.loads(call(command).stdout)
            return statistics.median(test["samples_ts"])

        return (run(["-p", str(prompt), "-n", "0"]),
                run(["-p", "0", "-n", str(decode), "-d", str(prompt)]))

    def logits(self, gguf: Path, tokens_path: Path, out: Path, cpu: int) -> np.ndarray:
        call(["taskset", "-c", str(cpu), str(self.logits_exe), str(gguf), str(tokens_path), str(out), "1"])
        n = tokens_path.stat().st_size // 4
        logits = np.fromfile(out, dtype=np.float32).reshape(n, -1)
        out.unlink()
        return logits

    def tensor_types(self, gguf: Path) -> dict[str, str]:
        sys.path.insert(0, str(self.tree / "gguf-py"))
        from gguf import GGUFReader

        reader = GGUFReader(str(gguf))
        return {t.name: t.tensor_type.name for t in reader.tensors}


# ----------------------------------------------------------------------------------------------- the run

def quantized_layout(archive: Path, fmt: str) -> str:
    """What a quantized archive holds for the tied table: a head of its own (a quantized copy) or the table alone,
    and the table's type (read from its .dat header)."""
    import tarfile

    with tarfile.open(archive) as tar:
        names = set(tar.getnames())
        table = next((n for n in names if n.endswith("embed_tokens.weight.dat")), None)
        item = tuple(int(v) for v in np.frombuffer(tar.extractfile(table).read(128), np.uint32, 2, 44)) \
            if table else (0, 0)
    head = any(n.endswith("lm_head.weight.dat") for n in names)
    kind = {"q4_0": "Q4_0", "int8": "int8", "int8x2": "int8 (inputs in 2 passes)", "f16": "f16"}[fmt]
    table_type = {(32, 0): "f32", (16, 0): "f16", (8, 4): "int8 + a scale per row"}.get(item, "?")
    return f"linear layers + a copy of the tied head in {kind}; table {table_type}" if head else \
        f"linear layers; tied table {table_type}, head included"


def versions() -> str:
    """gdn_export's commit (and whether the tree has changes) and tract's version."""
    from importlib.metadata import version

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True).stdout.strip()

    commit = git("rev-parse", "--short", "HEAD") or "?"
    dirty = " + uncommitted changes" if git("status", "--porcelain", "--untracked-files=no") else ""
    return f"gdn_export {commit}{dirty}, tract {version('tract')}"


def describe(types: dict[str, str]) -> str:
    """The GGUF's tensor types, counted; token_embd's named."""
    counts: dict[str, int] = {}
    for kind in types.values():
        counts[kind] = counts.get(kind, 0) + 1
    summary = ", ".join(f"{n} {k}" for k, n in sorted(counts.items(), key=lambda kv: -kv[1]))
    return f"token_embd {types.get('token_embd.weight', '?')}; tensors: {summary}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return worker_main(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_llama_cpp_options(parser)
    parser.add_argument("--layers", type=int, default=24, help="decoder layers (24: Qwen3.5 0.8B)")
    parser.add_argument("--formats", default="f32,f16,q4_0", help="a subset of f32,f16,f16-graph,q4_0,int8,int8x2 "
                        "(f16: --quantize f16, f16-graph: --dtype float16, both against llama.cpp's F16; int8: "
                        "against llama.cpp's Q8_0; int8x2: --int8-passes 2)")
    parser.add_argument("--sizes-only", action="store_true", help="convert every format and print the file sizes "
                        "only (no reference, no speed or quality): for a format too slow to run on this machine")
    parser.add_argument("--prompt", type=int, default=512, help="prefill length, tokens")
    parser.add_argument("--decode", type=int, default=64, help="decode steps after the prefill")
    parser.add_argument("--reps", type=int, default=3, help="measured rounds (median), both engines")
    parser.add_argument("--cpu", type=int, default=0, help="the core both engines are pinned to (taskset -c)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", type=Path, help="work folder (default: a temporary one, removed at the end); "
                        "a given one keeps the checkpoint for the next run (reused when it matches)")
    parser.add_argument("--keep", action="store_true", help="keep the archives and GGUFs (and --workdir)")
    parser.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    args = parser.parse_args(argv)
    formats = args.formats.split(",")
    if not formats or any(f not in GDN_FORMATS for f in formats):
        parser.error(f"--formats: a comma-separated subset of {','.join(GDN_FORMATS)}")
    if args.layers < 1 or args.prompt < 9 or args.decode < 1 or args.reps < 1:
        parser.error("--layers, --decode, --reps must be >= 1 and --prompt >= 9")
    if shutil.which("taskset") is None:
        parser.error("taskset (util-linux) is needed to pin both engines")

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench_vs_llamacpp_"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        return run(args, formats, workdir)
    finally:
        if args.workdir is None and not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
        elif not args.keep:  # a given --workdir keeps the checkpoint (reused when it matches), nothing else
            for path in workdir.iterdir():
                if path.is_file():
                    path.unlink()


def run(args, formats: list[str], workdir: Path) -> int:
    host = machine()
    log(f"machine: {host}; {versions()}; work folder {workdir}")
    llama = None
    if args.llama_cpp is None:
        skipped = "llama.cpp rows skipped: no --llama-cpp DIR given"
        log(skipped)
    else:
        llama = LlamaCpp(args.llama_cpp, workdir, args.llama_cpp_build)
        skipped = None
        log(f"llama.cpp: {llama.tree} ({llama.version()}); logits program compiled")
    args.versions = versions() + (f", llama.cpp {llama.version()}" if llama else "")

    checkpoint = workdir / "checkpoint"
    built = build_checkpoint(checkpoint, args.layers, args.seed)
    log(f"checkpoint: {built}")
    tokens = np.random.default_rng(args.seed).integers(0, TOKENIZER_SIZE, args.prompt + args.decode, dtype=np.int32)
    tokens_path = workdir / "tokens.i32"
    tokens.tofile(tokens_path)

    start = time.perf_counter()
    if args.sizes_only:
        return sizes_only(args, formats, workdir, checkpoint, llama, host, built)
    run_worker(["reference", str(checkpoint), str(tokens_path), str(workdir / "reference.npy")], None)
    reference = np.load(workdir / "reference.npy")
    (workdir / "reference.npy").unlink()
    log(f"transformers float32 reference logits {reference.shape} in {time.perf_counter() - start:.1f}s")

    # every conversion first (they use both cores), then per format gdn_export and llama.cpp back to back, so that
    # the two engines of one format are measured close in time (the machine may be shared)
    made = {}  # (engine, format) -> (file, conversion seconds, label)
    for fmt in formats:
        archive = workdir / f"model-{fmt}.nnef.tgz"
        start = time.perf_counter()
        call([sys.executable, "-m", "gdn_export.cli", "convert", str(checkpoint), "-o", str(archive), "--force",
              "--no-check", "--logits", "last", *GDN_FORMATS[fmt]])
        seconds = time.perf_counter() - start
        label = f"{fmt} ({quantized_layout(archive, fmt)})" if fmt in QUANTIZED or fmt == "f16" else fmt
        made["gdn", fmt] = (archive, seconds, label)
        log(f"gdn_export {fmt}: converted in {seconds:.1f}s, {archive.stat().st_size / 1e9:.2f} GB; "
            f"load average {load_average()}")
    if llama is not None:
        order = ["f32", *[f for f in formats if f != "f32"]] if set(QUANTIZED) & set(formats) else formats
        for fmt in order:
            gguf = workdir / f"model-{fmt}-{GGUF_FORMATS[fmt]}.gguf"
            start = time.perf_counter()
            if fmt in QUANTIZED:
                llama.quantize(made["llama", "f32"][0], gguf, GGUF_FORMATS[fmt])
            else:
                llama.convert(checkpoint, gguf, GGUF_FORMATS[fmt].lower())
            seconds = time.perf_counter() - start
            if fmt in QUANTIZED:  # a quantized GGUF's cost includes its F32 source's conversion
                seconds += made["llama", "f32"][1]
            types = llama.tensor_types(gguf)
            label = GGUF_FORMATS[fmt] if fmt not in QUANTIZED else \
                f"{GGUF_FORMATS[fmt]} (token_embd {types.get('token_embd.weight', '?')})"
            made["llama", fmt] = (gguf, seconds, label)
            log(f"llama.cpp {GGUF_FORMATS[fmt]}: made in {seconds:.1f}s, {gguf.stat().st_size / 1e9:.2f} GB, "
                f"{describe(types)}; load average {load_average()}")

    # judged where generation reads logits: the prompt's last position and every decode step
    judged = reference[args.prompt - 1:args.prompt + args.decode]
    measured, loads = {}, []
    for fmt in formats:
        for engine in ("gdn", "llama"):
            if (engine, fmt) not in made:
                continue
            path, seconds, label = made[engine, fmt]
            loads.append(float(load_average().split()[0]))
            start = time.perf_counter()
            if engine == "gdn":
                out = workdir / f"gdn-{fmt}"
                run_worker(["gdn", str(path), str(tokens_path), str(args.prompt), str(args.decode), str(args.reps),
                            str(out)], args.cpu)
                speed = json.loads(out.with_suffix(".json").read_text())
                prefill, decode = speed["prefill"], speed["decode"]
                quality = compare(judged, np.load(out.with_suffix(".npy")))
                out.with_suffix(".npy").unlink()
                detail = f"load {speed['load_s']:.1f}s; prefill {speed['prefills']}, decode {speed['decodes']} tok/s"
            else:
                prefill, decode = llama.bench(path, args.cpu, args.prompt, args.decode, args.reps)
                every = llama.logits(path, tokens_path, workdir / "llama_logits.f32", args.cpu)
                quality = compare(judged, every[args.prompt - 1:args.prompt + args.decode])
                detail = f"prefill {prefill:.2f}, decode {decode:.2f} tok/s"
            log(f"{engine} {fmt}: measured in {time.perf_counter() - start:.1f}s (load average before "
                f"{loads[-1]:.2f}): {detail}; {quality}")
            measured[engine, fmt] = dict(engine="gdn_export (tract)" if engine == "gdn" else "llama.cpp",
                                         format=label, size=path.stat().st_size, convert=seconds, prefill=prefill,
                                         decode=decode, **quality)
            if not args.keep:
                path.unlink()
    if not args.keep:
        for path, _, _ in made.values():
            path.unlink(missing_ok=True)
    rows = [measured[e, f] for e in ("gdn", "llama") for f in formats if (e, f) in measured]

    print_table(rows, args, host, built, skipped, args.markdown)
    print(f"load average (1 min) before each measurement: {min(loads):.2f} to {max(loads):.2f} "
          f"({os.cpu_count()} cores; other processes share the machine when it is over ~1)")
    return 0


def sizes_only(args, formats: list[str], workdir: Path, checkpoint: Path, llama, host: str, built) -> int:
    """``--sizes-only``: each format converted by both engines (gdn_export with --no-check), the file sizes."""
    print(f"machine: {host}; {args.versions}")
    print(f"model: Qwen3.5 0.8B text shape, {args.layers} layers, vocab {VOCAB}, tied, random weights "
          f"({built.parameters / 1e9:.3f} B parameters); file sizes only")
    print("| format | gdn_export | GB | llama.cpp | GB | ratio |")
    print("|---|---|---|---|---|---|")
    f32_gguf = None
    for fmt in formats:
        archive = workdir / f"model-{fmt}.nnef.tgz"
        call([sys.executable, "-m", "gdn_export.cli", "convert", str(checkpoint), "-o", str(archive), "--force",
              "--no-check", "--logits", "last", *GDN_FORMATS[fmt]])
        label = f"{fmt} ({quantized_layout(archive, fmt)})" if fmt in QUANTIZED else fmt
        size, llama_size, llama_label = archive.stat().st_size, float("nan"), "-"
        archive.unlink()
        if llama is not None:
            gguf = workdir / f"model-{fmt}-{GGUF_FORMATS[fmt]}.gguf"
            if fmt in QUANTIZED:
                if f32_gguf is None:
                    f32_gguf = workdir / "model-F32.gguf"
                    llama.convert(checkpoint, f32_gguf, "f32")
                llama.quantize(f32_gguf, gguf, GGUF_FORMATS[fmt])
            else:
                llama.convert(checkpoint, gguf, GGUF_FORMATS[fmt].lower())
            types = llama.tensor_types(gguf)
            llama_label = f"{GGUF_FORMATS[fmt]} (token_embd {types.get('token_embd.weight', '?')})"
            llama_size = gguf.stat().st_size
            gguf.unlink()
        print(f"| {fmt} | {label} | {size / 1e9:.3f} | {llama_label} | {llama_size / 1e9:.3f} | "
              f"{size / llama_size:.2f}x |", flush=True)
    if f32_gguf is not None:
        f32_gguf.unlink(missing_ok=True)
    return 0


def print_table(rows: list[dict], args, host: str, built, skipped: str | None, markdown: bool) -> None:
    print(f"machine: {host}; {args.versions}")
    print(f"model: Qwen3.5 0.8B text shape, {args.layers} layers (3 GDN : 1 attention), hidden {HIDDEN}, vocab "
          f"{VOCAB}, tied, random weights ({built.parameters / 1e9:.3f} B parameters); 1 thread pinned to core "
          f"{args.cpu}; prefill {args.prompt} tokens, decode {args.decode} tokens after it; median of {args.reps} "
          f"rounds; quality against transformers float32 (eager) at the prompt's last position and the "
          f"{args.decode} decode positions ({args.decode + 1} positions; gdn_export converted with --logits last, as "
          f"llama.cpp computes only the last position's logits)")
    header = ["engine", "format", "file GB", "convert s", f"prefill {args.prompt} tok/s", "decode tok/s",
              "max logit err", "mean KL (nats)", "top-1 agree"]
    lines = [[r["engine"], r["format"], f"{r['size'] / 1e9:.2f}", f"{r['convert']:.0f}", f"{r['prefill']:.1f}",
              f"{r['decode']:.2f}", f"{r['max_err']:.2e}", f"{r['kl']:.2e}", f"{100 * r['top1']:.1f}%"] for r in rows]
    if markdown:
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
        for line in lines:
            print("| " + " | ".join(line) + " |")
    else:
        widths = [max(len(h), *(len(line[i]) for line in lines)) if lines else len(h) for i, h in enumerate(header)]
        print("  ".join(h.ljust(w) for h, w in zip(header, widths)))
        for line in lines:
            print("  ".join(c.ljust(w) for c, w in zip(line, widths)))
    if skipped:
        print(skipped)


if __name__ == "__main__":
    sys.exit(main())
