"""The test suite's own rules: test modules share code through helper modules (tests/helpers.py, tests/oracle.py),
never by importing each other or conftest, and the fixture checkpoints are found in one place (helpers.FIXTURES)."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_test_modules_import_no_test_module_nor_conftest():
    offenders = {path.name: sorted(m for m in imported_modules(path) if m.startswith("test_") or m == "conftest")
                 for path in sorted(TESTS.glob("*.py"))}
    assert {name: found for name, found in offenders.items() if found} == {}, (
        "move what they share into tests/helpers.py (or tests/oracle.py) and import it from there")


def test_fixtures_folder_named_once():
    naming = [path.name for path in sorted(TESTS.glob("*.py"))
              if path.name not in ("helpers.py", Path(__file__).name) and '/ "fixtures"' in path.read_text()]
    assert naming == [], "use helpers.FIXTURES (and helpers.CHECKPOINTS for the list of fixture checkpoints)"
