"""Each case of issue 25 ("a server you can put in front of users") run against the real commands, with what it gets
now: the answer (HTTP status and code, or exit status and first line), seconds, and extra memory (peak RSS over the
resting RSS, from /proc for the server, from getrusage for a command).

    python benchmarks/server_bounds.py ARCHIVE.nnef.tgz CHECKPOINT_DIR [--issue 25|34|all|none] [--large BIG.nnef.tgz]

ARCHIVE: an archive converted without --serving from CHECKPOINT_DIR (fixtures/qwen3_5: context 256 tokens).
``--issue 34``: the cases of issue 34 (hostile archives and requests) at the issue's sizes; ``--large``: the cost of
the archive check (members, headers, digests) against tract's load of a large archive, which is resealed first
(digests recorded) when written before them.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from functools import partial
from pathlib import Path

CLI = [sys.executable, "-m", "gdn_export.cli"]
GIB = 1 << 30
rows: list[tuple[str, str, str, str]] = []

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers import Zeros, raw, rewritten  # noqa: E402  (the server tests' HTTP client and archive rewriter)

request = partial(raw, timeout=600)  # a tokenization of megabytes outlasts the tests' 60 s


def kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def command(case: str, args: list[str], env: dict | None = None, limit: int | None = None) -> None:
    """Run ``gdn-export ARGS`` under a parent that reports its peak RSS (``limit``: the child's address-space limit
    in bytes); one row."""
    measure = ("import resource, subprocess, sys; done = subprocess.run(sys.argv[1:]" +
               (f", preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, ({limit}, {limit}))" if limit else "") +
               "); "
               "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); "
               "sys.exit(done.returncode)")
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", measure, *CLI, *args], capture_output=True, text=True,
                          env=dict(os.environ, **(env or {})), timeout=600)
    seconds = time.perf_counter() - start
    *lines, peak = done.stderr.strip().splitlines()
    lines = [line for line in lines if not line.startswith("[")]  # progress lines
    lines = [line for line in lines if line.strip()]
    rows.append((case, f"exit {done.returncode}: {lines[0][:150] if lines else ''} ({len(lines)} line(s))",
                 f"{seconds:.1f}", f"{int(peak) / 1024:.0f} MiB peak (whole process)"))


def start_server(args: list[str], env: dict, log: Path, timeout: float = 150.0):
    """``gdn-export serve ARGS --port 0`` (stderr in ``log``), once it listens: (the process, its base url)."""
    with open(log, "w") as err:
        process = subprocess.Popen([*CLI, "serve", *args, "--port", "0"], stdout=subprocess.DEVNULL, stderr=err,
                                   env=dict(os.environ, PYTHONUNBUFFERED="1", **env))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in log.read_text().splitlines():
            if " on http://127.0.0.1:" in line:
                return process, "http://127.0.0.1:" + line.split(" on http://127.0.0.1:")[1].split()[0]
        if process.poll() is not None:
            raise SystemExit(log.read_text())
        time.sleep(0.05)
    process.kill()
    raise SystemExit(f"the server did not start within {timeout:.0f} s")


def big_prompt(base: str, auth: dict, megabytes: int, row) -> None:
    latencies, running = [], threading.Event()

    def poll():
        while running.is_set():
            begin = time.perf_counter()
            request(base, "GET", "/health")
            latencies.append(time.perf_counter() - begin)

    running.set()
    poller = threading.Thread(target=poll)
    poller.start()
    start = time.perf_counter()
    status, answer = request(base, "POST", "/v1/completions", json.dumps(
        {"prompt": "hello world, the cat sat. " * (megabytes * 1_000_000 // 26)}), auth)
    seconds = time.perf_counter() - start
    running.clear()
    poller.join()
    row(f"{megabytes} MB text prompt (/health slowest {max(latencies):.2f} s over {len(latencies)} polls)", status,
        answer, seconds)


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("archive", type=Path)
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--issue", choices=["25", "34", "all", "none"], default="all")
    parser.add_argument("--large", type=Path, help="a large archive: the check's cost against tract's load")
    args = parser.parse_args()
    if args.issue in ("34", "all"):
        issue34(args.archive, args.checkpoint)
    if args.large is not None:
        check_cost(args.large)
    if args.issue in ("25", "all"):
        issue25(args.archive, args.checkpoint)
    print_rows()


def issue25(archive: Path, checkpoint: Path) -> None:
    work = Path(tempfile.mkdtemp(prefix="server_bounds_"))
    key = "k" * 32
    try:
        evil = rewritten(archive, work / "evil.nnef.tgz", add={
            "chat_template.jinja": b"{% for i in range(50000) %}{{ 'x' * 20000 }}{% endfor %}"})
        process, base = start_server([str(evil), "--max-model-len", "300000", "--shutdown-grace", "2"],
                                     {"GDN_EXPORT_API_KEY": key, "GDN_EXPORT_ALLOW_LONG_MAX_MODEL_LEN": "1"},
                                     work / "serve.log")
        auth = {"Authorization": f"Bearer {key}"}
        rest = kib(process.pid, "VmRSS")

        def health():
            return request(base, "GET", "/health")[1]

        def http_row(case, status, answer, seconds):
            code = answer["error"]["code"] if isinstance(answer, dict) and "error" in answer else ""
            rows.append((case, f"HTTP {status} {code}", f"{seconds:.2f}",
                         f"+{(kib(process.pid, 'VmHWM') - rest) / 1024:.0f} MiB peak (server)"))

        # 1. a 100,000-token prompt, the client leaves after 2 s
        body = json.dumps({"prompt": [(i * 7919) % 100 + 1 for i in range(100_000)], "max_tokens": 8}).encode()
        host, port = base.removeprefix("http://").split(":")
        client = socket.create_connection((host, int(port)))
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + key.encode()
                       + b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        while health()["busy"] == 0:
            time.sleep(0.02)
        time.sleep(2)
        client.close()
        left = time.perf_counter()
        while health()["busy"]:
            time.sleep(0.02)
        rows.append(("100,000-token prompt, client leaves (no --serving)", "worker freed",
                     f"{time.perf_counter() - left:.2f}", f"+{(kib(process.pid, 'VmHWM') - rest) / 1024:.0f} MiB "
                     "peak (server)"))
        rest = kib(process.pid, "VmRSS")
        # 2. context: 300 prompt tokens + 512 on a 256-token model (the server here allows 300,000: a second server
        # would cost another start; the rule is the same, shown by generate below and by the tests)
        start = time.perf_counter()
        status, answer = request(base, "POST", "/v1/completions", json.dumps(
            {"prompt": [5] * 300, "max_tokens": 300_000}), auth)
        http_row("prompt + max_tokens over --max-model-len", status, answer, time.perf_counter() - start)
        # 3. the chat template bomb
        start = time.perf_counter()
        status, answer = request(base, "POST", "/v1/chat/completions", json.dumps(
            {"messages": [{"role": "user", "content": "hi"}]}), auth)
        http_row("chat template making 1 GB of text", status, answer, time.perf_counter() - start)
        # 4. 6 MB and 3 MB prompts while /health is polled (--max-model-len 300000: 3.9 M characters of this
        # vocabulary's longest token may fit; the 6 MB one is refused from its length, the 3 MB one tokenized)
        for megabytes in (6, 3):
            big_prompt(base, auth, megabytes, http_row)
            rest = kib(process.pid, "VmRSS")

        # 5. keys and names
        status, answer = request(base, "GET", "/v1/models")
        http_row("GET /v1/models without the key", status, answer, 0)
        status, answer = request(base, "GET", "/v1/models", headers=auth)
        rows.append(("GET /v1/models with the key", f"HTTP {status} ids {[m['id'] for m in answer['data']]}", "", ""))
        status, answer = request(base, "GET", "/v1/models/evil", headers=auth)
        rows.append(("GET /v1/models/evil", f"HTTP {status} id {answer.get('id')}", "", ""))
        # 6. SIGTERM with a stream and a whole answer in flight
        answers = {}

        def ask(stream):
            answers[stream] = request(base, "POST", "/v1/completions", json.dumps(
                {"prompt": [1, 2, 3], "max_tokens": 200_000, "ignore_eos": True, "stream": stream}), auth)

        askers = [threading.Thread(target=ask, args=(s,)) for s in (True, False)]
        for asker in askers:
            asker.start()
        while health()["busy"] == 0:
            time.sleep(0.02)
        start = time.perf_counter()
        process.send_signal(signal.SIGTERM)
        for asker in askers:
            asker.join()
        process.wait(60)
        seconds = time.perf_counter() - start
        log = (work / "serve.log").read_text()
        last = [line for line in answers[True][1].splitlines() if line.startswith("data: ")][-2:]
        rows.append(("SIGTERM, a stream and a whole answer in flight (grace 2 s)",
                     f"exit {process.returncode}; stream ends {' | '.join(last)[:90]}...; whole answer HTTP "
                     f"{answers[False][0]} {answers[False][1]['error']['code']}; tracebacks: "
                     f"{log.count('Traceback')}", f"{seconds:.2f}", ""))

        # the commands
        command("generate --max-new-tokens 100000 --ignore-eos (256-token model)",
                ["generate", str(archive), "--prompt-ids", "1,2", "--max-new-tokens", "100000", "--ignore-eos"])
        command("generate --chat, template making 1 GB of text", ["generate", str(evil), "--chat", "--prompt", "hi"])
        big = work / "big.nnef.tgz"
        with tarfile.open(big, "w") as tar:
            data = json.dumps({"states": [], "generation_files": ["tokenizer.json"], "vocab_size": 128}).encode()
            info = tarfile.TarInfo("gdn_export.json")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        with open(big, "r+b") as handle:
            handle.seek(512 + ((len(data) + 511) // 512) * 512)
            member = tarfile.TarInfo("tokenizer.json")
            member.size = 3 * GIB
            handle.write(member.tobuf(format=tarfile.GNU_FORMAT) + b"{" * 1024)
            handle.truncate()
        command(f"archive of {big.stat().st_size} B whose tokenizer.json claims 3 GiB",
                ["generate", str(big), "--prompt", "hi"])
        for field, value in (("vocab_size", -5), ("serving", "yes"), ("states", {"a": 1})):
            bad = rewritten(archive, work / "bad.nnef.tgz", metadata={field: value})
            command(f"gdn_export.json {field}: {json.dumps(value)}", ["generate", str(bad), "--prompt-ids", "1"])
        data = archive.read_bytes()
        (work / "cut.nnef.tgz").write_bytes(data[:len(data) // 2])
        command("archive cut in half", ["generate", str(work / "cut.nnef.tgz"), "--prompt-ids", "1"])
        folder = work / "checkpoint"
        shutil.copytree(checkpoint, folder)
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps(dict(config, hidden_size=10**9)))
        command("checkpoint config hidden_size 10**9", ["convert", str(folder), "-o", str(work / "o.nnef.tgz"),
                                                        "--no-check"])
        (folder / "config.json").write_text(json.dumps(dict(config, num_attention_heads="4")))
        command("checkpoint config num_attention_heads \"4\"", ["convert", str(folder), "-o",
                                                                 str(work / "o.nnef.tgz"), "--no-check"])
        (folder / "config.json").write_text(json.dumps(config))
        weights = folder / "model.safetensors"
        raw = weights.read_bytes()
        length = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8:8 + length])
        for name, info in header.items():
            if name != "__metadata__":
                info["data_offsets"] = [0, info["data_offsets"][1] - info["data_offsets"][0]]
        text = json.dumps(header, separators=(",", ":")).encode()
        weights.write_bytes(raw[:8] + text + b" " * (length - len(text)) + raw[8 + length:])
        command("safetensors, every tensor at offset 0", ["convert", str(folder), "-o", str(work / "o.nnef.tgz"),
                                                          "--no-check"])
        command("--prompt-ids 1,,2", ["generate", str(archive), "--prompt-ids", "1,,2"])
        command("--stop ''", ["generate", str(archive), "--prompt-ids", "1", "--stop", ""])
        command("--port 70000", ["serve", str(archive), "--port", "70000"])
    finally:
        shutil.rmtree(work, ignore_errors=True)


# --- issue 34: hostile archives and requests ----------------------------------------------------------------------

def with_members(source: Path, target: Path, zeros: dict[str, int] | None = None, flip: str | None = None,
                 level: int = 6) -> Path:
    """A copy of ``source`` with zero-filled members added (not in its digests: an attacker's) or 64 bytes of member
    ``flip`` inverted after its header (the gzip stream rewritten around them: only the digest tells)."""
    with tarfile.open(source) as tar, tarfile.open(target, "w:gz", compresslevel=level) as out:
        for member in tar.getmembers():
            data = tar.extractfile(member).read()
            if member.name == flip:
                data = data[:1024] + bytes(b ^ 0xFF for b in data[1024:1088]) + data[1088:]
            out.addfile(member, io.BytesIO(data))
        for name, size in (zeros or {}).items():
            info = tarfile.TarInfo(name)
            info.size = size
            out.addfile(info, io.BufferedReader(Zeros(size), 1 << 20))
    return target


def timed_request(base: str, body: str | bytes, path: str = "/v1/completions") -> tuple[int, dict, float, float]:
    """(status, answer, seconds, the slowest /health answer meanwhile)."""
    latencies, running = [0.0], threading.Event()

    def poll():
        while running.is_set():
            begin = time.perf_counter()
            request(base, "GET", "/health")
            latencies.append(time.perf_counter() - begin)
            time.sleep(0.02)

    running.set()
    poller = threading.Thread(target=poll)
    poller.start()
    start = time.perf_counter()
    status, answer = request(base, "POST", path, body)
    seconds = time.perf_counter() - start
    running.clear()
    poller.join()
    return status, answer, seconds, max(latencies)


def quietly(function, *args):
    """``function(*args)`` for a thread whose connection the test cuts (the server exits under it)."""
    def run():
        try:
            function(*args)
        except OSError:
            pass
    return run


def signal_twice(process, base: str, signum: int) -> float:
    """A long request sent, ``signum`` twice 0.5 s apart: the seconds from the second to the process's exit."""
    body = json.dumps({"prompt": [1, 2], "max_tokens": 200_000, "ignore_eos": True})
    threading.Thread(target=quietly(request, base, "POST", "/v1/completions", body), daemon=True).start()
    time.sleep(0.5)
    process.send_signal(signum)
    time.sleep(0.5)
    start = time.perf_counter()
    process.send_signal(signum)
    process.wait(60)
    return time.perf_counter() - start


def issue34(archive: Path, checkpoint: Path) -> None:
    work = Path(tempfile.mkdtemp(prefix="server_bounds_34_"))
    try:
        long = {"GDN_EXPORT_ALLOW_LONG_MAX_MODEL_LEN": "1"}  # a request that lasts through the shutdown grace
        process, base = start_server([str(archive), "--request-timeout", "5", "--max-model-len", "300000"], long,
                                     work / "serve.log")
        rest = kib(process.pid, "VmRSS")

        def http_row(case, status, answer, seconds, slowest=None):
            error = answer.get("error", {}) if isinstance(answer, dict) else {}
            health = f"; /health slowest {slowest:.2f} s" if slowest is not None else ""
            rows.append((case, f"HTTP {status} {error.get('param') or ''} {error.get('message', '')[:70]}{health}",
                         f"{seconds:.2f}", f"+{(kib(process.pid, 'VmHWM') - rest) / 1024:.0f} MiB peak (server)"))

        for count in (300_000, 600_000):
            body = json.dumps({"prompt": [1, 2, 3], "max_tokens": 8, "stop": [str(i) for i in range(count)]})
            status, answer, seconds, slowest = timed_request(base, body)
            http_row(f"{count:,} stop strings ({len(body) / 1e6:.1f} MB), --request-timeout 5", status, answer,
                     seconds, slowest)
        for case, body, path in (
                ("lone surrogate in a prompt", '{"prompt": "a\\ud800", "max_tokens": 2}', "/v1/completions"),
                ("lone surrogate in a message", '{"messages": [{"role": "user", "content": "\\ud800"}]}',
                 "/v1/chat/completions"),
                ("JSON nested 100,000 deep", '{"prompt": [1], "x": ' + "[" * 100_000 + "]" * 100_000 + "}",
                 "/v1/completions"),
                ("100,000 stop_token_ids", json.dumps({"prompt": [1], "stop_token_ids": list(range(100_000))}),
                 "/v1/completions")):
            status, answer, seconds, slowest = timed_request(base, body, path)
            http_row(case, status, answer, seconds, slowest)
        host, port = base.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000000\r\n\r\n" + b"{" * 1000)
        time.sleep(1)
        # a second signal during the grace, a request in flight (the first server: after the upload above)
        seconds = signal_twice(process, base, signal.SIGTERM)
        log = (work / "serve.log").read_text()
        rows.append(("client leaves mid-upload; then SIGTERM twice during the grace",
                     f"log: {sum('disconnected while sending' in line for line in log.splitlines())} line(s) for "
                     f"the upload; exit {process.returncode}; tracebacks: {log.count('Traceback')}",
                     f"{seconds:.2f} (after the 2nd)", ""))
        process, base = start_server([str(archive), "--shutdown-grace", "30", "--max-model-len", "300000"], long,
                                     work / "serve2.log")
        seconds = signal_twice(process, base, signal.SIGINT)
        log = (work / "serve2.log").read_text()
        rows.append(("Ctrl-C twice (grace 30 s)", f"exit {process.returncode}; tracebacks: {log.count('Traceback')}",
                     f"{seconds:.2f} (after the 2nd)", ""))
        broken = rewritten(archive, work / "broken.nnef.tgz", add={"chat_template.jinja": b"{% for x in %}"})
        process, base = start_server([str(broken)], {}, work / "serve3.log")
        status, answer, seconds, _ = timed_request(base, json.dumps({"prompt": [1, 2], "max_tokens": 2}))
        chat_status, chat, _, _ = timed_request(base, json.dumps({"messages": [{"role": "user", "content": "x"}]}),
                                                "/v1/chat/completions")
        process.terminate()
        process.wait(60)
        warning = [line for line in (work / "serve3.log").read_text().splitlines() if "compile" in line]
        rows.append(("chat template that does not compile", f"serve starts ({len(warning)} warning line); "
                     f"completion HTTP {status}; chat HTTP {chat_status} {chat['error']['message'][:60]}", "", ""))

        replace = rewritten(archive, work / "replace.nnef.tgz", add={
            "chat_template.jinja": b"{{ ('x'*50000)|replace('x','x'*50000) }}"})
        command("generate --chat, ('x'*50000)|replace('x','x'*50000)", ["generate", str(replace), "--chat",
                                                                        "--prompt", "hi"])
        unused = with_members(archive, work / "unused.nnef.tgz", zeros={"unused.dat": 3 << 29})
        for name in ("info", "generate", "serve"):
            extra = {"generate": ["--prompt-ids", "1"], "serve": ["--port", "0"]}.get(name, [])
            command(f"{name}: a {unused.stat().st_size / 1e6:.1f} MB archive with a 1.5 GiB zero member",
                    [name, str(unused), *extra])
        three = with_members(archive, work / "three.nnef.tgz", zeros={f"unused{i}.dat": 3 << 29 for i in range(3)})
        command("info: three 1.5 GiB zero members", ["info", str(three)])
        with tarfile.open(archive) as tar:
            table = next(m.name for m in tar.getmembers() if "embed_tokens" in m.name)
        damaged = with_members(archive, work / "damaged.nnef.tgz", flip=table, level=0)
        for name in ("info", "generate"):
            command(f"{name}: 64 bytes of the embedding table flipped", [name, str(damaged)] +
                    (["--prompt-ids", "1"] if name == "generate" else []))
        with tarfile.open(archive) as tar:
            meta = json.loads(tar.extractfile("gdn_export.json").read())
        for shape in (["B", 4, 16, 12_000_000], ["B", 4, 100_000, 100_000]):
            states = [dict(s) for s in meta["states"]]
            index = next(i for i, s in enumerate(states) if s["kind"] == "recurrent")
            states[index]["shape"] = shape
            bad = rewritten(archive, work / "states.nnef.tgz", metadata={"states": states})
            command(f"generate: state {shape}", ["generate", str(bad), "--prompt-ids", "1"])
            if shape[-1] == 12_000_000:
                command(f"generate: state {shape} under a 6 GB address-space limit",
                        ["generate", str(bad), "--prompt-ids", "1"], limit=6 << 30)
        deep = rewritten(archive, work / "deep.nnef.tgz", raw_metadata=b'{"a": ' + b"[" * 100_000 + b"]" * 100_000
                         + b"}")
        command("info: gdn_export.json nested 100,000 deep", ["info", str(deep)])
        folder = work / "checkpoint"
        shutil.copytree(checkpoint, folder)
        (folder / "config.json").write_text('{"model_type": ' + "[" * 100_000 + "]" * 100_000 + "}")
        command("convert: config.json nested 100,000 deep", ["convert", str(folder), "-o", str(work / "o.nnef.tgz"),
                                                             "--no-check"])
        text = work / "text.txt"
        text.write_text("the quick brown fox jumps over the lazy dog " * 500)
        command("perplexity --ctx 100000 (256-token model)", ["perplexity", str(archive), str(text), "--ctx",
                                                              "100000"])
        command("convert --tract-version 9.9.9", ["convert", str(checkpoint), "-o", str(work / "o.nnef.tgz"),
                                                  "--tract-version", "9.9.9"])
        out = work / "out"
        out.mkdir()
        killed = subprocess.Popen([*CLI, "convert", str(checkpoint), "-o", str(out / "m.nnef.tgz"), "--no-check"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        while not any(p.name.startswith(".gdn_export_") for p in out.iterdir()):
            time.sleep(0.05)
        killed.kill()
        killed.wait()
        left = len([p for p in out.iterdir() if p.name.startswith(".gdn_export_")])
        subprocess.run([*CLI, "convert", str(checkpoint), "-o", str(out / "m.nnef.tgz"), "--no-check"],
                       capture_output=True, timeout=600)
        rows.append(("convert SIGKILLed, then converted again", f"staging folders: {left} after the kill, "
                     f"{len([p for p in out.iterdir() if p.name.startswith('.gdn_export_')])} after the next convert",
                     "", ""))
        command("Session on a nonexistent path (info /nonexistent.nnef.tgz)", ["info", "/nonexistent.nnef.tgz"])
    finally:
        shutil.rmtree(work, ignore_errors=True)


def check_cost(large: Path) -> None:
    """The archive check's seconds against tract's load and plan of ``large`` (medians of 3, side by side)."""
    import statistics

    from gdn_export.run.archive import DIGESTS_FIELD
    from gdn_export.run.integrity import check_members
    from gdn_export.run.reading import read_metadata
    from gdn_export.run.runtime import load_tract_model

    metadata = read_metadata(large) or {}
    work = None
    if DIGESTS_FIELD not in metadata:  # written before digests: resealed in a folder beside it
        work = Path(tempfile.mkdtemp(prefix="check_cost_", dir=os.environ.get("CHECK_COST_DIR")))
        sealed = work / large.name
        reseal_streaming(large, sealed)
        large, metadata = sealed, read_metadata(sealed)
    try:
        checks, loads = [], []
        for _ in range(3):
            start = time.perf_counter()
            check_members(large, metadata)
            checks.append(time.perf_counter() - start)
            start = time.perf_counter()
            plan = load_tract_model(large, {"B": 1})  # its own check is remembered: tract's load alone
            loads.append(time.perf_counter() - start)
            del plan
        check, load = statistics.median(checks), statistics.median(loads)
        rows.append((f"archive check of {large.name} ({large.stat().st_size / 1e9:.2f} GB): members, headers, "
                     "SHA-256 of each", f"{check / load:.2f}x tract's load and plan ({load:.1f} s), medians of 3",
                     f"{check:.2f}", ""))
    finally:
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)


def reseal_streaming(source: Path, target: Path) -> None:
    """``source`` rewritten with its members' digests recorded in its gdn_export.json (member by member, by the MiB)."""
    import hashlib

    digests = {}
    with tarfile.open(source, "r|gz") as tar:
        for member in tar:
            if member.isfile() and member.name != "gdn_export.json":
                handle, digest = tar.extractfile(member), hashlib.sha256()
                while chunk := handle.read(1 << 22):
                    digest.update(chunk)
                digests[member.name] = {"size": member.size, "sha256": digest.hexdigest()}
    with tarfile.open(source, "r|gz") as tar, tarfile.open(target, "w:gz", compresslevel=0) as out:
        for member in tar:
            handle = tar.extractfile(member)
            if member.name == "gdn_export.json":
                meta = json.loads(handle.read())
                meta["digests"] = digests
                data = json.dumps(meta, indent=1).encode()
                member.size = len(data)
                handle = io.BytesIO(data)
            out.addfile(member, handle)


def print_rows() -> None:
    print(f"server bounds, {time.strftime('%Y-%m-%d')}, this machine ({os.cpu_count()} cores, shared)\n")
    print("| case | answer now | seconds | memory |\n|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |")


if __name__ == "__main__":
    main()
