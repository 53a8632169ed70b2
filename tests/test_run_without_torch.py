"""The run side on the base install: ``gdn-export --help``, ``info``, ``generate`` and ``serve`` (over real HTTP, with
the ``openai`` client) in processes where torch, torch-to-nnef, transformers and onnx cannot be imported, and
``convert`` there saying in one line what to install.

A fresh virtual environment per run would take minutes, so each command runs in a subprocess whose first meta-path
finder refuses those packages (as a missing package does: ``ModuleNotFoundError``) and appends every attempt to a
file: the test asserts the run side never even tried. The tokens are compared with ``gdn_export.generate`` run in
this process, where torch is importable. (The real thing, ``pip install '.[serve]'`` in a new venv, is in
docs/GENERATING.md.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import FIXTURES, serve_process

import gdn_export

BLOCKED = ("torch", "torch_to_nnef", "transformers", "onnx")
NAME = "qwen3_5"
PROMPT_IDS = [3, 17, 42, 5, 99]

# the subprocess's first lines: a finder that refuses BLOCKED and writes down every attempt, then the CLI
PRELUDE = """
import sys
BLOCKED, RECORD = {blocked!r}, {record!r}

class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            with open(RECORD, "a") as f:
                f.write(name + "\\n")
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None

sys.meta_path.insert(0, Refuse())
from gdn_export.cli import main
sys.exit(main(sys.argv[1:]))
"""


def without_torch(tmp_path: Path, *args: str) -> tuple[list[str], Path]:
    """The command line of ``gdn-export ARGS`` run where BLOCKED cannot be imported, and the file that lists the
    imports it attempted."""
    record = tmp_path / f"attempts-{len(list(tmp_path.glob('attempts-*')))}.txt"
    code = PRELUDE.format(blocked=BLOCKED, record=str(record))
    return [sys.executable, "-c", code, *args], record


def environment() -> dict:
    root = str(Path(gdn_export.__file__).resolve().parents[1])  # this tree's gdn_export, not an installed one
    return dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]),
                PYTHONUNBUFFERED="1")


def attempts(record: Path) -> list[str]:
    return record.read_text().split() if record.exists() else []


def run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    command, record = without_torch(tmp_path, *args)
    done = subprocess.run(command, capture_output=True, text=True, env=environment(), timeout=300)
    assert attempts(record) == [], f"gdn-export {args[0]} tried to import {attempts(record)}: {done.stderr}"
    return done


def test_help_imports_no_torch(tmp_path):
    done = run(tmp_path, "--help")
    assert done.returncode == 0 and "convert" in done.stdout and "serve" in done.stdout


def test_convert_says_what_to_install(tmp_path):
    """Without the [convert] extra, convert fails like the CLI's other errors: exit 1, one line naming the package
    and the pip command; nothing is written."""
    command, record = without_torch(tmp_path, "convert", str(FIXTURES / NAME), "-o", str(tmp_path / "m.nnef.tgz"))
    done = subprocess.run(command, capture_output=True, text=True, env=environment(), timeout=300)
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip().splitlines() == [
        "gdn-export: error: gdn-export convert needs torch, which is not installed: pip install 'gdn_export[convert]'"]
    assert attempts(record) and not (tmp_path / "m.nnef.tgz").exists()


def test_python_api_without_torch(tmp_path):
    """``import gdn_export`` and its run-side names import no torch; an export-side name raises MissingExtraError
    (a ModuleNotFoundError) naming the extra."""
    record = tmp_path / "attempts.txt"
    code = PRELUDE.split("from gdn_export.cli")[0].format(blocked=BLOCKED, record=str(record)) + """
import gdn_export
names = [gdn_export.Session, gdn_export.Engine, gdn_export.generate, gdn_export.SamplingParams, gdn_export.run_tract]
open(RECORD + ".run", "w").write("ok")
try:
    gdn_export.convert
except gdn_export.MissingExtraError as err:
    assert isinstance(err, ModuleNotFoundError) and err.name == "torch", err
    print(err)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environment(), timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "gdn_export.convert needs torch, which is not installed: pip install " \
                                  "'gdn_export[convert]'"
    assert (tmp_path / "attempts.txt.run").exists() and attempts(record) == ["torch"]  # only convert tried


def expected(converted) -> tuple[list[int], str]:
    """Greedy token ids and text from ``gdn_export.generate`` in this process (torch importable here)."""
    from gdn_export.run.generation import generate
    from gdn_export.run.generation.executor import InlineExecutor
    from gdn_export.run.session import Session

    executor = InlineExecutor(Session(converted(NAME)))
    tokens = list(generate(executor, PROMPT_IDS, 8, temperature=0.0, stop_token_ids=[]))
    return [t.token_id for t in tokens], "".join(t.text for t in tokens)


@pytest.mark.slow
def test_info_generate_serve_without_torch(converted, tmp_path):
    archive = str(converted(NAME))
    want, want_text = expected(converted)

    info = run(tmp_path, "info", archive)
    assert info.returncode == 0 and "input_ids" in info.stdout and "family: Qwen3.5" in info.stdout, info.stderr

    generated = run(tmp_path, "generate", archive, "--prompt-ids", ",".join(map(str, PROMPT_IDS)),
                    "--max-new-tokens", "8", "--temperature", "0", "--ignore-eos")
    assert generated.returncode == 0, generated.stderr
    text = run(tmp_path, "generate", archive, "--prompt", "Hello", "--max-new-tokens", "4", "--temperature", "0")
    assert text.returncode == 0 and text.stdout.strip(), text.stderr

    import openai

    command, record = without_torch(tmp_path)
    log = tmp_path / "serve.txt"
    process, base = serve_process([archive, "--host", "127.0.0.1", "--served-model-name", NAME], log, command=command,
                                  PYTHONPATH=environment()["PYTHONPATH"])
    try:
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)
        completion = client.completions.create(model=NAME, prompt=PROMPT_IDS, max_tokens=8, temperature=0,
                                               extra_body={"ignore_eos": True})
        served = completion.choices[0].model_extra["token_ids"]
    finally:
        process.terminate()
        process.wait(60)
    assert attempts(record) == [], f"gdn-export serve tried to import {attempts(record)}: {log.read_text()}"
    assert process.returncode == 0, log.read_text()
    assert generated.stdout == want_text + "\n"  # the archive carries a tokenizer: text out
    assert served == want
