"""Helpers for the registry tests: adapters with manifests (no training), PostgreSQL, signing."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from tests.support.helpers import REPO, peft_adapter

PIPELINE = REPO / ".venv" / "bin" / "pipeline"


def adapter_with_manifest(
    base: Path, out: Path, seed: int, name: str = "agent", run_id: str | None = None, eval_loss: float = 1.25
) -> Path:
    """A PEFT adapter from `tests.support.helpers.peft_adapter` plus the manifest `pipeline train` writes."""
    from pipeline.artifacts.manifest import (
        AdapterManifest,
        BaseModelRef,
        DatasetRecord,
        LoraSettings,
        ServedRef,
        TrainMetrics,
        file_hashes,
        package_versions,
        write_manifest,
    )
    from pipeline.train.launch import base_fingerprint

    peft_adapter(base, out, r=8, alpha=16, seed=seed)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (base / f).exists():
            shutil.copy2(base / f, out / f)
    manifest = AdapterManifest(
        name=name,
        created="2026-01-01T00:00:00+00:00",
        files=file_hashes(out),
        base_model=BaseModelRef(id=str(base), fingerprint=base_fingerprint(str(base))),
        served=ServedRef(checkpoint="tiny-qwen3.5", model="tiny-qwen3.5"),
        dataset=DatasetRecord(fingerprint=f"{seed:02d}" * 32),
        config_sha256="c" * 64,
        adapter=LoraSettings(r=8, lora_alpha=16, peft_type="LORA"),
        versions=package_versions(),
        metrics=TrainMetrics(eval_loss=eval_loss, train_loss=eval_loss + 0.1, tokens_per_s=1234.5),
        mlflow_run_id=run_id,
        gpus=1,
    )
    write_manifest(out, manifest)
    return out


def register(cfg, adapter: Path, base: Path, name: str):
    """Validate (really) and register, as `pipeline register` does; returns registry.Registered."""
    from pipeline import registry
    from pipeline.validate import validate_adapter

    rep = validate_adapter(adapter, base)
    assert rep.passed, rep.to_dict()
    return registry.register_adapter(cfg, adapter, name, rep.to_dict())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pg_bin() -> Path | None:
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"))
    if found:
        return found[-1].parent
    w = shutil.which("initdb")
    return Path(w).parent if w else None


class Postgres:
    """A throw-away PostgreSQL cluster on 127.0.0.1 (Debian packages; `postgres` user when root)."""

    def __init__(self):
        self.bin = pg_bin()
        self.dir = Path(tempfile.mkdtemp(prefix="pipeline-pg-"))
        self.port = free_port()
        self.as_postgres = os.geteuid() == 0  # initdb refuses to run as root

    def _run(self, *cmd: str, timeout: float = 120) -> None:
        full = [str(self.bin / cmd[0]), *cmd[1:]]
        if self.as_postgres:
            full = ["runuser", "-u", "postgres", "--", *full]
        r = subprocess.run(full, capture_output=True, text=True, timeout=timeout)
        if r.returncode != 0:
            raise RuntimeError(f"{' '.join(full)} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")

    def start(self) -> str:
        if self.as_postgres:
            shutil.chown(self.dir, "postgres", "postgres")
        data = self.dir / "data"
        self._run("initdb", "-D", str(data), "-A", "trust", "-U", "postgres", "--no-sync", "-E", "UTF8")
        opts = (
            f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.dir} -c fsync=off -c full_page_writes=off"
        )
        self._run("pg_ctl", "-D", str(data), "-o", opts, "-l", str(self.dir / "pg.log"), "-w", "start")
        self._run("createdb", "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres", "mlflow")
        return f"postgresql+psycopg2://postgres@127.0.0.1:{self.port}/mlflow"

    def stop(self) -> None:
        try:
            self._run("pg_ctl", "-D", str(self.dir / "data"), "-m", "immediate", "-w", "stop", timeout=60)
        except Exception:
            pass
        shutil.rmtree(self.dir, ignore_errors=True)


def run_parallel(cmds: list[list[str]], env: dict, timeout: float = 240) -> list[subprocess.CompletedProcess]:
    """Start all commands at once (separate processes), wait for all; returns their results."""
    procs = [
        subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        for c in cmds
    ]
    out = []
    deadline = time.monotonic() + timeout
    for p, c in zip(procs, cmds, strict=True):
        stdout, _ = p.communicate(timeout=max(1, deadline - time.monotonic()))
        out.append(subprocess.CompletedProcess(c, p.returncode, stdout, None))
    return out


# -- fixtures shared by the tests/test_registry*.py modules (import them there) ------------------
import pytest  # noqa: E402


@pytest.fixture(scope="session")
def registry_project(tmp_path_factory):
    """One sqlite project for the registry tests (schema created once; tests use distinct names)."""
    from pipeline.config import load_config
    from tests.support.helpers import write_project_config

    root = tmp_path_factory.mktemp("registry")
    return load_config(write_project_config(root))


@pytest.fixture(scope="session")
def two_adapters(tmp_path_factory, tiny_base):
    """Two different adapters (seeds 1 and 2) with manifests: (path_v1, path_v2)."""
    root = tmp_path_factory.mktemp("reg-adapters")
    return (
        adapter_with_manifest(tiny_base, root / "a1", seed=1, eval_loss=1.5),
        adapter_with_manifest(tiny_base, root / "a2", seed=2, eval_loss=1.2),
    )
