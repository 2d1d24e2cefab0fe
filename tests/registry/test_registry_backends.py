"""Concurrent registration from separate processes, on a fresh sqlite store and on PostgreSQL.

PostgreSQL is a real server from the Debian packages (`initdb`/`pg_ctl`, as the `postgres`
user when running as root) on 127.0.0.1; the test skips, saying why, when it is not installed
(`bash scripts/ci_deps.sh` installs it).
"""

from __future__ import annotations

import json
import os
import re
import sys

import pytest

from pipeline import registry
from tests.support.helpers import write_project_config
from tests.support.registry_support import Postgres, pg_bin, run_parallel, two_adapters

two_adapters = two_adapters  # session fixture from tests/support/registry_support.py

N_PROCS = 4


# One registration per process: `registry.register_adapter`, the library call behind
# `pipeline register` (whose validation step imports torch: ~12 s CPU per process here, which
# would only slow the race down, so the report is computed once in the test).
REGISTER = """
import json, sys
from pathlib import Path
from pipeline import registry
from pipeline.config import load_config
reg = registry.register_adapter(load_config(), Path(sys.argv[1]), sys.argv[2], json.loads(Path(sys.argv[3]).read_text()))
print(f"registered {reg.name} version {reg.version}")
"""


def _register_concurrently(cfg, adapters, base, name: str, tmp_path) -> list[int]:
    """`register_adapter` x4 in separate processes started together; returns the versions."""
    from pipeline.validate import validate_adapter

    reports = []
    for i, a in enumerate(adapters):
        rp = tmp_path / f"report{i}.json"
        rp.write_text(json.dumps(validate_adapter(a, base).to_dict()))
        reports.append(rp)
    env = dict(os.environ, PIPELINE_CONFIG=str(cfg.source))
    env.pop("MLFLOW_TRACKING_URI", None)
    cmds = [
        [sys.executable, "-c", REGISTER, str(adapters[i % 2]), name, str(reports[i % 2])]
        for i in range(N_PROCS)
    ]
    results = run_parallel(cmds, env)
    for r in results:
        assert r.returncode == 0, r.stdout[-3000:]
    return sorted(int(re.search(r"registered \S+ version (\d+)", r.stdout)[1]) for r in results)


def _flow(cfg, adapters, base, name: str, tmp_path) -> None:
    """Concurrent registration, then publish / promote / rollback / follow against `cfg`'s store."""
    from pipeline.jobs.follow import follow_alias
    from pipeline.release.publish import publish

    assert _register_concurrently(cfg, adapters, base, name, tmp_path) == list(range(1, N_PROCS + 1))
    client = registry.client(cfg)
    versions = sorted(int(v.version) for v in client.search_model_versions(f"name='{name}'"))
    assert versions == list(range(1, N_PROCS + 1))  # contiguous, nothing lost
    assert registry.aliases(cfg, name)["candidate"] in versions

    publish(cfg, name, version=1)
    publish(cfg, name, version=2)
    assert registry.aliases(cfg, name)["production"] == 2 and registry.aliases(cfg, name)["previous"] == 1
    assert registry.rollback_aliases(cfg, name) == (2, 1)
    client.set_registered_model_alias(name, "production", "3")
    shipped = follow_alias(cfg, "production", 1, once=True, names=[name])
    assert [p.version for p in shipped] == [3]
    al = registry.aliases(cfg, name)
    assert (al["production"], al["previous"]) == (3, 1)
    mv = client.get_model_version(name, "3")
    assert mv.tags["published.path"] == str(cfg.volume.path / f"{name}-v3")
    assert [e["type"] for e in registry.events(mv)] == ["publish"]
    # `pipeline status` reads the same rows without the MLflow client (sqlite3 / SQLAlchemy)
    from pipeline.registry.read import backend, read_mlflow, read_models

    assert backend(cfg) == ("sql" if cfg.tracking_uri.startswith("postgresql") else "sqlite")
    fast, slow = read_models(cfg, [name]), read_mlflow(cfg, [name])
    assert [(m.name, m.aliases) for m in fast] == [(m.name, m.aliases) for m in slow]
    assert [(v.version, v.run_id, v.tags) for v in fast[0].versions] == [
        (v.version, v.run_id, v.tags) for v in slow[0].versions
    ]


@pytest.mark.slow
def test_concurrent_register_on_a_fresh_sqlite_store(tmp_path, two_adapters, tiny_base):
    """Four processes race on a store nobody initialised: the init lock + retries keep it whole."""
    from pipeline.config import load_config

    cfg = load_config(write_project_config(tmp_path))
    _flow(cfg, two_adapters, tiny_base, "conc-sqlite", tmp_path)


@pytest.fixture(scope="module")
def postgres_uri():
    if pg_bin() is None:
        pytest.skip(
            "PostgreSQL server binaries (initdb, pg_ctl) not installed: run `bash scripts/ci_deps.sh`"
        )
    try:
        import psycopg2  # noqa: F401
    except ImportError:
        pytest.skip("psycopg2 not installed: pip install -e '.[dev]'")
    pg = Postgres()
    try:
        uri = pg.start()
    except Exception as e:
        pg.stop()
        pytest.fail(f"PostgreSQL is installed but did not start: {e}")
    yield uri
    pg.stop()


@pytest.mark.slow
def test_registry_flow_on_postgresql(tmp_path, postgres_uri, two_adapters, tiny_base):
    from pipeline.config import load_config

    cfg = load_config(write_project_config(tmp_path, registry={"tracking_uri": postgres_uri}))
    assert cfg.tracking_uri.startswith("postgresql")
    _flow(cfg, two_adapters, tiny_base, "conc-pg", tmp_path)
    # the data really is in PostgreSQL
    import psycopg2

    with (
        psycopg2.connect(postgres_uri.replace("postgresql+psycopg2", "postgresql")) as conn,
        conn.cursor() as cur,
    ):
        cur.execute("select count(*) from model_versions where name = %s", ("conc-pg",))
        assert cur.fetchone()[0] == N_PROCS
