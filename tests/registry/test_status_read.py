"""`pipeline status` reads the registry without mlflow, never creates a store, and shows gates (issue 17).

Real sqlite MLflow store written by the MLflow client; the fast reader must return what the
client returns.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

from typer.testing import CliRunner

from pipeline import registry
from pipeline.registry.read import read_mlflow, read_sqlite
from tests.support import registry_support
from tests.support.registry_support import register

registry_project = registry_support.registry_project
two_adapters = registry_support.two_adapters


def _name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


def _pipeline(*args, cwd, env=None):
    e = {k: v for k, v in os.environ.items() if k not in ("PIPELINE_CONFIG", "MLFLOW_TRACKING_URI")}
    return subprocess.run(
        [sys.executable, "-m", "pipeline", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**e, **(env or {})},
    )


def test_direct_read_equals_the_mlflow_client(registry_project, two_adapters, tiny_base):
    cfg = registry_project
    name = _name("read")
    register(cfg, two_adapters[0], tiny_base, name)
    register(cfg, two_adapters[1], tiny_base, name)
    registry.record_gate(cfg, name, 2, "gated", "eval_loss 9.0 is worse than production v1's 1.5")
    registry.record_event(cfg, name, 1, {"type": "rollout", "instances": ["i0"]})
    db = cfg.state_dir / "mlflow.db"
    fast = {m.name: m for m in read_sqlite(db, None)}
    slow = {m.name: m for m in read_mlflow(cfg, None)}
    assert fast.keys() == slow.keys() and name in fast
    for n in fast:
        assert fast[n].aliases == slow[n].aliases
        assert [
            (v.version, v.run_id, v.creation_timestamp, v.tags, v.description) for v in fast[n].versions
        ] == [(v.version, v.run_id, v.creation_timestamp, v.tags, v.description) for v in slow[n].versions]
    assert read_sqlite(db, [name, "no-such"])[0].name == name


def test_status_json_numbers_and_gate(registry_project, two_adapters, tiny_base):
    """Issue 17 items 4 and 8: the gate's verdict and reason in status (text and JSON); numbers as numbers."""
    from pipeline.cli import app

    cfg = registry_project
    name = _name("gate")
    register(cfg, two_adapters[0], tiny_base, name)
    reason = "eval_loss 3.1000 is worse than production v1's 1.5000 by more than 0.02"
    registry.record_gate(cfg, name, 1, "gated", reason)
    env = {"PIPELINE_CONFIG": str(cfg.source)}
    r = CliRunner().invoke(app, ["status", name, "--json"], env=env)
    assert r.exit_code == 0, r.output
    row = json.loads(r.output)["models"][0]["versions"][0]
    assert row["gate"] == {"verdict": "gated", "reason": reason}
    assert isinstance(row["eval_loss"], float) and row["eval_loss"] == 1.5
    assert isinstance(row["tokens_per_s"], (int, float)) and isinstance(row["version"], int)
    r = CliRunner().invoke(app, ["status", name], env=env)
    assert r.exit_code == 0 and r.output.splitlines()[1].split()[4] == "gated"
    r = CliRunner().invoke(app, ["status", name, "-o", "wide"], env=env)  # and why, in the last column
    assert r.exit_code == 0 and r.output.splitlines()[1].endswith(reason)
    # ...and the version page in the MLflow UI: the description's first line says it too
    mv = registry.client(cfg).get_model_version(name, "1")
    assert mv.description.splitlines()[0] == f"GATED, stays candidate: {reason}"
    assert mv.tags["gate.verdict"] == "gated"
    registry.record_gate(cfg, name, 1, "pass", None)  # a later pass replaces the line
    mv = registry.client(cfg).get_model_version(name, "1")
    assert mv.description.splitlines()[0].startswith("candidate: ") and "GATED" not in mv.description


def test_status_does_not_import_mlflow(registry_project, two_adapters, tiny_base):
    cfg = registry_project
    name = _name("noimp")
    register(cfg, two_adapters[0], tiny_base, name)
    code = (
        "import sys\nfrom pipeline.cli import app\n"
        f"try:\n    app(['status', {name!r}, '--json'], prog_name='pipeline')\nexcept SystemExit as e:\n"
        "    assert not e.code, e.code\n"
        "print([m for m in ('mlflow', 'sqlalchemy', 'torch', 'transformers') if m in sys.modules])"
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, "PIPELINE_CONFIG": str(cfg.source)},
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "[]"


def test_outside_a_project_nothing_is_created(tmp_path):
    """Issue 17 item 6: `pipeline status` in an empty directory names what it looked for, creates nothing."""
    r = _pipeline("status", cwd=tmp_path)
    assert (
        r.returncode == 2 and "not inside a lora-pipeline project" in r.stderr and str(tmp_path) in r.stderr
    )
    r = _pipeline("status", "--json", cwd=tmp_path)
    assert r.returncode == 2 and json.loads(r.stdout)["exit_code"] == 2
    # siblings: the other commands that read or move an existing registry
    for args in (
        ["publish", "x", "--version", "1"],
        ["rollback", "x"],
        ["promote", "x", "1"],
        ["ui"],
        ["follow-alias", "--once"],
    ):
        r = _pipeline(*args, cwd=tmp_path)
        assert r.returncode == 2 and "not inside a lora-pipeline project" in r.stderr, (args, r.stderr[-500:])
    assert list(tmp_path.iterdir()) == []


def test_project_without_a_store_reads_empty_and_stays_so(tmp_path):
    (tmp_path / "pipeline.yaml").write_text("fleet: {max_lora_rank: 16}\n")
    r = _pipeline("status", cwd=tmp_path)
    assert r.returncode == 0 and "no registered models" in r.stderr and r.stdout == "", r.stderr
    r = _pipeline("publish", "x", "--version", "1", cwd=tmp_path)
    assert r.returncode == 2 and "no registry yet" in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pipeline.yaml"]


def test_found_from_a_subdirectory(registry_project, two_adapters, tiny_base, tmp_path):
    """The project is found walking up, by pipeline.yaml or by the embedded store (.state/mlflow.db)."""
    import shutil

    cfg = registry_project
    name = _name("walk")
    register(cfg, two_adapters[0], tiny_base, name)
    sub = cfg.source.parent / "a" / "b"
    sub.mkdir(parents=True, exist_ok=True)
    r = _pipeline("status", name, "--json", "--no-fleet", cwd=sub)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["project"] == str(cfg.source)
    # a project with no pipeline.yaml: the default store .state/mlflow.db marks its root
    bare = tmp_path / "proj"
    (bare / ".state").mkdir(parents=True)
    shutil.copy(cfg.state_dir / "mlflow.db", bare / ".state" / "mlflow.db")
    (bare / "deep" / "er").mkdir(parents=True)
    r = _pipeline("status", name, "--json", cwd=bare / "deep" / "er")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["project"] == str(bare) and str(bare / ".state" / "mlflow.db") in data["tracking_uri"]
    assert not (bare / "deep" / "er" / ".state").exists()
