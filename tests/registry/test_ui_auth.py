"""A UI that lets no other local user in (issue 30 kind 5), tested as another local user (`nobody`).

`pipeline ui` binds 127.0.0.1, but any local account could use it: `nobody` moved the `production`
alias through the REST API and downloaded a 0600 artifact. Now the server runs MLflow's basic-auth
app and every call without the login is refused; the store's files are the operator's alone; and
`nobody` can read the adapter volume (fleet instances run as other users) but change nothing on it.

Real: one `mlflow server` (the slow part, ~15 s), the pipeline's CLI run as `nobody` through
`setpriv`. Skipped (saying why) where this process cannot switch users.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import pytest

from pipeline import registry
from pipeline.registry import ui
from pipeline.release.publish import publish
from tests.support import release_support
from tests.support.helpers import REPO
from tests.support.release_support import new_project, register_versions

release_adapters = release_support.release_adapters

SETPRIV = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]
pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None,
    reason="switching to user nobody needs root and setpriv (util-linux)",
)


@pytest.fixture(scope="module")
def world(release_adapters):
    """A project under a directory `nobody` may traverse, one published version, the UI running."""
    root = Path(tempfile.mkdtemp(prefix="pipeline-ui-auth-test.", dir="/tmp"))
    root.chmod(0o755)
    home = root / "home"
    home.mkdir(mode=0o777)
    home.chmod(0o777)
    cfg = new_project(root / "proj")
    (root / "proj").chmod(0o755)
    register_versions(cfg, "agent", release_adapters, 2)
    publish(cfg, "agent", version=1)
    server = ui.start(cfg, port=0)
    try:
        yield cfg, server, home
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)


def as_nobody(home: Path, *argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    full = {
        "PATH": os.environ["PATH"],
        "HOME": str(home),
        "PYTHONPATH": str(REPO),
        "PYTHONDONTWRITEBYTECODE": "1",
        **(env or {}),
    }
    return subprocess.run([*SETPRIV, *argv], capture_output=True, text=True, env=full, timeout=120)


PROBE = r"""
import json, sys, httpx
base, weights = sys.argv[1:3]
auth = tuple(sys.argv[3].split(":", 1)) if len(sys.argv) > 3 else None
calls = {
    "ui": ("GET", "/", None),
    "search": ("GET", "/api/2.0/mlflow/registered-models/search", None),
    "move-production": ("POST", "/api/2.0/mlflow/registered-models/alias",
                        {"name": "agent", "alias": "production", "version": "2"}),
    "delete-version": ("DELETE", "/api/2.0/mlflow/model-versions/delete", {"name": "agent", "version": "2"}),
    "artifact": ("GET", f"/api/2.0/mlflow-artifacts/artifacts/{weights}", None),
    "ajax": ("GET", "/ajax-api/2.0/mlflow/registered-models/search", None),
}
out = {}
for k, (method, path, body) in calls.items():
    r = httpx.request(method, base + path, json=body, auth=auth, timeout=30)
    out[k] = r.status_code
print(json.dumps(out))
"""


def _artifact(cfg, name: str) -> str:
    """The path of version 1's `name` under the proxied artifact store (`--artifacts-destination`)."""
    model_id = registry.client(cfg).get_model_version("agent", "1").source.split("/")[-1]
    (hit,) = [p for p in cfg.artifact_root.rglob(name) if model_id in str(p)]
    return hit.relative_to(cfg.artifact_root).as_posix()


def test_nobody_gets_nothing_from_the_ui(world):
    """The issue's instance: `nobody` moved `production` through the REST API and downloaded an artifact."""
    cfg, server, home = world
    weights = _artifact(cfg, "adapter_model.safetensors")  # 0600, as PEFT writes it
    r = as_nobody(home, sys.executable, "-c", PROBE, server.url, weights)
    assert r.returncode == 0, r.stderr
    assert set(json.loads(r.stdout).values()) == {401}, r.stdout
    # a wrong password is no better (sibling: a guessed login)
    r = as_nobody(home, sys.executable, "-c", PROBE, server.url, weights, "admin:not-the-password")
    assert set(json.loads(r.stdout).values()) == {401}, r.stdout
    assert registry.alias_version(cfg, "agent", "production") == 1  # nothing moved


def test_the_operator_logs_in_and_moves_the_alias(world):
    cfg, server, _ = world
    c = server.credentials
    auth = (c.username, c.password)
    art = f"{server.url}/api/2.0/mlflow-artifacts/artifacts/{_artifact(cfg, 'adapter_config.json')}"
    assert httpx.get(art, auth=auth, timeout=30).status_code == 200
    assert httpx.get(art, timeout=30).status_code == 401
    r = httpx.post(
        f"{server.url}/api/2.0/mlflow/registered-models/alias",
        json={"name": "agent", "alias": "candidate", "version": "1"},
        auth=auth,
        timeout=30,
    )
    assert r.status_code == 200, r.text
    assert registry.alias_version(cfg, "agent", "candidate") == 1
    assert Path(c.source).stat().st_mode & 0o777 == 0o600  # the generated password, the operator's alone


def test_nobody_cannot_read_the_store_past_the_login(world):
    """Sibling: the sqlite file (0644) and the artifact tree (0755) could be read straight from disk."""
    cfg, server, home = world
    probe = (
        "import sys\n"
        "for p in sys.argv[1:]:\n"
        "    try:\n"
        "        open(p, 'rb').read(16) if not p.endswith('/') else __import__('os').listdir(p)\n"
        "        print('READ', p)\n"
        "    except PermissionError:\n"
        "        print('DENIED', p)\n"
    )
    paths = [str(cfg.embedded_store), f"{cfg.artifact_root}/", str(Path(server.credentials.source))]
    r = as_nobody(home, sys.executable, "-c", probe, *paths)
    assert r.stdout.split() == [x for p in paths for x in ("DENIED", p)], r.stdout + r.stderr
    r = as_nobody(home, sys.executable, "-m", "pipeline", "status", env={"PIPELINE_CONFIG": str(cfg.source)})
    assert r.returncode == 2 and "Traceback" not in r.stderr and "mlflow.db" in r.stderr, r.stderr


def test_nobody_reads_the_volume_and_changes_nothing_on_it(world):
    """The volume side: instances (other users) must read version directories; no other user may write
    them, their staging area, the transaction records or the desired state."""
    cfg, server, home = world
    vol = cfg.volume.path
    before = sorted((str(p), p.lstat().st_mode, p.lstat().st_size) for p in vol.rglob("*"))
    env = {"PIPELINE_CONFIG": str(cfg.source)}
    probe = (
        "import sys, os\n"
        "vol = sys.argv[1]\n"
        "print(len(open(os.path.join(vol, 'agent-v1', 'adapter_model.safetensors'), 'rb').read()) > 0)\n"
        "for p in ('agent-v1/x', 'fleet-state.json', '.staging/agent', '.txn/agent.json', 'agent-v9'):\n"
        "    try:\n"
        "        open(os.path.join(vol, p), 'w').write('x')\n"
        "        print('WROTE', p)\n"
        "    except OSError as e:\n"
        "        print('REFUSED', p)\n"
    )
    r = as_nobody(home, sys.executable, "-c", probe, str(vol))
    lines = r.stdout.split("\n")
    assert lines[0] == "True" and not [x for x in lines if x.startswith("WROTE")], r.stdout + r.stderr
    r = as_nobody(home, sys.executable, "-m", "pipeline", "fleet", "status", env=env)
    assert "Traceback" not in r.stdout + r.stderr, r.stderr
    for argv in (["fleet", "prune", "agent", "--keep", "1"], ["rollback", "agent", "--to", "1"]):
        r = as_nobody(home, sys.executable, "-m", "pipeline", *argv, env=env)
        assert r.returncode == 2 and "Traceback" not in r.stdout + r.stderr, (argv, r.stderr)
    assert sorted((str(p), p.lstat().st_mode, p.lstat().st_size) for p in vol.rglob("*")) == before


def test_nobody_cannot_hold_a_lock_of_the_pipeline(world):
    """Sibling: `flock` needs only a read-only descriptor, and the lock files were 0644: `nobody` held
    `<volume>/.locks/agent.lock` and every publish of agent waited for it (then exit 3)."""
    cfg, server, home = world
    locks = [
        cfg.volume.path / ".locks" / "agent.lock",
        cfg.volume.path / ".fleet-state.lock",
        cfg.state_dir / "mlflow-init.lock",
    ]
    assert all(p.exists() for p in locks), locks
    probe = (
        "import fcntl, sys\n"
        "for p in sys.argv[1:]:\n"
        "    try:\n"
        "        fcntl.flock(open(p), fcntl.LOCK_EX | fcntl.LOCK_NB)\n"
        "        print('HELD', p)\n"
        "    except OSError:\n"
        "        print('REFUSED', p)\n"
    )
    r = as_nobody(home, sys.executable, "-c", probe, *map(str, locks))
    assert r.stdout.split() == [x for p in locks for x in ("REFUSED", str(p))], r.stdout + r.stderr


def test_the_store_is_not_on_the_server_s_command_line(world):
    """Sibling of kind 4: `mlflow server --backend-store-uri postgresql://user:PASSWORD@...` showed the
    password to every local user (`ps`, /proc/PID/cmdline). The URIs go through the environment; the
    server's log is 0600."""
    cfg, server, _ = world
    pgid = os.getpgid(server.proc.pid)
    cmdlines = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.getpgid(int(pid)) == pgid:
                cmdlines.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode())
        except (OSError, ProcessLookupError):
            pass
    assert any("mlflow" in c for c in cmdlines), cmdlines  # the server and its uvicorn worker
    store = str(cfg.embedded_store)
    assert not [c for c in cmdlines if store in c or "store-uri" in c or "artifacts-destination" in c]
    assert server.log.stat().st_mode & 0o777 == 0o600
    # a PostgreSQL store with its password: the command line holds neither, the environment does
    pg = cfg.model_copy(update={"registry": cfg.registry.model_copy(update={"tracking_uri": PG_URI})})
    cmd, env = ui.server_command(pg, "127.0.0.1", 5000)
    from pipeline.registry.database import engine_uri  # a plain postgresql:// reaches MLflow with its driver

    assert "S3cret-Passw0rd" not in " ".join(cmd) and env["MLFLOW_BACKEND_STORE_URI"] == engine_uri(PG_URI)


PG_URI = "postgresql://lora:S3cret-Passw0rd@127.0.0.1:5432/mlflow"
