"""`pipeline ui`: the MLflow server (UI) on 127.0.0.1 against the project's own store.

The server runs under `pipeline.children.guarded`: it ends with `pipeline ui` however that ends
(Ctrl-C, SIGTERM, SIGHUP, SIGKILL, an exception), uvicorn workers included.

Fast start-up (docs/mlflow.md): one worker and no job runners
(`--workers 1`, `MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false`) start in ~8-12 s on 2 cores
instead of 39-48 s. The server reads the same database the CLI writes (sqlite or PostgreSQL)
and the experiment's artifact location (`<state_dir>/mlartifacts` or `registry.artifact_location`).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from pipeline import registry
from pipeline.children import guarded
from pipeline.config import ProjectConfig
from pipeline.errors import UsageError


class UIError(UsageError):
    """The MLflow UI server could not start."""


def model_url(base: str, name: str | None = None, version: int | None = None) -> str:
    """The UI page of the model list, a model, or one version (hash routes of MLflow 3's UI)."""
    base = base.rstrip("/")
    if name is None:
        return f"{base}/#/models"
    url = f"{base}/#/models/{quote(name, safe='')}"
    return url if version is None else f"{url}/versions/{int(version)}"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def server_command(cfg: ProjectConfig, host: str, port: int) -> list[str]:
    """The `mlflow server` command line for this project's store."""

    cmd = [
        sys.executable,
        "-m",
        "mlflow",
        "server",
        "--backend-store-uri",
        cfg.tracking_uri,
        "--host",
        host,
        "--port",
        str(port),
        "--workers",
        "1",
        "--serve-artifacts",
    ]
    if cfg.registry.registry_uri:
        cmd += ["--registry-store-uri", cfg.registry.registry_uri]
    dest = registry.artifact_location(cfg)
    if dest:
        cmd += ["--artifacts-destination", dest]
    return cmd


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    log: Path

    def stop(self, timeout_s: float = 20) -> None:
        """End the server: `mlflow server` runs uvicorn as a child, so signal its whole session
        (the guard of `pipeline.children`, the server and its workers)."""
        import signal

        def group(sig) -> None:
            try:
                os.killpg(self.proc.pid, sig)  # own session (start_new_session): only the server's processes
            except (ProcessLookupError, PermissionError):
                pass

        group(signal.SIGTERM)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass
        time.sleep(0.5)
        group(signal.SIGKILL)  # stragglers (uvicorn worker) if SIGTERM did not end them
        self.proc.wait()


def start(cfg: ProjectConfig, host: str = "127.0.0.1", port: int = 5000, timeout_s: float = 180) -> Server:
    """Start `mlflow server` and wait until `/health` answers; returns the running Server.

    `port=0` picks a free port. The store is initialised first (the CLI's file lock), so the
    server never races a first-time schema creation. Output goes to `<state_dir>/mlflow-ui.log`.

    Raises:
        UsageError: the tracking URI is already a server (open it instead) or the port is taken.
        UIError: the server exited or did not answer within `timeout_s` (the log's tail is shown).
    """
    import httpx

    if registry.is_server_uri(cfg.tracking_uri):
        raise UsageError(f"the registry is a server already ({cfg.tracking_uri}): open it in a browser")
    registry.experiment_id(cfg)  # initialise schema + experiment under the lock
    port = port or free_port(host)
    with socket.socket() as s:
        if s.connect_ex((host, port)) == 0:
            raise UsageError(f"{host}:{port} is in use: pass --port N (or --port 0 for a free one)")
    log = cfg.state_dir / "mlflow-ui.log"
    env = dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")
    with open(log, "wb") as fh:
        proc = subprocess.Popen(  # under the guard: the server dies with `pipeline`, even on SIGKILL
            guarded(server_command(cfg, host, port)),
            stdout=fh,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    server = Server(proc, f"http://{host}:{port}", log)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        try:
            if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    server.stop()
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
    raise UIError(
        f"mlflow server did not start within {timeout_s:.0f} s (exit {proc.returncode}); {log}:\n{tail}"
    )
