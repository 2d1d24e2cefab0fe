"""Helpers for the release tests: registered versions without training, crash injection, threads.

Adapters are random PEFT LoRAs on the tiny base with the manifest `pipeline train` writes
(`registry_support.adapter_with_manifest`), validated for real once per session; a test then
registers as many versions as it needs in its own sqlite MLflow store (a version costs about a
second). Crashes are injected at the named `pipeline.release.transaction.checkpoint`s: in-process
with `crash_at` (an exception that no `except Exception` catches, so the code under test runs no
clean-up it would not run when killed), or in a child process with `PIPELINE_TEST_KILL_AT`
(SIGKILL, for what only a real kill shows: staging debris, a lock released by the kernel).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.support.helpers import REPO, seed_store, write_project_config
from tests.support.registry_support import adapter_with_manifest


class Killed(BaseException):
    """The process 'died' at a checkpoint (raised by `crash_at`)."""


@contextlib.contextmanager
def crash_at(point: str, thread: str | None = None):
    """Raise `Killed` when a transaction reaches checkpoint `point` (in thread `thread`, if given)."""
    from pipeline.release.transaction import observe

    def hook(p: str) -> None:
        if p == point and (thread is None or threading.current_thread().name == thread):
            raise Killed(point)

    with observe(hook):
        yield


class Gate:
    """Pause a thread at a checkpoint until released: `gate.reached.wait()`, then `gate.release()`."""

    def __init__(self, point: str, thread: str):
        self.point, self.thread = point, thread
        self.reached, self.go = threading.Event(), threading.Event()

    def __call__(self, p: str) -> None:
        if p == self.point and threading.current_thread().name == self.thread:
            self.reached.set()
            assert self.go.wait(120), "gate never released"

    def release(self) -> None:
        self.go.set()


def hooked(fn):
    from pipeline.release.transaction import observe

    return observe(fn)


class Worker(threading.Thread):
    """Run `fn()` in a named thread; `.result` or `.error` afterwards."""

    def __init__(self, name: str, fn):
        super().__init__(name=name, daemon=True)
        self.fn, self.result, self.error = fn, None, None

    def run(self):
        try:
            self.result = self.fn()
        except BaseException as e:  # noqa: BLE001 - reported to the test
            self.error = e


@pytest.fixture(scope="session")
def release_adapters(tmp_path_factory, tiny_base):
    """Three different adapters with manifests and their (real) validation reports: [(dir, report)]."""
    from pipeline.validate import validate_adapter

    root = tmp_path_factory.mktemp("release-adapters")
    out = []
    for seed in (11, 12, 13):
        d = adapter_with_manifest(tiny_base, root / f"a{seed}", seed=seed, eval_loss=1.0 + seed / 100)
        rep = validate_adapter(d, tiny_base)
        assert rep.passed, rep.to_dict()
        out.append((d, rep.to_dict()))
    return out


def forget_mlflow_engines() -> None:
    """Drop MLflow's per-URI SQLAlchemy engines, as a new process starts without them.

    Needed when a test deletes a sqlite file this process had open: MLflow keeps the engine of
    the deleted file (class-level `_engine_map`) and every write then fails "readonly database".
    Each `pipeline` command is a new process, so this is what a user sees.
    """
    from mlflow.store.model_registry.sqlalchemy_store import SqlAlchemyStore as RegistryStore
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore as TrackingStore
    from mlflow.tracking._model_registry.registry import ModelRegistryStoreRegistry
    from mlflow.tracking._tracking_service.registry import TrackingStoreRegistry

    for cls in (RegistryStore, TrackingStore):
        for engine in cls._engine_map.values():
            engine.dispose()
        cls._engine_map.clear()
    for reg in (TrackingStoreRegistry, ModelRegistryStoreRegistry):
        for attr in vars(reg).values():
            if hasattr(attr, "cache_clear"):
                attr.cache_clear()


def new_project(root: Path, store: bool = True, **sections):
    """A fresh project (own sqlite store and volume) under `root`.

    `store`: start from an empty MLflow store (`seed_store`: no schema migrations to wait for);
    False: no store file at all, as in a project no command has written to yet.
    """
    from pipeline.config import load_config

    root.mkdir(parents=True, exist_ok=True)
    cfg = load_config(write_project_config(root, **sections))
    if store:
        seed_store(cfg.state_dir)
    return cfg


def register_versions(cfg, name: str, adapters, n: int) -> list[int]:
    """Register `n` versions of `name`, cycling through `adapters`; returns the version numbers."""
    from pipeline import registry

    return [
        registry.register_adapter(
            cfg, adapters[i % len(adapters)][0], name, adapters[i % len(adapters)][1]
        ).version
        for i in range(n)
    ]


def snapshot(cfg, name: str) -> dict:
    """Aliases, desired state, pending record and staging of `name`: what a transaction changes."""
    from pipeline import registry
    from pipeline.fleet.state import load_state
    from pipeline.release.transaction import intent_path

    st = load_state(cfg.volume.path)
    staging = cfg.volume.path / ".staging"
    return {
        "production": registry.alias_version(cfg, name, "production"),
        "previous": registry.alias_version(cfg, name, "previous"),
        "desired": st.version(name),
        "pending": intent_path(cfg.volume.path, name).exists(),
        "staging": sorted(str(p.relative_to(staging)) for p in staging.rglob("*"))
        if staging.exists()
        else [],
    }


def pipeline_cli(cfg, *args, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -m pipeline ARGS` against `cfg`'s project in a child process."""
    full_env = dict(os.environ, PIPELINE_CONFIG=str(cfg.source), **(env or {}))
    full_env["PYTHONPATH"] = str(REPO)
    return subprocess.run(
        [sys.executable, "-m", "pipeline", *map(str, args)],
        capture_output=True,
        text=True,
        env=full_env,
        cwd=REPO,
        timeout=timeout,
    )
