"""`pipeline ui`'s MLflow server dies with it however it ends (issue 17 item 11), and the REST reader
reads what the server serves. Real `mlflow server` processes (slow: each start takes 10-60 s here)."""

from __future__ import annotations

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


def _start_ui(cfg) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipeline", "ui", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "PIPELINE_CONFIG": str(cfg.source)},
        start_new_session=True,
    )
    deadline = time.time() + 240
    for line in proc.stdout:
        if line.startswith("MLflow UI: "):
            return proc, line.split("MLflow UI: ", 1)[1].split("/#")[0]
        assert time.time() < deadline, "ui did not start"
    raise AssertionError(f"ui exited {proc.wait()}")


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL, signal.SIGHUP])
def test_server_dies_with_pipeline_ui(registry_project, two_adapters, tiny_base, how):
    cfg = registry_project
    name = f"ui-{uuid.uuid4().hex[:6]}"
    register(cfg, two_adapters[0], tiny_base, name)
    proc, url = _start_ui(cfg)
    try:
        kids = _descendants(proc.pid)
        assert len(kids) >= 2, kids  # the guard and the server (and its workers)
        if how == signal.SIGTERM:  # once is enough: the REST reader reads what the sqlite file holds
            rest = {m.name: m for m in read_rest(url, [name])}
            local = {m.name: m for m in read_sqlite(cfg.state_dir / "mlflow.db", [name])}
            assert rest[name].aliases == local[name].aliases
            assert [(v.version, v.tags) for v in rest[name].versions] == [
                (v.version, v.tags) for v in local[name].versions
            ]
        os.kill(proc.pid, how)
        proc.wait(60)
        deadline = time.time() + 60
        while time.time() < deadline and any(_alive(k) for k in kids):
            time.sleep(0.5)
        assert not [k for k in kids if _alive(k)], f"left running after {how.name}"
    finally:
        for k in _descendants(proc.pid) | {proc.pid}:
            try:
                os.kill(k, signal.SIGKILL)
            except ProcessLookupError:
                pass
