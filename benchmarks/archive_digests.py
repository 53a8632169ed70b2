"""Digest of every archive member gdn_export writes, for every fixture: the guard of a refactor that must change
no output.

Converts every checkpoint under fixtures/ (float32; plus float16, q4_0, int8, --serving, --logits last and ONNX
conversions of a few) with no check, exports small gated delta-rule modules with every lowering through
``gdn_export.export`` (NNEF and ONNX), and prints one line per archive member: ``case member sha256``. graph.nnef's
properties that name the export date and the command line are left out of its digest (they differ from run to run).

    PYTHONPATH=$PWD python benchmarks/archive_digests.py > /tmp/after.txt
    diff /tmp/before.txt /tmp/after.txt   # empty: byte-identical archives
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import re
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "fixtures"
# graph.nnef's lines that change from run to run: torch-to-nnef's tract_core_properties give the export's date and
# command line
VOLATILE = re.compile(rb'^\s*\("(export_date|export_cmd)", ')

EXTRA = [  # (fixture, convert() keyword arguments, label)
    ("qwen3_5", {"dtype": "float16"}, "f16"),
    ("qwen3_next", {"dtype": "float16"}, "f16"),
    ("qwen3_5", {"quantize": "q4_0"}, "q4_0"),
    ("qwen3_5_moe", {"quantize": "q4_0", "quantize_embeddings": True}, "q4_0-emb"),
    ("qwen3_5", {"serving": True}, "serving"),
    ("qwen3_5_moe", {"serving": True}, "serving"),
    ("qwen3_5", {"logits": "last"}, "last"),
    ("qwen3_5", {"format": "onnx"}, "onnx"),
    ("qwen3_5_moe", {"format": "onnx"}, "onnx"),
    ("qwen3_next", {"format": "onnx", "lowering": "scan"}, "onnx-scan"),
    ("qwen3_5", {"lowering": "chunked"}, "chunked"),
    ("qwen3_5", {"lowering": "recurrent"}, "recurrent"),
    ("qwen3_5", {"runtime": "cuda"}, "cuda"),
    # int8 (linears to tract's integer matmul, tables gathered as codes and scales, negated): issue 22's graph passes
    ("qwen3_5", {"quantize": "int8"}, "int8"),
    ("qwen3_5", {"quantize": "int8", "int8_passes": 2}, "int8-2"),
    ("qwen3_5", {"quantize": "int8", "serving": True}, "int8-serving"),
    ("qwen3_5_moe", {"quantize": "int8"}, "int8"),
    ("qwen3_next", {"quantize": "int8", "int8_passes": 2}, "int8-2"),
    ("lara_mini", {"quantize": "int8"}, "int8"),  # a tied head
    ("fla_delta_net", {"quantize": "int8"}, "int8"),  # a tied head
    # f16 weights for a float32 graph (tables negated, gathered back by a graph pass)
    ("qwen3_5_vl", {"quantize": "f16"}, "f16w"),  # a tied head
    ("qwen3_5_moe", {"quantize": "f16", "serving": True}, "f16w-serving"),
]


def member_digests(path: Path) -> list[tuple[str, str]]:
    """(member, sha256) of a .nnef.tgz's members, or of a file (and its sibling external-data files); an archive
    member (an MTP head's ``mtp.nnef.tgz``) by its own members, ``mtp.nnef.tgz/graph.nnef`` and so on (its bytes hold
    its graph's export date)."""
    if path.name.endswith(".tgz"):
        rows = []
        with tarfile.open(path, "r:gz") as archive:
            for member in sorted(archive.getmembers(), key=lambda m: m.name):
                if not member.isfile():
                    continue
                data = archive.extractfile(member).read()
                if member.name.endswith(".nnef.tgz"):
                    with tempfile.TemporaryDirectory() as folder:
                        inner = Path(folder) / member.name
                        inner.write_bytes(data)
                        rows.extend((f"{member.name}/{name}", digest) for name, digest in member_digests(inner))
                    continue
                if member.name.endswith("graph.nnef"):
                    data = b"".join(line for line in io.BytesIO(data).readlines() if not VOLATILE.match(line))
                elif member.name == "gdn_export.json" and b'"digests"' in data:
                    # graph.nnef's recorded digest covers its volatile lines: left out like them
                    meta = json.loads(data)
                    meta["digests"].pop("graph.nnef", None)
                    meta["digests"].pop("mtp.nnef.tgz", None)
                    data = json.dumps(meta, indent=1).encode()
                rows.append((member.name, hashlib.sha256(data).hexdigest()))
        return rows
    return [(p.name, hashlib.sha256(p.read_bytes()).hexdigest()) for p in sorted(path.parent.iterdir())
            if p.is_file()]


def conversions() -> list[tuple[str, str, dict]]:
    fixtures = sorted(p.name for p in FIXTURES.iterdir() if (p / "config.json").is_file())
    cases = [(f"{name}/f32", name, {}) for name in fixtures]
    return cases + [(f"{name}/{label}", name, kwargs) for name, kwargs, label in EXTRA]


def small_exports(work: Path) -> list[tuple[str, Path | str]]:
    """gdn_export.export of one gated delta-rule module, with every lowering, to NNEF and ONNX."""
    import torch

    import gdn_export

    class Rule(torch.nn.Module):
        def forward(self, q, k, v, g, beta, s0):
            return gdn_export.gated_delta_rule(q, k, v, g, beta, s0, use_qk_l2norm=True)

    gen = torch.Generator().manual_seed(0)
    b, s, h, kd, vd = 1, 5, 2, 16, 16
    args = (torch.randn(b, s, h, kd, generator=gen), torch.randn(b, s, h, kd, generator=gen),
            torch.randn(b, s, h, vd, generator=gen), -torch.rand(b, s, h, generator=gen),
            torch.rand(b, s, h, generator=gen), torch.zeros(b, h, kd, vd))
    names = dict(input_names=["q", "k", "v", "g", "beta", "s0"], output_names=["o", "state"],
                 dynamic_axes={n: {1: "S"} for n in ("q", "k", "v", "g", "beta")})
    out = []

    def one(case, path, **kwargs):
        try:
            gdn_export.export(Rule(), args, path, check=False, **names, **kwargs)
            out.append((case, path))
        except Exception as err:  # a refusal is a result too
            out.append((case, f"ERROR {type(err).__name__}: {str(err).splitlines()[0][:160]}"))

    for lowering in ("auto", "native", "scan", "recurrent", "chunked"):
        one(f"export/{lowering}", work / f"rule_{lowering}.nnef.tgz", lowering=lowering)
    for lowering in ("auto", "native", "scan"):
        folder = work / f"onnx_{lowering}"
        folder.mkdir()
        one(f"export-onnx/{lowering}", folder / "rule.onnx", lowering=lowering, format="onnx")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=None, help="a substring of the cases to run")
    args = parser.parse_args()
    try:
        from gdn_export.pipeline.convert import convert
    except ImportError:  # the tree before the layout of issue 22 (the baseline)
        from gdn_export.hf.convert import convert

    with tempfile.TemporaryDirectory(prefix="digests_") as tmp:
        work = Path(tmp)
        for case, fixture, kwargs in conversions():
            if args.only and args.only not in case:
                continue
            folder = work / case.replace("/", "__")
            folder.mkdir()
            suffix = ".onnx" if kwargs.get("format") == "onnx" else ".nnef.tgz"
            path = folder / f"model{suffix}"
            try:
                convert(FIXTURES / fixture, path, check=False, **kwargs)
            except Exception as err:  # a refusal is a result too: it must stay the same
                print(f"{case} ERROR {type(err).__name__}: {str(err).splitlines()[0][:160]}", flush=True)
                continue
            for member, digest in member_digests(path):
                print(f"{case} {member} {digest}", flush=True)
        if not args.only or "export" in args.only:
            for case, path in small_exports(work):
                if isinstance(path, str):
                    print(f"{case} {path}", flush=True)
                    continue
                for member, digest in member_digests(path):
                    print(f"{case} {member} {digest}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
