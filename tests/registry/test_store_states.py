"""Stores in a state the project did not leave, stores that cannot be written, every URI form (issue 40,
kinds 1, 4 and 5).

- kind 1: a store this project created that is now empty, truncated or foreign is never initialised
  again: every door (status, register, publish, ...) refuses it, exit 2, the store untouched;
- kind 4: a PostgreSQL role that cannot write is refused before the volume or fleet-state.json change;
- kind 5: a plain `postgresql://` URI works (the shipped psycopg2 driver), a missing driver is named.

Real sqlite files; a real PostgreSQL server started by the suite (tests/support/registry_support.py),
skipped, saying why, when it is not installed (`bash scripts/ci_deps.sh`).
"""

from __future__ import annotations

import os
import re
import sqlite3
import time

import pytest
from typer.testing import CliRunner

from pipeline import registry
from pipeline.cli import app
from pipeline.errors import StoreError
from pipeline.fleet.state import load_state
from pipeline.registry import store
from tests.support import release_support
from tests.support.helpers import REPO
from tests.support.registry_support import Postgres, pg_bin
from tests.support.release_support import forget_mlflow_engines, new_project, register_versions

release_adapters = release_support.release_adapters


def _cli(cfg, *args, env=None):
    return CliRunner().invoke(
        app, [str(a) for a in args], env={"PIPELINE_CONFIG": str(cfg.source), **(env or {})}
    )


@pytest.fixture(autouse=True)
def _fresh_checks():
    store._checked.clear()
    yield
    store._checked.clear()


@pytest.fixture(scope="module")
def published(tmp_path_factory, release_adapters):
    """A sqlite project with agent v1, v2 registered and v1 published; the db's bytes to restore."""
    cfg = new_project(tmp_path_factory.mktemp("states"))
    register_versions(cfg, "agent", release_adapters[:2], 2)
    from pipeline.release.publish import publish

    publish(cfg, "agent", version=1)
    return cfg, (cfg.state_dir / "mlflow.db").read_bytes()


@pytest.fixture
def broken(published):
    """Restores the published project's database after the test broke it."""
    cfg, good = published
    yield cfg
    forget_mlflow_engines()
    (cfg.state_dir / "mlflow.db").write_bytes(good)
    store._checked.clear()


DOORS = [
    ["status", "--no-fleet"],
    ["status", "agent"],
    ["publish", "agent", "--version", "2"],
    ["promote", "agent", "2"],
    ["rollback", "agent"],
    ["fleet", "prune", "agent"],
    ["follow-alias", "--once"],
    ["fleet", "sync", "--follow-alias", "production"],
    ["ui", "--port", "0"],
]


def _refused_everywhere(cfg, expect: str, adapters):
    db = cfg.state_dir / "mlflow.db"
    before = db.read_bytes()
    for args in DOORS:
        store._checked.clear()
        r = _cli(cfg, *args)
        assert r.exit_code == 2 and expect in r.output and "Traceback" not in r.output, (args, r.output)
    with pytest.raises(StoreError, match=re.escape(expect)):
        register_versions(cfg, "agent", adapters[:1], 1)  # `register`'s registry step
    assert db.read_bytes() == before  # never initialised again
    assert load_state(cfg.volume.path).version("agent") == 1


def test_truncated_to_zero_is_refused_not_reinitialised(broken, release_adapters):
    """Issue 40: `truncate -s 0 .state/mlflow.db`, then `status --no-fleet` re-created MLflow's tables
    (0 -> 954,368 bytes), exit 0; `register` then made v1 again while versions were on the volume."""
    forget_mlflow_engines()
    os.truncate(broken.state_dir / "mlflow.db", 0)
    _refused_everywhere(broken, "is empty (no tables), but this project created", release_adapters)
    r = _cli(broken, "status")
    assert "Restore it from a backup" in r.output or "restore it from a backup" in r.output
    assert "delete " in r.output and ".mlflow-init-" in r.output  # how to start anew, explicitly


def test_truncated_part_way_is_refused_as_damaged(broken, release_adapters):
    """Sibling: cut in the middle (a full disk, a bad copy): named as damaged, with the way back."""
    forget_mlflow_engines()
    db = broken.state_dir / "mlflow.db"
    os.truncate(db, db.stat().st_size // 2)
    _refused_everywhere(broken, "is damaged or truncated", release_adapters)


def test_a_foreign_database_is_refused(broken, release_adapters):
    """Sibling: another program's sqlite file at the store's path: MLflow would add its tables next to
    the other program's."""
    forget_mlflow_engines()
    db = broken.state_dir / "mlflow.db"
    db.unlink()
    con = sqlite3.connect(db)
    con.execute("CREATE TABLE notes (id INTEGER PRIMARY KEY, body TEXT)")
    con.commit()
    con.close()
    _refused_everywhere(broken, "is not an MLflow store", release_adapters)


def test_a_new_empty_store_is_still_initialised(tmp_path):
    """What stays: a project's first command initialises a store nobody created (no marker)."""
    cfg = new_project(tmp_path, store=False)
    (cfg.state_dir).mkdir(parents=True, exist_ok=True)
    (cfg.state_dir / "mlflow.db").write_bytes(b"")  # e.g. `touch`ed by a provisioning script
    registry.experiment_id(cfg)
    assert store.initialised(cfg)


# -- PostgreSQL ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pg():
    if pg_bin() is None:
        pytest.skip(
            "PostgreSQL server binaries (initdb, pg_ctl) not installed: run `bash scripts/ci_deps.sh`"
        )
    server = Postgres()
    try:
        server.start()
    except Exception as e:
        server.stop()
        pytest.fail(f"PostgreSQL is installed but did not start: {e}")
    yield server
    server.stop()


def _psql(server, sql: str, db: str = "mlflow") -> None:
    import psycopg2

    conn = psycopg2.connect(host="127.0.0.1", port=server.port, user="postgres", dbname=db)
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute(sql)
    conn.close()


@pytest.fixture(scope="module")
def pg_project(pg, tmp_path_factory, release_adapters):
    """A project on a plain `postgresql://` URI (the issue's form), agent v1..v2 registered, v1 published;
    a role `reader` that may only SELECT, and a role `rosession` whose sessions are read-only."""
    from pipeline.release.publish import publish

    uri = f"postgresql://postgres@127.0.0.1:{pg.port}/mlflow"
    cfg = new_project(tmp_path_factory.mktemp("pg"), store=False, registry={"tracking_uri": uri})
    register_versions(cfg, "agent", release_adapters[:2], 3)
    publish(cfg, "agent", version=1)
    _psql(pg, "CREATE ROLE reader LOGIN; GRANT SELECT ON ALL TABLES IN SCHEMA public TO reader")
    _psql(
        pg,
        "CREATE ROLE rosession LOGIN; GRANT ALL ON ALL TABLES IN SCHEMA public TO rosession; "
        "GRANT ALL ON ALL SEQUENCES IN SCHEMA public TO rosession; "
        "ALTER ROLE rosession SET default_transaction_read_only = on",
    )
    return cfg, uri


def test_plain_postgresql_uri_works(pg_project):
    """Issue 40 kind 5: `postgresql://` gave `ModuleNotFoundError: No module named 'psycopg'`, exit 1, on
    status, publish and register (SQLAlchemy 2.1's default driver is psycopg 3; the project ships psycopg2)."""
    cfg, uri = pg_project
    r = _cli(cfg, "status", "agent", "--no-fleet")
    assert r.exit_code == 0 and "agent" in r.output, r.output
    assert registry.aliases(cfg, "agent")["production"] == 1


@pytest.mark.parametrize(
    "form,expect",
    [
        ("postgresql+psycopg", "`.venv/bin/pip install 'psycopg[binary]'`"),
        ("mysql", "`.venv/bin/pip install 'mysqlclient'`"),
        ("mysql+pymysql", "`.venv/bin/pip install 'PyMySQL'`"),
    ],
)
def test_a_missing_driver_is_named_with_the_package(pg_project, form, expect):
    """Siblings: a URI whose driver is not installed: the package to install, exit 2, within a second."""
    cfg, uri = pg_project
    t0 = time.monotonic()
    r = _cli(
        cfg,
        "publish",
        "agent",
        "--version",
        "2",
        env={"MLFLOW_TRACKING_URI": form + uri[len("postgresql") :]},
    )
    assert r.exit_code == 2 and expect in r.output and "Traceback" not in r.output, r.output
    assert time.monotonic() - t0 < 10


def test_wrong_password_and_unknown_database_fail_fast_and_clearly(pg_project, pg):
    """Sibling: the server refuses the login: named, within registry.connect_timeout_s plus a margin."""
    cfg, uri = pg_project
    _psql(pg, "DO $$ BEGIN CREATE ROLE secretive LOGIN PASSWORD 'right'; EXCEPTION WHEN others THEN END $$")
    for bad in (
        uri.replace("/mlflow", "/nosuchdb"),
        f"postgresql://nosuchuser@127.0.0.1:{pg.port}/mlflow",
    ):
        store._checked.clear()
        t0 = time.monotonic()
        r = _cli(cfg, "status", env={"MLFLOW_TRACKING_URI": bad})
        took = time.monotonic() - t0
        assert r.exit_code == 2 and "refused the connection" in r.output and "Traceback" not in r.output, (
            r.output
        )
        assert took < cfg.registry.connect_timeout_s + 10, took


def test_a_postgres_server_that_never_answers_fails_within_the_timeout(tmp_path):
    """Sibling: the port accepts (the kernel's handshake) and nothing answers: libpq's connect_timeout,
    not MLflow's engine retries."""
    import socket

    cfg = new_project(tmp_path, registry={"connect_timeout_s": 2})
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(8)
        uri = f"postgresql://u:secret@127.0.0.1:{srv.getsockname()[1]}/mlflow"
        t0 = time.monotonic()
        r = _cli(cfg, "publish", "agent", "--version", "1", env={"MLFLOW_TRACKING_URI": uri})
        took = time.monotonic() - t0
    assert r.exit_code == 2 and "refused the connection" in r.output and "Traceback" not in r.output, r.output
    assert "secret" not in r.output  # the password is redacted
    assert took < 2 + 10, took
    assert not cfg.volume.path.exists() or not list(cfg.volume.path.glob("agent-v*"))


def _volume(cfg):
    vol = cfg.volume.path
    return sorted(p.name for p in vol.glob("agent-v*")), (vol / "fleet-state.json").read_bytes()


@pytest.mark.parametrize("role", ["reader", "rosession"])
@pytest.mark.parametrize(
    "args",
    [
        ["publish", "agent", "--version", "2"],  # the instance
        ["promote", "agent", "3"],
        ["rollback", "agent"],
        ["fleet", "prune", "agent", "--keep", "1"],
        ["run", str(REPO / "axolotl_configs" / "tiny-cpu.yml"), "--name", "agent"],  # before training
    ],
)
def test_a_role_that_cannot_write_is_refused_before_anything_changes(pg_project, role, args):
    """Issue 40 kind 4: with a read-only PostgreSQL role, `publish` wrote the version directory and
    fleet-state.json before its first registry write failed ("permission denied"). Siblings: the
    other commands that move the volume, and a role whose sessions are read-only."""
    cfg, uri = pg_project
    before = _volume(cfg)
    env = {"MLFLOW_TRACKING_URI": uri.replace("postgres@", f"{role}@")}
    r = _cli(cfg, *args, env=env)
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    assert ("cannot be written by role" in r.output) or ("are read-only" in r.output), r.output
    assert _volume(cfg) == before  # nothing changed
    store._checked.clear()
    assert _cli(cfg, "status", "agent", "--no-fleet", env=env).exit_code == 0  # reading still works


def test_register_with_a_read_only_role_registers_nothing(pg_project, release_adapters):
    cfg, uri = pg_project
    from pipeline.config import load_config

    os.environ["MLFLOW_TRACKING_URI"] = uri.replace("postgres@", "reader@")
    try:
        ro = load_config(cfg.source)
        with pytest.raises(StoreError, match="cannot be written by role 'reader'"):
            register_versions(ro, "agent", release_adapters[:1], 1)
    finally:
        del os.environ["MLFLOW_TRACKING_URI"]
    store._checked.clear()
    assert sorted(int(v.version) for v in registry.versions(cfg, "agent")) == [1, 2, 3]


def test_a_dropped_postgres_schema_is_refused_not_recreated(pg_project, pg):
    """Kind 1 on PostgreSQL: the project's database emptied (schema dropped, restored from an empty dump):
    every door refuses it; MLflow would have created its tables again and numbered from v1."""
    cfg, uri = pg_project
    _psql(pg, "ALTER SCHEMA public RENAME TO saved; CREATE SCHEMA public")
    try:
        for args in (["status", "--no-fleet"], ["publish", "agent", "--version", "2"], ["rollback", "agent"]):
            store._checked.clear()
            r = _cli(cfg, *args)
            assert r.exit_code == 2 and "is empty (no tables), but this project created" in r.output, r.output
        _psql(pg, "SELECT count(*) FROM pg_tables WHERE schemaname = 'public'")
    finally:  # put the project's tables back for the other tests
        _psql(pg, "DROP SCHEMA public CASCADE; ALTER SCHEMA saved RENAME TO public")
        forget_mlflow_engines()


def test_a_wiped_state_directory_is_not_a_new_registry_while_versions_are_published(
    tmp_path, release_adapters
):
    """Issue 40 kind 1, the marker gone with the store (the whole `.state` wiped): the versions on the volume
    still say a registry numbered them, so `register` would create v1 again beside them. It is refused
    (exit 2, nothing created) until the operator starts anew on purpose (`PIPELINE_NEW_REGISTRY=1`)."""
    import shutil

    from pipeline.release.publish import publish

    cfg = new_project(tmp_path)
    register_versions(cfg, "agent", release_adapters[:1], 1)
    publish(cfg, "agent", version=1)
    shutil.rmtree(cfg.state_dir)
    store._checked.clear()
    forget_mlflow_engines()
    r = _cli(cfg, "register", release_adapters[1][0], "--name", "agent")
    assert r.exit_code == 2, r.output
    assert "agent v1" in r.output and "PIPELINE_NEW_REGISTRY=1" in r.output
    assert not (cfg.state_dir / "mlflow.db").exists()
    r = _cli(cfg, "status", "--no-fleet")  # a reader says so too, and creates nothing
    assert r.exit_code == 2 and not (cfg.state_dir / "mlflow.db").exists(), r.output
