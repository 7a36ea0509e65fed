"""The module layering of DESIGN.md, checked on the source: no import cycles (imports inside
functions count), data never imports workloads or the trainer, models never import data, and
nothing generic names a workload or tests a workload's config values."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from conftest import REPO

from hopperjax import workloads

PACKAGE = REPO / "hopperjax"


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _imports(path: Path) -> set[str]:
    """hopperjax modules ``path`` imports anywhere in its body, resolved to modules."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # "from hopperjax.data import text" imports the module hopperjax.data.text;
            # "from hopperjax.data import Datasets" imports the package hopperjax.data.
            names = [
                f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in MODULES else node.module
                for a in node.names
            ]
        else:
            continue
        for name in names:
            while name and name not in MODULES:
                name = name.rpartition(".")[0]
            if name.startswith("hopperjax.") and name != _module_name(path):
                found.add(name)
    return found


GRAPH = {name: _imports(path) for name, path in MODULES.items()}


def _cycle() -> list[str] | None:
    """One import cycle among hopperjax's modules, or None (the package root, which only
    re-exports the public API, is left out: Python runs it before any of its modules)."""
    graph = {m: {n for n in deps if n != "hopperjax"} for m, deps in GRAPH.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for module in sorted(graph):
        if module not in state and (found := visit(module)):
            return found
    return None


def test_no_import_cycles():
    assert _cycle() is None, " -> ".join(_cycle())


def _importers(prefix: str, forbidden: tuple[str, ...]) -> dict[str, set[str]]:
    return {
        module: bad
        for module, deps in GRAPH.items()
        if module.startswith(prefix) and (bad := {d for d in deps if d.startswith(forbidden)})
    }


def test_data_never_imports_workloads_or_the_trainer():
    assert _importers("hopperjax.data", ("hopperjax.workloads", "hopperjax.trainer")) == {}


def test_models_never_import_data_or_workloads():
    assert _importers("hopperjax.models", ("hopperjax.data", "hopperjax.workloads")) == {}


def test_lower_layers_never_import_the_trainer():
    for layer in ("hopperjax.memory", "hopperjax.observe", "hopperjax.parallel"):
        assert _importers(layer, ("hopperjax.trainer", "hopperjax.workloads.")) == {}, layer


# What naming a workload looks like: a workload's name or class, its models, its data sources,
# or a test of a config value that only one workload has.
GENERIC = [
    *(PACKAGE / d for d in ("trainer", "observe", "memory")),
    PACKAGE / "inspect.py",
    # The tools that run any workload (the DTA converter and the GPU check script, which run
    # named recipes, are a workload's own tools).
    *(p for p in (REPO / "tools").glob("*.py") if not p.name.startswith("convert_")),
]


def _workload_words() -> re.Pattern[str]:
    names = set(workloads.builtin_names())
    for name in workloads.builtin_names():
        cls = workloads.get(name)
        names |= {cls.__name__, cls.ModelConfig.__name__, cls.DataConfig.__name__}
    names |= {"GPT", "DTA", "gpt", "drug", "protein", "molecules", "seq_len", "vocab_size"}
    words = "|".join(sorted(map(re.escape, names)))
    return re.compile(rf"\b({words})\b|model\.kind|data\.source|data\.tokenizer")


def test_generic_modules_name_no_workload():
    pattern = _workload_words()
    hits = []
    for root in GENERIC:
        for path in [root] if root.is_file() else sorted(root.rglob("*.py")):
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if pattern.search(line):
                    hits.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert hits == [], "\n".join(hits)
