"""One source of truth for what each adapter should serve: `production`, with fleet-state.json derived from
it in the same transaction; `fleet status` reports drift loudly (issue 17 item 1)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from pipeline import registry
from pipeline.cli import app
from pipeline.fleet.state import load_state, save_state
from pipeline.release.publish import publish
from tests.support import release_support
from tests.support.release_support import new_project, register_versions

release_adapters = release_support.release_adapters


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    return new_project(tmp_path_factory.mktemp("desired"))


def cli(cfg, *args):
    return CliRunner().invoke(app, [str(a) for a in args], env={"PIPELINE_CONFIG": str(cfg.source)})


def desired(cfg, name):
    return load_state(cfg.volume.path).version(name)


def drift_rows(cfg, name):
    r = cli(cfg, "fleet", "status", "--json")
    rows = [x for x in json.loads(r.stdout[r.stdout.index("[") :]) if x["adapter"] == name]
    return r.exit_code, [x for x in rows if x["state"] == "drift"]


def test_rollback_then_publish_without_a_fleet_keeps_state_equal_to_the_alias(cfg, release_adapters):
    """Issue 17: with no fleet, `rollback --to 5 && publish --version 7` left fleet-state.json at 5 while
    `production` was 7; `fleet status` then reported the wrong desired version."""
    register_versions(cfg, "agent-tools", release_adapters, 7)
    for v in (5, 6, 7):
        assert cli(cfg, "publish", "agent-tools", "--version", v).exit_code == 0
    r = cli(cfg, "rollback", "agent-tools", "--to", "5")
    assert r.exit_code == 0, r.output
    assert desired(cfg, "agent-tools") == registry.alias_version(cfg, "agent-tools", "production") == 5
    r = cli(cfg, "publish", "agent-tools", "--version", "7")
    assert r.exit_code == 0, r.output
    assert desired(cfg, "agent-tools") == registry.alias_version(cfg, "agent-tools", "production") == 7
    assert registry.alias_version(cfg, "agent-tools", "previous") == 5
    code, rows = drift_rows(cfg, "agent-tools")
    assert (code, rows) == (0, [])
    # promote and rollback without --to keep them equal too
    assert cli(cfg, "promote", "agent-tools", "6").exit_code == 0
    assert desired(cfg, "agent-tools") == registry.alias_version(cfg, "agent-tools", "production") == 6
    assert cli(cfg, "rollback", "agent-tools").exit_code == 0
    assert desired(cfg, "agent-tools") == registry.alias_version(cfg, "agent-tools", "production") == 7


def test_alias_moved_in_the_registry_is_drift_until_the_follower_ships_it(cfg, release_adapters):
    register_versions(cfg, "moved", release_adapters, 3)
    publish(cfg, "moved", version=1)
    publish(cfg, "moved", version=2)
    registry.client(cfg).set_registered_model_alias("moved", "production", "3")  # as in the MLflow UI
    code, rows = drift_rows(cfg, "moved")
    assert code == 4 and len(rows) == 1
    assert rows[0]["desired"] == 2 and rows[0]["serving"] == "production=v3"
    assert "pipeline publish moved --version 3" in rows[0]["detail"]
    r = cli(cfg, "fleet", "sync", "--follow-alias", "production")
    assert r.exit_code == 0, r.output
    assert desired(cfg, "moved") == 3 and registry.alias_version(cfg, "moved", "previous") == 2
    assert drift_rows(cfg, "moved") == (0, [])


def test_state_written_by_an_older_pipeline_is_reported_then_repaired(cfg, release_adapters):
    """A volume whose fleet-state.json lags the alias (written before this fix) is drift; the next
    publish of the adapter writes both."""
    register_versions(cfg, "legacy", release_adapters, 3)
    publish(cfg, "legacy", version=3)
    st = load_state(cfg.volume.path)
    st.set("legacy", 1)
    save_state(cfg.volume.path, st)
    code, rows = drift_rows(cfg, "legacy")
    assert code == 4 and "desires v1" in rows[0]["detail"]
    publish(cfg, "legacy", version=3)
    assert desired(cfg, "legacy") == 3 and drift_rows(cfg, "legacy") == (0, [])


def test_desired_state_without_an_alias_and_unfinished_transactions_are_drift(cfg, release_adapters):
    st = load_state(cfg.volume.path)
    st.set("orphan", 4)
    save_state(cfg.volume.path, st)
    code, rows = drift_rows(cfg, "orphan")
    assert code == 4 and "no version has the `production` alias" in rows[0]["detail"]
    st = load_state(cfg.volume.path)
    st.adapters.pop("orphan")
    save_state(cfg.volume.path, st)

    from tests.support.release_support import Killed, crash_at

    register_versions(cfg, "halfway", release_adapters, 1)
    with crash_at("after-volume"), pytest.raises(Killed):
        publish(cfg, "halfway", version=1)
    code, rows = drift_rows(cfg, "halfway")
    assert code == 4 and any("interrupted publish of halfway v1" in r["detail"] for r in rows)


def test_prune_protects_the_production_version_even_when_the_state_lags(cfg, release_adapters):
    from pipeline.release.prune import prune

    register_versions(cfg, "keep", release_adapters, 3)
    for v in (1, 2, 3):
        publish(cfg, "keep", version=v)
    registry.client(cfg).set_registered_model_alias("keep", "production", "1")  # moved, not yet shipped
    removed = prune(cfg, "keep", keep=1)
    assert [p.name for p in removed] == ["keep-v2"]
    assert (cfg.volume.path / "keep-v1").is_dir() and (cfg.volume.path / "keep-v3").is_dir()


def test_follower_leaves_an_alias_moved_during_its_publish_and_ships_it_next(cfg, release_adapters):
    """The follower ships v2 (moved in the UI); while it publishes, someone moves `production` to v3:
    the publish does not clobber that move (it is inside the transaction now, not after it)."""
    from pipeline.jobs.follow import follow_alias
    from tests.support.release_support import Gate, Worker, hooked

    register_versions(cfg, "ui-moves", release_adapters, 3)
    publish(cfg, "ui-moves", version=1)
    client = registry.client(cfg)
    client.set_registered_model_alias("ui-moves", "production", "2")
    gate = Gate("after-volume", "F")
    with hooked(gate):
        f = Worker(
            "F",
            lambda: follow_alias(cfg, "production", 1, once=True, names=["ui-moves"]),
        )
        f.start()
        assert gate.reached.wait(60)
        client.set_registered_model_alias("ui-moves", "production", "3")  # moved again meanwhile
        gate.release()
        f.join(120)
    assert f.error is None, f.error
    assert [p.version for p in f.result] == [2]
    assert registry.alias_version(cfg, "ui-moves", "production") == 3  # the user's move stands
    assert desired(cfg, "ui-moves") == 2 and registry.alias_version(cfg, "ui-moves", "previous") == 1
    assert [p.version for p in follow_alias(cfg, "production", 1, once=True, names=["ui-moves"])] == [3]
    assert desired(cfg, "ui-moves") == 3 and registry.alias_version(cfg, "ui-moves", "previous") == 2
