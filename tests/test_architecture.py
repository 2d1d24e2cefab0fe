"""The package's shape: no import cycles, own-package imports at module top, every module importable."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from tests.support.helpers import REPO

PKG = REPO / "pipeline"


def _modules() -> dict[str, Path]:
    out = {}
    for p in sorted(PKG.rglob("*.py")):
        name = ".".join(p.relative_to(REPO).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = p
    return out


def _import_graph() -> dict[str, set[str]]:
    """module -> own modules it imports (anywhere in the file); `from pkg import sub` counts as pkg.sub."""
    mods = _modules()

    def known(target: str) -> str:
        while target and target not in mods:
            target = target.rpartition(".")[0]
        return target

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, path in mods.items():
        for n in ast.walk(ast.parse(path.read_text())):
            if isinstance(n, ast.ImportFrom) and n.level == 0 and (n.module or "").startswith("pipeline"):
                for a in n.names:
                    graph[m].add(known(f"{n.module}.{a.name}"))
            elif isinstance(n, ast.Import):
                graph[m].update(known(a.name) for a in n.names if a.name.startswith("pipeline"))
        graph[m].discard(m)
        graph[m].discard("")
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    assert _cycles(_import_graph()) == []


def test_cycle_detector_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_own_imports_are_at_module_top():
    """Function-level imports of pipeline modules hide cycles; the only ones allowed say why (`# lazy:`)."""
    hidden = []
    for m, path in _modules().items():
        src = path.read_text().splitlines()
        tree = ast.parse("\n".join(src))
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for n in ast.walk(fn):
                own = (isinstance(n, ast.ImportFrom) and (n.module or "").startswith("pipeline")) or (
                    isinstance(n, ast.Import) and any(a.name.startswith("pipeline") for a in n.names)
                )
                if own and "# lazy:" not in src[n.lineno - 1]:
                    hidden.append(f"{m}:{n.lineno}")
    assert hidden == []


def test_every_module_imports_in_a_fresh_interpreter():
    code = "import importlib, sys\nfor m in sys.argv[1:]:\n    importlib.import_module(m)\n"
    r = subprocess.run(
        [sys.executable, "-c", code, *[m for m in _modules() if not m.endswith("__main__")]],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert r.returncode == 0, r.stderr[-3000:]


def test_layers_point_one_way():
    """Lower layers never import upper ones: artifacts/serving < registry/fleet < stages < release/jobs < cli."""
    rank = {
        "pipeline.errors": 0,
        "pipeline.interrupt": 0,
        "pipeline.config": 0,
        "pipeline.findings": 0,
        "pipeline.artifacts": 0,
        "pipeline.serving": 0,
        "pipeline.registry": 2,
        "pipeline.fleet": 2,
        "pipeline.train": 3,
        "pipeline.validate": 3,
        "pipeline.canary": 4,
        "pipeline.merge": 4,
        "pipeline.release": 5,
        "pipeline.jobs": 6,
        "pipeline.dev": 7,
        "pipeline.cli": 8,
    }

    def layer(m: str) -> int | None:
        hits = [k for k in rank if m == k or m.startswith(k + ".")]
        return rank[max(hits, key=len)] if hits else None

    upward = [
        f"{a} -> {b}"
        for a, targets in _import_graph().items()
        for b in targets
        if layer(a) is not None and layer(b) is not None and layer(b) > layer(a)
    ]
    assert upward == []
