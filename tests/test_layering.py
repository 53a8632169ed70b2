"""Dependencies point one way (docs/ARCHITECTURE.md): every module's imports, followed transitively, name nothing
above its layer.

Fast and static: each module of gdn_export is parsed once, its imports (at module level and inside functions, the
lazy ones included; ``if TYPE_CHECKING:`` blocks excepted: they run nothing) resolved to modules, and the closure
followed through gdn_export's modules and their parent packages. The root ``gdn_export/__init__.py`` is the facade
above every layer (it names everything, lazily) and is not followed; third-party packages are kept by top-level
name (torch, torch_to_nnef, transformers, ...)."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

import gdn_export

PACKAGE = Path(gdn_export.__file__).parent
ROOT = "gdn_export"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES: dict[str, Path] = {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST):
    """Every Import/ImportFrom of the tree, skipping ``if TYPE_CHECKING:`` bodies."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


@functools.cache
def direct_imports(module: str) -> frozenset[str]:
    """The modules ``module`` imports: gdn_export modules by full name, third-party ones by top-level name."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in _import_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
        for name in names:
            if name == ROOT or name.startswith(ROOT + "."):
                while name not in MODULES:  # an attribute of a module: the module
                    name = name.rpartition(".")[0]
                found.add(name)
            else:
                found.add(name.split(".")[0])
    # importing a.b.c runs a/__init__ and a/b/__init__ first (the root facade excepted)
    for name in list(found):
        parts = name.split(".")
        found.update(".".join(parts[:i]) for i in range(2, len(parts)) if ".".join(parts[:i]) in MODULES)
    found.discard(ROOT)
    found.discard(module)
    return frozenset(found)


@functools.cache
def closure(module: str) -> frozenset[str]:
    """Everything importing ``module`` imports, transitively."""
    seen: set[str] = set()
    stack = [module, *(".".join(module.split(".")[:i]) for i in range(2, len(module.split("."))))]
    while stack:
        name = stack.pop()
        for dep in direct_imports(name) if name in MODULES else ():
            if dep not in seen:
                seen.add(dep)
                stack.append(dep)
    seen.discard(module)
    return frozenset(seen)


def _under(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


G = ROOT + "."
CONVERT_SIDE = ("torch", "torch_to_nnef", "transformers", "nnef_tools", "onnx", "safetensors")
# (modules, what their closure must not contain, why)
# the one NNEF writer (the ops' lowerings and the weight formats' graph passes write with it), and the rest of the NNEF
# back-end: what the weights, below the back-ends, may not import
NNEF_WRITER = G + "backends.nnef.builder"
NNEF_PACKAGE = tuple(m for m in MODULES if m.startswith(G + "backends.nnef.") and m != NNEF_WRITER)
UPPER = ("ops", "backends.nnef", "backends.onnx", "pipeline", "checkpoints", "megatron", "hf", "models", "layers",
         "weights", "run", "cli")
RULES = [
    ([G + "errors", G + "parity", G + "targets", G + "tract_quirks"],
     [G + m for m in UPPER + ("backends.compat",)] + list(CONVERT_SIDE),
     "the bottom: errors, the parity rule, the tables of back-ends, runtimes and float types and the records of tract's "
     "quirks depend on nothing"),
    ([G + "backends.compat"], [G + m for m in UPPER],
     "compat patches third-party internals for any layer: it imports nothing of gdn_export but errors"),
    ([G + "run"], [G + m for m in ("ops", "backends", "pipeline", "checkpoints", "megatron", "hf", "models", "layers",
                                   "weights", "cli")]
     + list(CONVERT_SIDE), "the run side executes archives: tract and numpy, never torch or the converter"),
    ([G + "ops"], [G + m for m in ("pipeline", "checkpoints", "megatron", "hf", "models", "layers", "cli",
                                   "run.serving", "run.generation", "run.http")],
     "an op is below the models that use it and the pipelines that export it"),
    ([G + "backends"], [G + m for m in ("ops", "pipeline", "checkpoints", "megatron", "hf", "models", "layers", "cli",
                                        "run.serving", "run.generation", "run.http")],
     "a back-end names no op: ops register into it"),
    ([NNEF_WRITER], [G + m for m in ("weights", "ops", "backends.onnx", "run")] + list(NNEF_PACKAGE),
     "the NNEF writer is a leaf: the weight formats' graph passes write with it too"),
    ([G + "models", G + "layers"], [G + m for m in ("pipeline", "checkpoints", "megatron", "hf", "backends", "cli")]
     + ["transformers"],
     "models are plain torch over the ops; they know no checkpoint format and no back-end"),
    ([G + "weights"], [G + m for m in ("ops", "backends.onnx", "pipeline", "checkpoints", "megatron", "hf", "models",
                                       "layers", "cli")] + list(NNEF_PACKAGE),
     "weight formats are leaves (compat may wrap third-party writers for them; their NNEF graph passes write with "
     "the NNEF writer, backends/nnef/builder.py)"),
    ([G + "hf"], [G + m for m in ("pipeline", "cli", "backends.nnef", "backends.onnx", "checkpoints", "megatron")],
     "Hugging Face reading and the families are below every other checkpoint source and the pipelines"),
    ([G + "megatron"], [G + m for m in ("pipeline", "cli", "backends.nnef", "backends.onnx", "checkpoints")],
     "a checkpoint source (it may build on hf) is below the registry of sources and the pipelines"),
    ([G + "checkpoints"], [G + m for m in ("pipeline", "cli", "backends.nnef", "backends.onnx")],
     "the registry of checkpoint sources is below the pipelines that open checkpoints through it"),
    ([G + "pipeline"], [G + "cli"], "the CLI is the top"),
]
# what every op shares: the Decision record, the export's plan (which validates every op's options from their light
# tables), the torch registration helper. An op reaching another op only through these is not naming it.
SHARED = (G + "ops.protocol", G + "ops.options", G + "ops.registration")


def _op_rules() -> list:
    """An op's own modules name no back-end (nor torch-to-nnef); its nnef lowering names only the NNEF back-end,
    its onnx lowering only the ONNX one; no op names another op."""
    rules = []
    ops = sorted(m.split(".")[2] for m in MODULES if m.count(".") == 2 and m.startswith(G + "ops.")
                 and (MODULES[m].name == "__init__.py"))
    for op in ops:
        base = f"{G}ops.{op}"
        others = [f"{G}ops.{other}" for other in ops if other != op]
        for module in (m for m in MODULES if _under(m, [base])):
            leaf = module[len(base) + 1:].split(".")[0] if module != base else ""
            if leaf == "nnef":
                forbidden = [G + "backends.onnx", *others]
            elif leaf == "onnx":
                forbidden = [G + "backends.nnef", "torch_to_nnef", "nnef_tools", *others]
            else:
                forbidden = [G + "backends", "torch_to_nnef", "nnef_tools", *others]
            rules.append(([module], forbidden, f"ops/{op}: a lowering names only its back-end; an op no other op",
                          "exact"))
    # the shared modules themselves: no back-end
    rules.append((list(SHARED), [G + "backends", "torch_to_nnef", "nnef_tools"], "ops' shared modules name no back-end",
                  "exact"))
    return rules


# direct imports (module, what it imports) still to be removed by the refactor of issue 22: left out of the graph
# the rules check; the test fails when one is gone and not struck from here, so the list only shrinks
KNOWN: set[tuple[str, str]] = {
    ("gdn_export.run.onnx_session", "onnx"),  # the run side's (another helper's): reads metadata with onnx
}


def _rules():
    for rule in RULES:
        modules, forbidden, why = rule
        yield (lambda m, modules=modules: _under(m, modules)), forbidden, why, ()
    for rule in _op_rules():
        modules, forbidden, why, _ = rule
        yield (lambda m, modules=modules: m in modules), forbidden, why, SHARED


def violations() -> list[str]:
    """``module -> a -> b -> forbidden`` for every module that reaches a module its rule forbids."""
    found = []
    for applies, forbidden, why, opaque in _rules():
        for module in sorted(m for m in MODULES if applies(m)):
            # breadth first over the import graph minus KNOWN, keeping one path to each module reached
            parent: dict[str, str | None] = {module: None}
            queue = [module, *(".".join(module.split(".")[:i]) for i in range(2, len(module.split("."))))]
            for name in queue[1:]:
                parent[name] = module
            while queue:
                name = queue.pop(0)
                for dep in sorted(direct_imports(name)) if name in MODULES else ():
                    if (name, dep) in KNOWN or dep in parent or (dep in opaque and dep != module):
                        continue
                    parent[dep] = name
                    if _under(dep, forbidden):
                        chain, step = [dep], name
                        while step is not None:
                            chain.append(step)
                            step = parent[step]
                        found.append(" -> ".join(reversed(chain)) + f"  ({why})")
                    else:
                        queue.append(dep)
    return found


def test_no_module_imports_above_its_layer():
    found = violations()
    assert not found, "upward imports:\n" + "\n".join(f"  {line}" for line in found)


def test_every_known_exception_still_exists():
    gone = sorted(f"{m} -> {d}" for m, d in KNOWN if m not in MODULES or d not in direct_imports(m))
    assert not gone, "no longer imported, strike from KNOWN: " + ", ".join(gone)


def test_the_checker_sees_transitive_and_lazy_imports(tmp_path, monkeypatch):
    """A module that imports torch through two hops, one of them inside a function, is caught."""
    fake = {f"{ROOT}.run.a": "from gdn_export.run import b\n", f"{ROOT}.run.b": "def f():\n    import gdn_export.c\n",
            f"{ROOT}.c": "import torch\n", f"{ROOT}.run": "", f"{ROOT}.d": "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    import torch\n"}
    paths = {}
    for name, text in fake.items():
        path = tmp_path / (name.replace(".", "_") + ("/__init__.py" if name == f"{ROOT}.run" else ".py"))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        paths[name] = path
    monkeypatch.setattr(__import__(__name__), "MODULES", paths)
    direct_imports.cache_clear()
    closure.cache_clear()
    try:
        assert "torch" in closure(f"{ROOT}.run.a")
        assert f"{ROOT}.c" in closure(f"{ROOT}.run.a")
        assert "torch" not in closure(f"{ROOT}.d")
    finally:
        direct_imports.cache_clear()
        closure.cache_clear()


@pytest.mark.parametrize("module", [G + "run.session", G + "run.serving", G + "run.generation", G + "run.http"])
def test_the_run_side_reaches_no_torch(module):
    assert not {d for d in closure(module) if _under(d, CONVERT_SIDE)}


def _code_strings(tree: ast.AST) -> list[str]:
    """The string constants of a module's code, docstrings left out (prose may name an op; code may not)."""
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docstrings.add(id(first.value))
    return [n.value for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings]


def test_a_back_end_names_no_op_by_string_either():
    """Imports are not the only way to name an op: no string of a back-end's code is an op's ``t2n_extra`` name, its
    handler name or its ONNX placeholder type (the ONNX symbolics once listed the ops so; they now register)."""
    import re

    ops_source = "".join(p.read_text() for p in (PACKAGE / "ops").rglob("*.py"))
    names = set(re.findall(r"t2n_extra::(\w+)", ops_source)) | set(re.findall(r'custom_op\("(\w+)"\)', ops_source))
    placeholders = set(re.findall(r'placeholder\("(\w+)"', ops_source))
    assert names and placeholders, "the ops' registrations are not where this test looks"
    found = []
    for path in sorted((PACKAGE / "backends").rglob("*.py")):
        for text in _code_strings(ast.parse(path.read_text())):
            if text in names | placeholders or any(f"t2n_extra::{name}" in text for name in names) or \
                    any(f"::{p}" in text for p in placeholders):
                found.append(f"{path.relative_to(PACKAGE)}: {text!r}")
    assert not found, "a back-end names an op: " + ", ".join(found)


def _unit(module: str) -> str:
    """What a cycle is counted between: a top-level package of gdn_export, or one level deeper in the packages made
    of units (an op, a back-end, a weight format, a part of the run side)."""
    parts = module.split(".")
    return ".".join(parts[:3 if len(parts) > 2 and parts[1] in ("backends", "ops", "run", "weights") else 2])


# import cycles between units still to be broken (the list only shrinks, as KNOWN): the shared NNEF plan names the
# gated delta rule's option rules and its handlers read the plan; the archive reader and its integrity checks
KNOWN_CYCLES = {frozenset({G + "ops.options", G + "ops.gated_delta_rule"}),
                frozenset({G + "run.archive", G + "run.integrity"})}


def test_no_import_cycle_between_packages():
    """No two units import each other, directly or through others (lazy imports included): Tarjan's strongly
    connected components of the graph of units."""
    edges: dict[str, set[str]] = {}
    for module in MODULES:
        for dep in direct_imports(module):
            if dep in MODULES and _unit(dep) != _unit(module):
                edges.setdefault(_unit(module), set()).add(_unit(dep))
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(unit: str) -> None:
        index[unit] = low[unit] = len(index)
        stack.append(unit)
        for dep in sorted(edges.get(unit, ())):
            if dep not in index:
                visit(dep)
                low[unit] = min(low[unit], low[dep])
            elif dep in stack:
                low[unit] = min(low[unit], index[dep])
        if low[unit] == index[unit]:
            component = set()
            while True:
                member = stack.pop()
                component.add(member)
                if member == unit:
                    break
            if len(component) > 1:
                cycles.append(frozenset(component))

    for unit in sorted(edges):
        if unit not in index:
            visit(unit)
    assert set(cycles) <= KNOWN_CYCLES, "import cycles: " + "; ".join(" <-> ".join(sorted(c)) for c in cycles
                                                                      if c not in KNOWN_CYCLES)
    gone = KNOWN_CYCLES - set(cycles)
    assert not gone, "no longer a cycle, strike from KNOWN_CYCLES: " + "; ".join(" <-> ".join(sorted(c)) for c in gone)


def test_every_package_has_a_rule():
    """Every top-level package and module of gdn_export (and every back-end) is one a rule names: a new one gets its
    place in the layers before it can import anything (the CLI and the facade are the top: nothing is above them)."""
    named = {m for rule in RULES for m in rule[0]}
    top = {".".join(m.split(".")[:2]) for m in MODULES if m != ROOT} | {
        ".".join(m.split(".")[:3]) for m in MODULES if m.startswith(G + "backends.") and m.count(".") >= 2}
    unruled = sorted(m for m in top - {G + "cli"} if not _under(m, named))
    assert not unruled, "no layering rule names: " + ", ".join(unruled)
