"""Speculative decoding (issue 37): what a verify call costs, what drafts are kept, what it gives, in one run.

    python benchmarks/bench_speculative.py [--curve ARCHIVE]... [--trained ARCHIVE] [--prompts 8]
                                           [--new-tokens 128] [--reps 5] [--markdown]

1. The verify cost curve (``--curve``, repeatable: e.g. the 0.8B Qwen3.5 shape in int8, f16, f32, or one archive
   before and after a change): after a context of 128 tokens, one ``Session.verify`` call of k = 1..16 tokens, then
   ``commit(0)`` (the states go back: every call starts from the same context), median of ``--reps``, the archives'
   calls interleaved; each k's time over k = 1's (what k tokens in one call cost against one token). A call of k
   tokens is what a step with k - 1 drafts runs.
2. On the trained fixture (``--trained``: its archive, every position's logits), held-out continuations: ``--prompts``
   prompts of 256 tokens cut from ``heldout.txt`` (the code the model never saw in training) at evenly spaced line
   starts, ``--new-tokens`` new tokens each, per method (plain decoding; prompt lookup with K = 2, 4, 8 drafts of
   n-grams of 1-3 tokens, and K = 2, 4 of n-grams of 2-3 tokens, the default): greedy, sampled (temperature
   0.7, the fixture's top-k 20 and top-p 0.8, seeded), and the first 32 greedy tokens
   (before the repetition loops the small model falls into). Per method: tokens per model call after the first
   token (the mean accepted length: 1 for plain decoding), the drafts kept over the drafts made, tokens/s after the
   first token and its ratio to plain decoding measured in the same run, and whether the greedy tokens equal plain
   decoding's (they must). The fixture's calls cost little next to Python's per-step work, so its tokens/s say
   little about a large model: the last column projects the 0.8B shape from the curve of step 1 (the first
   ``--curve`` archive): every call the method made on the fixture (its token count: kept tokens recomputed, the
   sampled one, the drafts) priced at that curve's time for as many tokens, against one one-token call per token;
   and priced as if the kept tokens of a step whose drafts were not all kept ran at once in a call of their own
   (the simplest rollback) instead of with the next call (what ``Session.commit`` does). "recomputed per token":
   the kept tokens run a second time, per token generated.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gdn_export.run.generation import SpeculativeConfig, generate  # noqa: E402
from gdn_export.run.session import Session  # noqa: E402

METHODS = {"plain": None,
           "ngram K=2, n 1-3": SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_min=1),
           "ngram K=4, n 1-3": SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1),
           "ngram K=8, n 1-3": SpeculativeConfig(num_speculative_tokens=8, prompt_lookup_min=1),
           "ngram K=2, n 2-3": SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_min=2),
           "ngram K=4, n 2-3 (default)": SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=2)}


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def verify_curves(paths: list[Path], reps: int, context: int = 128, longest: int = 16) -> dict[str, dict[int, float]]:
    """Per archive, seconds of one verify call of k tokens after ``context`` tokens, median of ``reps`` (k =
    1..``longest``); the archives' calls interleaved (every k of every archive in each round), so that a slow spell
    of a shared machine hits them alike."""
    sessions = [Session(path) for path in paths]
    rng = np.random.default_rng(0)
    vocab = sessions[0].metadata["vocab_size"]
    context_ids = rng.integers(0, vocab, (1, context))
    for session in sessions:
        session.prefill(context_ids)
    times = [{k: [] for k in range(1, longest + 1)} for _ in sessions]
    for k in range(1, longest + 1):  # one warm-up call per size (tract's first call of a shape allocates)
        for session in sessions:
            session.verify(rng.integers(0, vocab, (1, k)))
            session.commit(0)
    for _ in range(reps):
        for k in range(1, longest + 1):
            ids = rng.integers(0, vocab, (1, k))
            for session, found in zip(sessions, times):
                start = time.perf_counter()
                session.verify(ids)
                found[k].append(time.perf_counter() - start)
                session.commit(0)
    return {path.name: {k: statistics.median(v) for k, v in found.items()} for path, found in zip(paths, times)}


class CountingSession(Session):
    """A Session that records every call it runs: (tokens, of which pending: kept tokens run again)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[tuple[int, int]] = []

    def prefill(self, input_ids):
        self.calls.append((np.asarray(input_ids).shape[1] + self.pending, self.pending))
        return super().prefill(input_ids)


def held_out_prompts(session: Session, text: str, count: int, length: int = 256) -> list[list[int]]:
    lines = np.cumsum([0] + [len(line) for line in text.splitlines(keepends=True)])
    prompts = []
    for i in range(count):
        start = int(lines[np.searchsorted(lines, len(text) * i // count)])
        ids = session.tokenizer.encode(text[start:start + length * 8]).ids
        prompts.append(ids[:length])
    return prompts


def run_method(session: CountingSession, prompts, spec, new_tokens: int, **sampling) -> dict:
    """Every prompt continued with ``spec``: tokens, calls after the first token, drafted/kept, decode seconds."""
    out = {"tokens": [], "calls": [], "drafted": 0, "accepted": 0, "seconds": 0.0, "count": 0}
    for i, prompt in enumerate(prompts):
        session.calls = []
        tokens = generate(session, prompt, new_tokens, stop_token_ids=[], speculative=spec,
                          **{k: (v + i if k == "seed" else v) for k, v in sampling.items()})
        ids, first = [], None
        for token in tokens:
            if first is None:
                first, session.calls = time.perf_counter(), []
            ids.append(token.token_id)
        out["seconds"] += time.perf_counter() - first
        out["count"] += len(ids) - 1
        out["tokens"].append(ids)
        out["calls"].extend(session.calls)
        out["drafted"] += tokens.generation.drafted
        out["accepted"] += tokens.generation.accepted
    return out


def projected_cost(calls: list[tuple[int, int]], curve: dict[int, float], eager: bool = False) -> float:
    """Seconds the calls take at the curve's prices (beyond its longest k: its last step's slope). ``eager``: as if
    the kept tokens of a step that went back ran at once in a call of their own (``commit(j, recompute=True)``)
    instead of with the next call."""
    longest = max(curve)
    slope = curve[longest] - curve[longest - 1]

    def price(k: int) -> float:
        return curve[k] if k in curve else curve[longest] + (k - longest) * slope

    if not eager:
        return sum(price(k) for k, _ in calls)
    return sum(price(k - pending) + (price(pending) if pending else 0.0) for k, pending in calls)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--curve", type=Path, action="append", default=[],
                        help="an archive whose verify cost curve is measured (repeatable)")
    parser.add_argument("--trained", type=Path, default=None,
                        help="the trained fixture's archive (gdn-export convert fixtures/qwen3_5_trained)")
    parser.add_argument("--text", type=Path, default=ROOT / "fixtures" / "qwen3_5_trained" / "heldout.txt")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()

    curves = {}
    if args.curve:
        log(f"verify cost curves of {', '.join(str(path) for path in args.curve)} (interleaved)")
        curves = verify_curves(args.curve, args.reps)
    if curves:
        print("\n## Verify cost: one call of k tokens after 128 of context (median; ratio to k = 1)\n")
        names = list(curves)
        print("| k | " + " | ".join(f"{n} ms | x k=1" for n in names) + " |")
        print("|---|" + "---|---|" * len(names))
        for k in range(1, 17):
            cells = [f"{curves[n][k] * 1e3:.1f} | {curves[n][k] / curves[n][1]:.2f}x" for n in names]
            print(f"| {k} | " + " | ".join(cells) + " |")

    if args.trained is None:
        return 0
    session = CountingSession(args.trained)
    text = args.text.read_text(encoding="utf-8")
    prompts = held_out_prompts(session, text, args.prompts)
    list(generate(session, prompts[0], 4))  # plan before anything is timed
    curve = curves[next(iter(curves))] if curves else None
    modes = {"greedy": (args.new_tokens, dict(temperature=0.0)),
             "sampled T=0.7": (args.new_tokens, dict(temperature=0.7, top_k=20, top_p=0.8, seed=0)),
             "greedy, first 32": (32, dict(temperature=0.0))}
    print(f"\n## Held-out continuations of the trained fixture ({args.prompts} prompts of 256 tokens)\n")
    head = "| mode | method | tokens per call | drafts kept | recomputed per token | tokens/s | x plain | same tokens |"
    if curve:
        head += f" 0.8B projection ({next(iter(curves))}) | the same, kept tokens rerun at once |"
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for mode, (count, sampling) in modes.items():
        plain = None
        for name, spec in METHODS.items():
            log(f"{mode}: {name}")
            result = run_method(session, prompts, spec, count, **sampling)
            rate = result["count"] / result["seconds"]
            if plain is None:
                plain = dict(result, rate=rate)
            per_call = result["count"] / max(1, len(result["calls"]))
            kept = f"{result['accepted']}/{result['drafted']}" if spec else "-"
            same = ("yes" if result["tokens"] == plain["tokens"] else "NO") if sampling["temperature"] == 0 else "n/a"
            recomputed = sum(pending for _, pending in result["calls"]) / result["count"]
            row = (f"| {mode} | {name} | {per_call:.2f} | {kept} | {recomputed:.2f} | {rate:.1f} | "
                   f"{rate / plain['rate']:.2f}x | {same} |")
            if curve:
                plain_cost = result["count"] * curve[1]
                row += (f" {plain_cost / projected_cost(result['calls'], curve):.2f}x |"
                        f" {plain_cost / projected_cost(result['calls'], curve, eager=True):.2f}x |")
            print(row, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
