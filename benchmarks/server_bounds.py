"""Each case of issue 25 ("a server you can put in front of users") run against the real commands, with what it gets
now: the answer (HTTP status and code, or exit status and first line), seconds, and extra memory (peak RSS over the
resting RSS, from /proc for the server, from getrusage for a command).

    python benchmarks/server_bounds.py ARCHIVE.nnef.tgz CHECKPOINT_DIR

ARCHIVE: an archive converted without --serving from CHECKPOINT_DIR (fixtures/qwen3_5: context 256 tokens).
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
from helpers import raw, rewritten  # noqa: E402  (the server tests' HTTP client and archive rewriter)

request = partial(raw, timeout=600)  # a tokenization of megabytes outlasts the tests' 60 s


def kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def command(case: str, args: list[str], env: dict | None = None) -> None:
    """Run ``gdn-export ARGS`` under a parent that reports its peak RSS; one row."""
    measure = ("import resource, subprocess, sys; done = subprocess.run(sys.argv[1:]); "
               "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); "
               "sys.exit(done.returncode)")
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", measure, *CLI, *args], capture_output=True, text=True,
                          env=dict(os.environ, **(env or {})), timeout=600)
    seconds = time.perf_counter() - start
    *lines, peak = done.stderr.strip().splitlines()
    lines = [line for line in lines if not line.startswith("[")]  # progress lines
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
    archive, checkpoint = Path(sys.argv[1]), Path(sys.argv[2])
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
    print(f"issue 25's cases, {time.strftime('%Y-%m-%d')}, this machine ({os.cpu_count()} cores, shared)\n")
    print("| case | answer now | seconds | memory |\n|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |")


if __name__ == "__main__":
    main()
