"""The package's shape: no import cycles, own-package imports at module top, every module importable."""

from __future__ import annotations

import ast
import re
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
        "pipeline.children": 0,
        "pipeline.config": 0,
        "pipeline.config_errors": 0,
        "pipeline.findings": 0,
        "pipeline.figures": 0,
        "pipeline.redact": 0,
        "pipeline.artifacts": 0,
        "pipeline.serving": 0,
        "pipeline.registry": 2,
        "pipeline.fleet": 2,
        "pipeline.train": 3,
        "pipeline.validate": 3,
        "pipeline.canary": 4,
        "pipeline.merge": 4,
        "pipeline.draft": 4,
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


# -- validation rules read a declared interface (issue 26.1) -----------------------------------------------------
RULE_MODULES = (
    "weights",
    "config_checks",
    "fleet_checks",
    "keys",
    "values",
    "served",
    "template_checks",
    "behaviour",
    "acceptance",
    "train_checks",
)
PROTOCOLS = {"Facts", "AdapterFacts", "TrainFacts"}


def _rule_module_violations(src: str) -> list[str]:
    """Reads of a context's private attributes, `getattr`-style probing and `__dict__` caches in `src`."""
    out = []
    for n in ast.walk(ast.parse(src)):
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "ctx":
            if n.attr.startswith("_"):
                out.append(f"{n.lineno}: ctx.{n.attr}")
        if (
            isinstance(n, ast.Call)
            and isinstance(n.func, ast.Name)
            and n.func.id in ("getattr", "hasattr", "setattr")
        ):
            if n.args and isinstance(n.args[0], ast.Name) and n.args[0].id == "ctx":
                out.append(f"{n.lineno}: {n.func.id}(ctx, ...)")
        if isinstance(n, (ast.Assign, ast.AugAssign)):
            for t in n.targets if isinstance(n, ast.Assign) else [n.target]:
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "ctx":
                    out.append(f"{n.lineno}: assigns ctx.{t.attr}")
    return out


def test_no_rule_module_reads_a_private_attribute_of_a_context():
    found = {
        m: v
        for m in RULE_MODULES
        if (v := _rule_module_violations((PKG / "validate" / f"{m}.py").read_text()))
    }
    assert found == {}


def test_the_rule_checker_finds_privates():
    src = "def r(ctx):\n    a = ctx._config\n    b = getattr(ctx, 'x', 1)\n    ctx.flag = True\n    ctx.__dict__['k'] = 1\n"
    assert len(_rule_module_violations(src)) == 4


def test_every_rule_names_the_facts_it_reads():
    """`def rule(ctx: Facts)`: both scopes read `Facts`; adapter-only rules may read `AdapterFacts`, training-config
    rules `TrainFacts`."""
    from pipeline.validate import RULES

    wrong = []
    for spec in RULES.values():
        first = next(iter(spec.fn.__annotations__.items()), (None, None))
        ann = first[1] if first[0] != "return" else None
        allowed = {"Facts"} | ({"AdapterFacts"} if spec.scopes == ("adapter",) else set())
        allowed |= {"TrainFacts"} if spec.scopes == ("train",) else set()
        if ann not in allowed:
            wrong.append(f"{spec.id}: {ann!r} (scopes {spec.scopes})")
    assert wrong == []


def test_no_getter_writes_into_the_report():
    """Properties of the contexts only establish facts; rules record stats (`ctx.stats`)."""
    bad = []
    for f in (
        "context.py",
        "weights_facts.py",
        "base_facts.py",
        "tokenizer_facts.py",
        "template.py",
        "facts.py",
        "train_checks.py",
    ):
        tree = ast.parse((PKG / "validate" / f).read_text())
        for fn in ast.walk(tree):
            if not isinstance(fn, ast.FunctionDef):
                continue
            decorators = {getattr(d, "id", getattr(d, "attr", "")) for d in fn.decorator_list}
            if not decorators & {"property", "cached_property"}:
                continue
            for n in ast.walk(fn):
                target = n.value if isinstance(n, ast.Subscript) else n
                if isinstance(n, (ast.Subscript, ast.Attribute)) and isinstance(n.ctx, ast.Store):
                    text = ast.unparse(target)
                    if "report" in text or "stats" in text:
                        bad.append(f"{f}:{n.lineno} {fn.name}")
                if (
                    isinstance(n, ast.Call)
                    and isinstance(n.func, ast.Attribute)
                    and n.func.attr in ("update", "add")
                ):
                    if "report" in ast.unparse(n.func.value) or "stats" in ast.unparse(n.func.value):
                        bad.append(f"{f}:{n.lineno} {fn.name}")
    assert bad == []


# -- one vLLM version table (issue 26.4, 25.1) ---------------------------------------------------------------------
def test_one_vllm_version_table():
    """Version ranges and the release parser live in `pipeline/serving/versions.py` only."""
    elsewhere = []
    for m, path in _modules().items():
        if m == "pipeline.serving.versions":
            continue
        tree = ast.parse(path.read_text())
        for n in ast.walk(tree):
            if isinstance(n, ast.FunctionDef) and n.name == "release":
                elsewhere.append(f"{m}: def release")
            if (
                isinstance(n, ast.AnnAssign)
                and isinstance(n.target, ast.Name)
                and n.target.id in ("low", "high")
            ):
                elsewhere.append(f"{m}:{n.lineno}: a version range field")
            if isinstance(n, (ast.Assign, ast.AnnAssign)):
                targets = n.targets if isinstance(n, ast.Assign) else [n.target]
                names = {t.id for t in targets if isinstance(t, ast.Name)}
                if names & {"RANGES", "SWAP_FACTS"}:
                    elsewhere.append(f"{m}:{n.lineno}: {names}")
    assert elsewhere == []


def test_every_field_of_the_version_table_has_a_reader():
    """A fact in the table that no pipeline module reads is a rule declared but not applied (issue 25.1)."""
    import dataclasses

    from pipeline.serving.versions import VllmRange

    meta = {"name", "low", "high", "source"}
    reads: set[str] = set()
    for m, path in _modules().items():
        if m == "pipeline.serving.versions":
            continue
        for n in ast.walk(ast.parse(path.read_text())):
            if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Load):
                reads.add(n.attr)
    unread = sorted(
        f.name for f in dataclasses.fields(VllmRange) if f.name not in meta and f.name not in reads
    )
    assert unread == []


def test_fleet_rules_are_built_by_name_from_the_config():
    """One fleet profile: every FleetRules field names its pipeline.yaml section and field (nothing by position)."""
    import dataclasses

    from pipeline.config import ProjectConfig
    from pipeline.validate.report import PROFILE_SOURCES, FleetRules

    assert set(PROFILE_SOURCES) == {f.name for f in dataclasses.fields(FleetRules)}
    cfg = ProjectConfig()
    for field_name, (section, name) in PROFILE_SOURCES.items():
        assert name in type(getattr(cfg, section)).model_fields, (field_name, section, name)


def test_read_manifest_returns_a_model():
    """Issue 26: `manifest.json` is a type end to end; readers get `AdapterManifest` / `MergedManifest`."""
    import typing

    from pydantic import BaseModel

    from pipeline.artifacts import manifest

    for fn in (manifest.read_manifest, manifest.read_adapter_manifest, manifest.parse_manifest):
        ret = typing.get_type_hints(fn)["return"]
        kinds = typing.get_args(ret) or (ret,)
        assert kinds and all(isinstance(k, type) and issubclass(k, BaseModel) for k in kinds), fn


def _manifest_key_reads(tree: ast.AST) -> list[int]:
    """Lines that read a manifest by string key: `manifest["files"]`, `man.get("published")`."""

    def is_manifest(n: ast.AST) -> bool:
        name = n.id if isinstance(n, ast.Name) else n.attr if isinstance(n, ast.Attribute) else ""
        return "manifest" in name.lower() or name in ("man", "amani")

    out = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Subscript) and is_manifest(n.value):
            if isinstance(n.slice, ast.Constant) and isinstance(n.slice.value, str):
                out.append(n.lineno)
        elif (
            isinstance(n, ast.Call)
            and isinstance(n.func, ast.Attribute)
            and n.func.attr in ("get", "setdefault")
        ):
            if is_manifest(n.func.value):
                out.append(n.lineno)
    return out


def test_no_module_reads_a_manifest_by_string_key():
    bad = [f"{m}:{ln}" for m, p in _modules().items() for ln in _manifest_key_reads(ast.parse(p.read_text()))]
    assert bad == []


def test_the_manifest_key_detector_finds_key_reads():
    src = (
        'a = manifest["files"]\nb = res.manifest.get("x")\nc = man.setdefault("n", {})\nd = manifest.files\n'
    )
    assert _manifest_key_reads(ast.parse(src)) == [1, 2, 3]


def _doc_module_lists(doc: str) -> dict[str, str]:
    """docs/architecture.md "Modules": package -> the text of its bullet."""
    return {
        m.group(1): m.group(2)
        for m in re.finditer(r"^- `pipeline/(\w+)/`:(.*?)(?=^- `|^\S|\Z)", doc, re.S | re.M)
    }


def test_architecture_doc_names_every_module_and_nothing_gone():
    """Issue 26: docs/architecture.md named neither children.py nor registry/read.py. Every module is
    named with its job (a package's in its bullet, a top-level one in the lower-layer table), and
    every `pipeline/...` path the page names exists."""
    doc = (REPO / "docs" / "architecture.md").read_text()
    lists = _doc_module_lists(doc)
    missing = []
    for path in _modules().values():
        rel = path.relative_to(PKG)
        if path.name in ("__init__.py", "__main__.py"):
            continue
        if len(rel.parts) == 1:
            named = f"`pipeline/{path.name}`" in doc
        else:
            named = f"`{path.stem}`" in lists.get(rel.parts[0], "")
        if not named:
            missing.append(str(rel))
    gone = sorted({p for p in re.findall(r"`(pipeline/[\w/]+?(?:\.py|/))`", doc) if not (REPO / p).exists()})
    assert (missing, gone) == ([], [])


def test_no_module_is_much_over_600_lines():
    """Issue 41 item 9: pipeline/validate/context.py had grown to 707 lines against the ~600 the rest keeps
    (split by the facts it establishes). 650 leaves a fix room to land before its module is split."""
    long = {
        str(p.relative_to(REPO)): n
        for p in _modules().values()
        if (n := len(p.read_text().splitlines())) > 650
    }
    assert long == {}


def test_the_adapters_dir_says_what_lands_there_and_git_ignores_what_does():
    """Issue 41 item 9: the design's top-level `adapters/` did not exist in a fresh clone. Its README is
    tracked; the runs and the volume the pipeline writes there are not."""
    import subprocess

    readme = REPO / "adapters" / "README.md"
    assert "adapters/runs/" in readme.read_text() and "adapters/volume/" in readme.read_text()

    def ignored(path: str) -> bool:
        r = subprocess.run(["git", "check-ignore", "-q", "--no-index", path], cwd=REPO)
        return r.returncode == 0

    assert not ignored("adapters/README.md")
    assert ignored("adapters/runs/tiny-cpu-20261130T101500123456Z/adapter/manifest.json")
    assert ignored("adapters/volume/agent-tools-v1/adapter_model.safetensors")
    assert ignored("adapters/volume/fleet-state.json")
