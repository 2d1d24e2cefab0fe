"""The registry store fails: a clear StoreError (exit 2) naming the store within seconds, nothing written
(issue 16 section 4, and section 1's recreated sqlite file).

Real sqlite stores and real sockets on 127.0.0.1: a closed port, a port that accepts and never
answers, a database locked by another connection, a file that is not a database, a file store.
"""

from __future__ import annotations

import socket
import sqlite3
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pipeline import registry
from pipeline.cli import app
from pipeline.errors import StoreError
from pipeline.registry import store
from tests.support import release_support
from tests.support.registry_support import free_port
from tests.support.release_support import forget_mlflow_engines, new_project, register_versions

release_adapters = release_support.release_adapters


def _cli(cfg, *args, env=None):
    return CliRunner().invoke(
        app, [str(a) for a in args], env={"PIPELINE_CONFIG": str(cfg.source), **(env or {})}
    )


@pytest.fixture(autouse=True)
def _fresh_checks():
    """The store check runs once per store and process; each test starts unchecked."""
    store._checked.clear()
    yield
    store._checked.clear()


def test_closed_port_fails_in_seconds_naming_the_store(tmp_path):
    """Issue 16: MLFLOW_TRACKING_URI at a closed port took 251 s, then a traceback."""
    cfg = new_project(tmp_path)
    uri = f"http://127.0.0.1:{free_port()}"
    t = time.monotonic()
    r = _cli(cfg, "status", env={"MLFLOW_TRACKING_URI": uri})
    assert time.monotonic() - t < 30  # not MLflow's ~4 minutes of retries (generous: a loaded machine)
    assert r.exit_code == 2, r.output
    assert uri in r.output and "unreachable" in r.output and "Traceback" not in r.output


def test_server_that_accepts_but_never_answers(tmp_path):
    """Sibling: a hung tracking server (accepts the connection, never answers /health)."""
    cfg = new_project(tmp_path, registry={"connect_timeout_s": 1})
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(8)  # never accepted: the kernel completes the handshake, nobody answers
        uri = f"http://127.0.0.1:{srv.getsockname()[1]}"
        r = _cli(cfg, "publish", "agent", "--version", "1", env={"MLFLOW_TRACKING_URI": uri})
    assert r.exit_code == 2, r.output
    assert "does not answer" in r.output and uri in r.output
    assert not cfg.volume.path.exists()


def test_postgres_at_a_closed_port(tmp_path):
    """Sibling: a database URI whose server is down (MLflow retries engine creation for a long time)."""
    cfg = new_project(tmp_path)
    uri = f"postgresql+psycopg2://u:secret@127.0.0.1:{free_port()}/mlflow"
    r = _cli(cfg, "status", env={"MLFLOW_TRACKING_URI": uri})
    assert r.exit_code == 2, r.output
    assert "unreachable" in r.output and "secret" not in r.output and "***@127.0.0.1" in r.output


def test_locked_sqlite_store(tmp_path):
    """Issue 16: a sqlite store locked by another process gave a traceback after ~9 s."""
    cfg = new_project(tmp_path, registry={"connect_timeout_s": 1})
    registry.experiment_id(cfg)  # the store exists
    store._checked.clear()
    db = cfg.state_dir / "mlflow.db"
    other = sqlite3.connect(db, isolation_level=None)
    other.execute("BEGIN EXCLUSIVE")
    try:
        t = time.monotonic()
        r = _cli(cfg, "status")
        assert time.monotonic() - t < 20
    finally:
        other.execute("ROLLBACK")
        other.close()
    assert r.exit_code == 2, r.output
    assert "locked by another process" in r.output and str(db) in r.output and "Traceback" not in r.output


def test_database_is_locked_met_later_is_a_store_error():
    """The check passed, then MLflow met the lock: the CLI still maps it to StoreError."""
    err = store.as_store_error(sqlite3.OperationalError("database is locked"), "sqlite:////x/mlflow.db")
    assert isinstance(err, StoreError) and "locked by another process" in str(err)
    assert store.as_store_error(ValueError("x")) is None


def test_file_that_is_not_a_database(tmp_path):
    cfg = new_project(tmp_path, store=False)
    cfg.state_dir.mkdir(parents=True)
    (cfg.state_dir / "mlflow.db").write_bytes(b"this is not sqlite" * 100)
    r = _cli(cfg, "status")
    assert r.exit_code == 2 and "not an MLflow sqlite database" in r.output, r.output


@pytest.mark.parametrize("uri", ["./mlruns", "file:///tmp/mlruns-x"])
def test_file_store_is_refused_before_anything_is_written(tmp_path, uri, monkeypatch, tiny_base):
    """Issue 16: `MLFLOW_TRACKING_URI=./mlruns` gave tracebacks in register and train, and train left a
    run directory behind."""
    from tests.support.helpers import REPO

    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    monkeypatch.chdir(tmp_path)
    cfg = new_project(tmp_path / "p")
    r = _cli(cfg, "status", env={"MLFLOW_TRACKING_URI": uri})
    assert r.exit_code == 2 and "file store" in r.output and "MLFLOW_ALLOW_FILE_STORE" in r.output, r.output
    r = _cli(
        cfg,
        "train",
        REPO / "axolotl_configs" / "tiny-cpu.yml",
        "--set",
        f"base_model={tiny_base}",
        "--set",
        f"datasets=[{{path: {REPO / 'datasets/agent_chat_train.jsonl'}, type: chat_template}}]",
        "--set",
        "test_datasets=null",
        env={"MLFLOW_TRACKING_URI": uri},
    )
    assert r.exit_code == 2 and "file store" in r.output, r.output
    assert not cfg.train.runs_dir.exists()  # no run directory left behind
    assert not (tmp_path / "mlruns").exists()


def test_deleted_sqlite_store_is_refused_not_silently_recreated(tmp_path, release_adapters, monkeypatch):
    """Issue 16: the sqlite file deleted was silently recreated empty; a new v1 then 'published' as
    'already on the volume' and the old v1's weights stayed live under the new alias."""
    from pipeline.release.publish import PublishError, publish
    from pipeline.release.rollback import rollback

    cfg = new_project(tmp_path)
    register_versions(cfg, "agent", release_adapters[:1], 1)
    publish(cfg, "agent", version=1)
    (cfg.state_dir / "mlflow.db").unlink()
    store._checked.clear()
    forget_mlflow_engines()
    r = _cli(cfg, "status")
    assert r.exit_code == 2 and "is gone" in r.output and "Restore the file" in r.output, r.output
    assert not (cfg.state_dir / "mlflow.db").exists()  # not recreated

    # On purpose: a new, empty registry (the message says how). Its v1 is other weights.
    next(cfg.state_dir.glob(".mlflow-init-*")).unlink()
    with pytest.raises(StoreError, match="PIPELINE_NEW_REGISTRY=1"):  # the volume holds v1: not silently
        register_versions(cfg, "agent", release_adapters[1:2], 1)
    monkeypatch.setenv("PIPELINE_NEW_REGISTRY", "1")
    register_versions(cfg, "agent", release_adapters[1:2], 1)
    with pytest.raises(PublishError, match="published from another registry entry") as e:
        publish(cfg, "agent", version=1)
    assert "artifact models:/" in str(e.value)
    with pytest.raises(PublishError, match="published from another registry entry"):
        rollback(cfg, "agent", to=1)
    assert registry.alias_version(cfg, "agent", "production") is None  # nothing moved
    r = _cli(cfg, "publish", "agent", "--version", "1")
    assert r.exit_code == 1 and "Traceback" not in r.output


def test_same_weights_reregistered_in_a_new_store_are_still_another_entry(
    tmp_path, release_adapters, monkeypatch
):
    """Sibling: the same adapter registered again as v1 of a recreated store: same weights, but the
    directory records another model version, so it is refused too (the lineage would be wrong)."""
    from pipeline.release.publish import PublishError, publish

    cfg = new_project(tmp_path)
    register_versions(cfg, "same", release_adapters[:1], 1)
    publish(cfg, "same", version=1)
    (cfg.state_dir / "mlflow.db").unlink()
    next(cfg.state_dir.glob(".mlflow-init-*")).unlink()
    store._checked.clear()
    forget_mlflow_engines()
    monkeypatch.setenv("PIPELINE_NEW_REGISTRY", "1")  # on purpose (the volume holds v1)
    register_versions(cfg, "same", release_adapters[:1], 1)
    with pytest.raises(PublishError, match="another registry entry"):
        publish(cfg, "same", version=1)


@pytest.mark.parametrize(
    "read_only,args",
    [
        ("file", ["publish", "agent", "--version", "2"]),
        ("dir", ["publish", "agent", "--version", "2"]),  # sibling: sqlite's journal cannot be created
        ("file", ["rollback", "agent", "--to", "1"]),  # sibling: another command that moves the desired state
    ],
)
def test_read_only_store_is_refused_before_the_volume_changes(
    tmp_path, release_adapters, monkeypatch, read_only, args
):
    """A sqlite store on a read-only mount: sqlite takes its locks without complaint and the first
    write failed only after publish had moved fleet-state.json (a new user's report). The mount is
    simulated (os.access answering as on EROFS): tests run as root, for whom chmod changes nothing."""
    import os

    from pipeline.fleet.state import load_state
    from pipeline.release.publish import publish

    cfg = new_project(tmp_path)
    register_versions(cfg, "agent", release_adapters[:2], 2)
    publish(cfg, "agent", version=1)
    if args[0] == "rollback":
        publish(cfg, "agent", version=2)
    before = load_state(cfg.volume.path).version("agent")
    db = cfg.state_dir / "mlflow.db"
    ro = str(db) if read_only == "file" else str(db.parent)
    real = os.access
    monkeypatch.setattr(
        os, "access", lambda p, mode, **k: False if (mode & os.W_OK and str(p) == ro) else real(p, mode, **k)
    )
    store._checked.clear()
    r = _cli(cfg, *args)
    assert r.exit_code == 2 and "read-only" in r.output and "Traceback" not in r.output, r.output
    assert load_state(cfg.volume.path).version("agent") == before
    assert sorted(p.name for p in cfg.volume.path.glob("agent-v*")) == [
        f"agent-v{v}" for v in range(1, before + 1)
    ]
    assert _cli(cfg, "status", "agent").exit_code == 0  # still readable


def test_a_store_on_a_read_only_mount_gets_the_fix_that_fits(tmp_path, release_adapters):
    """Sibling of kind 8's wrong suggested fix: on a really read-only mount (a bind mount remounted
    `ro`) the error said "make it writable (chmod u+rw ...)", which no chmod can do."""
    import shutil
    import subprocess

    cfg = new_project(tmp_path / "p")
    register_versions(cfg, "agent", release_adapters[:1], 1)
    ro = tmp_path / "ro"
    ro.mkdir()
    mounted = subprocess.run(["mount", "--bind", str(cfg.state_dir), str(ro)], capture_output=True)
    if mounted.returncode != 0 or shutil.which("mount") is None:
        pytest.skip(f"no bind mount here: {mounted.stderr.decode()[:200]}")
    try:
        if subprocess.run(["mount", "-o", "remount,bind,ro", str(ro)], capture_output=True).returncode:
            pytest.skip("cannot remount read-only here")
        ro_cfg = new_project(tmp_path / "q", store=False, state_dir=str(ro))
        store._checked.clear()
        r = _cli(ro_cfg, "publish", "agent", "--version", "1")
        assert r.exit_code == 2 and "mounted read-only" in r.output and "chmod" not in r.output, r.output
        assert _cli(ro_cfg, "status", "agent").exit_code == 0  # still readable
    finally:
        subprocess.run(["umount", str(ro)], capture_output=True)


def test_status_reads_while_another_process_writes(tmp_path):
    """Sibling of the locked store: a writer's reserved lock (a `register` mid-transaction) does not
    stop a read; only an exclusive lock does (test_locked_sqlite_store)."""
    cfg = new_project(tmp_path, registry={"connect_timeout_s": 1})
    registry.experiment_id(cfg)
    store._checked.clear()
    other = sqlite3.connect(cfg.state_dir / "mlflow.db", isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    try:
        r = _cli(cfg, "status")
    finally:
        other.execute("ROLLBACK")
        other.close()
    assert r.exit_code == 0, r.output


# -- issue 30 kind 8: other programs' tracebacks and states ----------------------------------------------
@pytest.fixture(scope="module")
def shared_store(release_adapters):
    """A store with one version, under a directory user `nobody` may traverse; and a copy of it in a
    second project (for the test that breaks its store)."""
    import os
    import shutil
    import tempfile

    base = Path(tempfile.mkdtemp(prefix="pipeline-store-failures.", dir="/tmp"))
    base.chmod(0o755)
    cfg = new_project(base / "shared")
    register_versions(cfg, "agent", release_adapters, 1)
    other = new_project(base / "copy", store=False)  # its store is the copy below
    other.state_dir.mkdir(parents=True)
    shutil.copy2(cfg.state_dir / "mlflow.db", other.state_dir / "mlflow.db")
    for p in (base / "shared", cfg.state_dir):
        p.chmod(0o755)
    yield cfg, other
    if os.path.exists(base):
        shutil.rmtree(base)


_MID_TRANSACTION = r"""
import sqlite3, sys
from pipeline.release import transaction
from pipeline.cli import app

db = sys.argv[1]

def hook(point):  # the store check has passed; the store breaks before MLflow's next query
    if point == "after-intent":
        c = sqlite3.connect(db, isolation_level=None)
        c.execute("DROP TABLE registered_model_aliases")
        c.close()

transaction.hook = hook
sys.exit(app(sys.argv[2:], prog_name="pipeline"))
"""


def test_mlflow_logs_no_traceback_when_the_store_fails_mid_transaction(shared_store):
    """The issue's instance (a store locked mid-transaction) takes MLflow's 20 s sqlite busy timeout to
    fail; a store broken mid-transaction fails at once through the same MLflow code
    (mlflow/store/db/utils.py, `_logger.exception` on OperationalError): two tracebacks, then our
    clean error. Now the clean error alone (`--verbose` keeps MLflow's log: the next test)."""
    import os
    import subprocess
    import sys

    from tests.support.helpers import REPO

    _, cfg = shared_store
    env = {**os.environ, "PIPELINE_CONFIG": str(cfg.source), "PYTHONPATH": str(REPO)}
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            _MID_TRANSACTION,
            str(cfg.state_dir / "mlflow.db"),
            "publish",
            "agent",
            "--version",
            "1",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().startswith("error: the MLflow store") and "no such table" in r.stderr


def test_a_third_party_logger_prints_its_message_without_traceback(capfd):
    """Sibling: any library logging an exception through a logger without handlers (Python's last-resort
    handler printed message and traceback)."""
    import logging

    from pipeline.cli._common import setup_logging
    from pipeline.redact import quiet_third_party

    def log_one():
        try:
            raise RuntimeError("inner")
        except RuntimeError:
            logging.getLogger("somelib.pool").exception("connection pool failed")
        return capfd.readouterr().err

    setup_logging()
    try:
        err = log_one()
        assert "connection pool failed" in err and "Traceback" not in err
        logging.getLogger("mlflow.store.db.utils").exception("SQLAlchemy database error")
        assert capfd.readouterr().err == ""  # MLflow's own loggers: CRITICAL at the default level
        setup_logging(verbose=True)  # nothing is lost: `--verbose` keeps the traceback
        seen = []
        keep = logging.Handler()
        keep.emit = seen.append
        logging.getLogger("somelib").addHandler(keep)
        log_one()
        logging.getLogger("somelib").removeHandler(keep)
        assert seen and seen[0].exc_info is not None
    finally:
        quiet_third_party(False)


def _hot_journal(db):
    """SIGKILL a writer of `db` mid-commit: its rollback journal is left behind, hot."""
    forget_mlflow_engines()
    store._checked.clear()
    import subprocess
    import sys

    code = (
        "import os, signal, sqlite3, sys\n"
        "c = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
        "c.execute('PRAGMA cache_size=5'); c.execute('BEGIN IMMEDIATE'); c.execute('CREATE TABLE pad(x)')\n"
        "for i in range(3000): c.execute('INSERT INTO pad VALUES (?)', ('x' * 500,))\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    subprocess.run([sys.executable, "-c", code, str(db)], timeout=60)
    assert (db.parent / f"{db.name}-journal").stat().st_size > 0


def test_readers_handle_the_hot_journal_of_a_killed_writer(shared_store):
    """The issue's instance: after a writer was killed mid-commit, read-only commands failed with
    'database is read-only here' (and a wrong fix). The reader rolls the journal back and reads."""
    cfg, _ = shared_store
    db = cfg.state_dir / "mlflow.db"
    _hot_journal(db)
    for args in (["status", "--json"], ["fleet", "status"]):
        store._checked.clear()
        r = _cli(cfg, *args)
        assert r.exit_code in (0, 4) and "read-only" not in r.output and "Traceback" not in r.output, r.output
    assert not (db.parent / "mlflow.db-journal").exists()
    assert '"name": "agent"' in _cli(cfg, "status", "--json").output


def test_a_reader_that_cannot_roll_back_is_told_who_must(shared_store):
    """Sibling: the same journal met by another user (who may read, not write): one error naming the
    journal and what the store's owner runs, not 'read-only here: make it writable'."""
    import os
    import shutil
    import subprocess
    import sys

    from tests.support.helpers import REPO

    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("switching to user nobody needs root and setpriv (util-linux)")
    cfg, _ = shared_store
    db = cfg.state_dir / "mlflow.db"
    _hot_journal(db)
    db.chmod(0o644)  # readable by others (a shared read-only store), writable by its owner only
    (db.parent / "mlflow.db-journal").chmod(0o644)
    env = {
        "PATH": os.environ["PATH"],
        "HOME": "/tmp",
        "PYTHONPATH": str(REPO),
        "PIPELINE_CONFIG": str(cfg.source),
    }
    r = subprocess.run(
        [
            "setpriv",
            "--reuid=nobody",
            "--regid=nogroup",
            "--clear-groups",
            sys.executable,
            "-m",
            "pipeline",
            "status",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    db.chmod(0o600)
    store._checked.clear()
    assert _cli(cfg, "status").exit_code == 0  # the owner's next read rolls it back
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "hot journal" in r.stderr and "as the store's owner (uid 0)" in r.stderr, r.stderr
