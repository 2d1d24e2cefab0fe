"""`pipeline ui`: the MLflow server (UI) on 127.0.0.1 against the project's own store, behind a login.

127.0.0.1 keeps other machines out, not other users of this one: any local account could move
the `production` alias through the REST API (which ships that version to the fleet) and download
artifacts the server process can read. So the server runs MLflow's own authentication app
(`mlflow server --app-name basic-auth`, mlflow/server/auth): every page, REST call and artifact
download needs the login; only `/health` and static files are open. One account, the admin:

- `MLFLOW_TRACKING_USERNAME` / `MLFLOW_TRACKING_PASSWORD` when set (the variables MLflow's clients
  and `pipeline status` send to a tracking server; MLflow's auth wants >= 12 characters), else
  `admin` and a generated password kept in `<state_dir>/ui-credentials.json` (mode 0600, reused
  by later starts so a browser can remember it);
- a fresh user database per start, in a private directory (0700) removed when the server stops:
  the login is always the one configured now; `default_permission` is NO_PERMISSIONS, so no other
  account (none is created) could read anything.

Writes stay possible in the UI for the operator (moving `production` there is how a version is
shipped by the follower, docs/registry.md); the pipeline's own commands talk to the store directly.

The server runs under `pipeline.children.guarded`: it ends with `pipeline ui` however that ends
(Ctrl-C, SIGTERM, SIGHUP, SIGKILL, an exception), uvicorn workers included.

Fast start-up (docs/mlflow.md): one worker and no job runners
(`--workers 1`, `MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false`) start in ~8-12 s on 2 cores
instead of 39-48 s. The server reads the same database the CLI writes (sqlite or PostgreSQL)
and the experiment's artifact location (`<state_dir>/mlartifacts` or `registry.artifact_location`).
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

from pipeline import registry
from pipeline.artifacts.atomic import rmtree
from pipeline.artifacts.bounded import loads_json, read_bounded
from pipeline.children import guarded
from pipeline.config import ProjectConfig
from pipeline.errors import UsageError
from pipeline.redact import add_secret
from pipeline.registry.database import engine_uri

CREDENTIALS_FILE = "ui-credentials.json"
DEFAULT_USER = "admin"
MIN_PASSWORD = 12  # mlflow/utils/validation.py `_validate_password`


class UIError(UsageError):
    """The MLflow UI server could not start."""


def model_url(base: str, name: str | None = None, version: int | None = None) -> str:
    """The UI page of the model list, a model, or one version (hash routes of MLflow 3's UI)."""
    base = base.rstrip("/")
    if name is None:
        return f"{base}/#/models"
    url = f"{base}/#/models/{quote(name, safe='')}"
    return url if version is None else f"{url}/versions/{int(version)}"


@dataclass(frozen=True)
class Credentials:
    """The UI's login; `source` says where the password is (a variable, or the file)."""

    username: str
    password: str = field(repr=False)
    source: str


def ui_credentials(cfg: ProjectConfig) -> Credentials:
    """The login of the UI (module doc). Raises UsageError for a password MLflow would refuse."""
    user = os.environ.get("MLFLOW_TRACKING_USERNAME")
    pw = os.environ.get("MLFLOW_TRACKING_PASSWORD")
    if pw:
        if len(pw) < MIN_PASSWORD:
            raise UsageError(
                f"$MLFLOW_TRACKING_PASSWORD has {len(pw)} characters; MLflow's login needs at least {MIN_PASSWORD}"
            )
        return Credentials(user or DEFAULT_USER, pw, "$MLFLOW_TRACKING_PASSWORD")
    path = Path(cfg.state_dir) / CREDENTIALS_FILE
    for _ in range(2):  # made by a concurrent `pipeline ui` between the read and the create: read again
        try:
            data = loads_json(read_bounded(path, 4096, "the UI credentials"), str(path))
            if not (isinstance(data, dict) and len(str(data.get("password") or "")) >= MIN_PASSWORD):
                raise ValueError("no password of at least 12 characters")
            return Credentials(
                user or str(data.get("username") or DEFAULT_USER), str(data["password"]), str(path)
            )
        except FileNotFoundError:
            pass
        except (OSError, ValueError) as e:
            raise UsageError(
                f"{path}: unreadable ({e}); delete it and the next `pipeline ui` makes a new password"
            ) from e
        creds = Credentials(user or DEFAULT_USER, secrets.token_urlsafe(18), str(path))
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except FileExistsError:
            continue
        with os.fdopen(fd, "w") as f:
            json.dump({"username": creds.username, "password": creds.password}, f)
        return creds
    raise UsageError(f"{path}: cannot be created or read")


def auth_environment(creds: Credentials, auth_dir: Path) -> dict[str, str]:
    """Environment for `mlflow server --app-name basic-auth` with its user database in `auth_dir`."""
    ini = Path(auth_dir) / "basic_auth.ini"
    ini.write_text(
        "[mlflow]\n"
        "default_permission = NO_PERMISSIONS\n"
        f"database_uri = sqlite:///{Path(auth_dir).resolve()}/basic_auth.db\n"
        f"admin_username = {creds.username}\n"
        "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
    )
    ini.chmod(0o600)
    return {
        "MLFLOW_AUTH_CONFIG_PATH": str(ini),
        "MLFLOW_AUTH_ADMIN_USERNAME": creds.username,
        "MLFLOW_AUTH_ADMIN_PASSWORD": creds.password,
        "MLFLOW_FLASK_SERVER_SECRET_KEY": secrets.token_hex(32),  # CSRF key of the auth app, per start
    }


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def server_command(cfg: ProjectConfig, host: str, port: int) -> tuple[list[str], dict[str, str]]:
    """The `mlflow server` command line for this project's store, and the environment it needs.

    The store's locations go through the environment (`mlflow server`'s own variables for
    `--backend-store-uri`, `--registry-store-uri`, `--artifacts-destination`), never the command
    line: a process's arguments are readable by every local user (`ps`, /proc/PID/cmdline), and a
    PostgreSQL or S3 URI carries its password. MLflow hands them on to its uvicorn workers through
    the environment too (mlflow/server/__init__.py `_run_server`).
    """
    cmd = [
        sys.executable,
        "-m",
        "mlflow",
        "server",
        "--host",
        host,
        "--port",
        str(port),
        "--workers",
        "1",
        "--serve-artifacts",
        "--app-name",
        "basic-auth",
    ]
    env = {"MLFLOW_BACKEND_STORE_URI": engine_uri(cfg.tracking_uri)}  # the driver the project ships
    if cfg.registry.registry_uri:
        env["MLFLOW_REGISTRY_STORE_URI"] = engine_uri(cfg.registry.registry_uri)
    dest = registry.artifact_location(cfg)
    if dest:
        env["MLFLOW_ARTIFACTS_DESTINATION"] = dest
    return cmd, env


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    log: Path
    credentials: Credentials | None = None
    auth_dir: Path | None = None

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
        if self.auth_dir is not None:
            rmtree(self.auth_dir)


def start(cfg: ProjectConfig, host: str = "127.0.0.1", port: int = 5000, timeout_s: float = 180) -> Server:
    """Start `mlflow server` and wait until `/health` answers; returns the running Server.

    `port=0` picks a free port. The store is initialised first (the CLI's file lock), so the
    server never races a first-time schema creation. Output goes to `<state_dir>/mlflow-ui.log`.

    The server needs the login of `ui_credentials` (`Server.credentials`).

    Raises:
        UsageError: the tracking URI is already a server (open it instead) or the port is taken.
        UIError: the server exited or did not answer within `timeout_s` (the log's tail is shown).
    """
    import httpx

    if registry.is_server_uri(cfg.tracking_uri):
        raise UsageError(f"the registry is a server already ({cfg.tracking_uri}): open it in a browser")
    if registry.initialised(cfg):  # the usual case: no mlflow import here (~2 s) before the server's own
        registry.keep_private(cfg)
    else:
        registry.experiment_id(cfg)  # initialise schema + experiment under the lock
    port = port or free_port(host)
    with socket.socket() as s:
        if s.connect_ex((host, port)) == 0:
            raise UsageError(f"{host}:{port} is in use: pass --port N (or --port 0 for a free one)")
    log = cfg.state_dir / "mlflow-ui.log"
    creds = ui_credentials(cfg)
    add_secret(creds.password)
    auth_dir = Path(tempfile.mkdtemp(prefix="pipeline-ui-auth."))  # 0700, removed by Server.stop
    cmd, store_env = server_command(cfg, host, port)
    env = dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false", **store_env)
    env.update(auth_environment(creds, auth_dir))
    # the server's log is the operator's (it names the store, requests and errors): 0600, as the store
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "wb") as fh:
        proc = subprocess.Popen(  # under the guard: the server dies with `pipeline`, even on SIGKILL
            guarded(cmd),
            stdout=fh,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    server = Server(proc, f"http://{host}:{port}", log, creds, auth_dir)
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
