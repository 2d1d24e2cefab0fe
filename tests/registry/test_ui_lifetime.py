"""`pipeline ui`'s MLflow server dies with it however it ends (issue 17 item 11), and the REST reader
reads what the server serves. Real `mlflow server` processes (slow: each start takes 10-60 s here)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from pipeline.registry.read import read_rest, read_sqlite
from tests.support import registry_support
from tests.support.registry_support import register

pytestmark = pytest.mark.slow
registry_project = registry_support.registry_project
two_adapters = registry_support.two_adapters


def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                ppid = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(p.name))
    out, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.add(c)
            todo.append(c)
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _spawn_ui(cfg) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "pipeline", "ui", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "PIPELINE_CONFIG": str(cfg.source)},
        start_new_session=True,
    )


def _ui_url(proc: subprocess.Popen) -> str:
    deadline = time.time() + 240
    for line in proc.stdout:
        if line.startswith("MLflow UI: "):
            return line.split("MLflow UI: ", 1)[1].split("/#")[0]
        assert time.time() < deadline, "ui did not start"
    raise AssertionError(f"ui exited {proc.wait()}")


HOW = (signal.SIGTERM, signal.SIGKILL, signal.SIGHUP)


def test_server_dies_with_pipeline_ui(registry_project, two_adapters, tiny_base, monkeypatch):
    """One `pipeline ui` per way it can end, started together (each server start is the slow part)."""
    cfg = registry_project
    name = f"ui-{uuid.uuid4().hex[:6]}"
    register(cfg, two_adapters[0], tiny_base, name)
    procs = {how: _spawn_ui(cfg) for how in HOW}
    try:
        urls = {how: _ui_url(p) for how, p in procs.items()}
        kids = {how: _descendants(p.pid) for how, p in procs.items()}
        for how in HOW:
            assert len(kids[how]) >= 2, kids  # the guard and the server (and its workers)
        # the REST reader reads what the sqlite file holds, with the UI's login (pipeline.registry.ui)
        login = json.loads((cfg.state_dir / "ui-credentials.json").read_text())
        monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", login["username"])
        monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", login["password"])
        rest = {m.name: m for m in read_rest(urls[signal.SIGTERM], [name])}
        local = {m.name: m for m in read_sqlite(cfg.state_dir / "mlflow.db", [name])}
        assert rest[name].aliases == local[name].aliases
        assert [(v.version, v.tags) for v in rest[name].versions] == [
            (v.version, v.tags) for v in local[name].versions
        ]
        for how, p in procs.items():
            os.kill(p.pid, how)
        for p in procs.values():
            p.wait(60)
        deadline = time.time() + 60
        while time.time() < deadline and any(_alive(k) for ks in kids.values() for k in ks):
            time.sleep(0.5)
        for how in HOW:
            assert not [k for k in kids[how] if _alive(k)], f"left running after {how.name}"
    finally:
        for p in procs.values():
            for k in _descendants(p.pid) | {p.pid}:
                try:
                    os.kill(k, signal.SIGKILL)
                except ProcessLookupError:
                    pass
