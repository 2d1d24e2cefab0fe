"""Every command that recovers transactions finishes the record a killed one left, or says why not and what
to run (issue 40, kind 6): `follow-alias` and `fleet sync` too, whose own checks see nothing to do when the
desired state already matches `production`.

Real sqlite MLflow and a real volume, no fleet; crashes injected at `transaction.checkpoint`s.
"""

from __future__ import annotations

import logging
import uuid

import pytest
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.errors import StoreError
from pipeline.jobs.follow import follow_alias
from pipeline.release.publish import publish
from pipeline.release.rollback import rollback
from pipeline.release.transaction import intent_path
from tests.support import release_support
from tests.support.release_support import Killed, crash_at, hooked, new_project, register_versions, snapshot

release_adapters = release_support.release_adapters


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    return new_project(tmp_path_factory.mktemp("doors"))


@pytest.fixture
def name():
    return f"door-{uuid.uuid4().hex[:6]}"


def _cli(cfg, *args):
    return CliRunner().invoke(app, [str(a) for a in args], env={"PIPELINE_CONFIG": str(cfg.source)})


def _killed_publish(cfg, name, adapters, point="between-aliases"):
    """v1 then v2 published, v3's publish killed at `point`."""
    register_versions(cfg, name, adapters, 3)
    publish(cfg, name, version=1)
    publish(cfg, name, version=2)
    with crash_at(point), pytest.raises(Killed):
        publish(cfg, name, version=3)
    s = snapshot(cfg, name)
    assert s["pending"], s


def _published_events(cfg, name, v):
    from pipeline import registry

    mv = registry.client(cfg).get_model_version(name, str(v))
    return [e for e in registry.events(mv) if e["type"] == "publish"]


def test_follow_alias_once_completes_a_publish_killed_between_the_alias_writes(
    cfg, release_adapters, name, caplog
):
    """Issue 40: `follow-alias --once` said "published 0 version(s)", exit 0, and left `previous`, the
    event and the record wrong, at any number of polls (desired state and `production` agreed)."""
    _killed_publish(cfg, name, release_adapters)
    with caplog.at_level(logging.WARNING, logger="pipeline.jobs.follow"):
        assert follow_alias(cfg, "production", 1, once=True, names=[name]) == []
    assert "completed an interrupted publish" in caplog.text
    s = snapshot(cfg, name)
    assert (s["production"], s["previous"], s["desired"], s["pending"]) == (3, 2, 3, False), s
    assert len(_published_events(cfg, name, 3)) == 1
    assert rollback(cfg, name)[:2] == (3, 2)  # back one, as the repaired `previous` says


def test_follow_alias_cli_says_what_it_recovered(cfg, release_adapters, name):
    _killed_publish(cfg, name, release_adapters, point="after-state")
    r = _cli(cfg, "follow-alias", "--once", "--name", name)
    assert r.exit_code == 0 and "completed an interrupted publish" in r.output, r.output
    assert not snapshot(cfg, name)["pending"]


def test_fleet_sync_completes_a_killed_rollback(cfg, release_adapters, name):
    """Sibling: a rollback killed between its alias writes; `fleet sync` (no registry read of its own)
    saw nothing to do."""
    register_versions(cfg, name, release_adapters, 2)
    publish(cfg, name, version=1)
    publish(cfg, name, version=2)
    with crash_at("between-aliases"), pytest.raises(Killed):
        rollback(cfg, name)
    r = _cli(cfg, "fleet", "sync")  # exit 2 only because this project has no fleet.instances
    assert "completed an interrupted rollback" in r.output and "no fleet instances" in r.output, r.output
    s = snapshot(cfg, name)
    assert (s["production"], s["previous"], s["desired"], s["pending"]) == (1, 2, 1, False), s


def test_a_recovery_that_cannot_finish_says_why_and_the_way_out(cfg, release_adapters, name):
    """Sibling: the registry fails during the recovery. Not silent, not exit 0: the error names the record,
    that the next command finishes it, and how to give it up."""
    _killed_publish(cfg, name, release_adapters, point="after-volume")

    def registry_down(point: str) -> None:
        if point == "after-state":
            raise StoreError("the MLflow store is gone for a moment")

    rec = intent_path(cfg.volume.path, name)
    with hooked(registry_down):
        with pytest.raises(StoreError) as e:
            follow_alias(cfg, "production", 1, once=True, names=[name])
        assert "could not be completed or undone" in str(e.value) and f"delete {rec}" in str(e.value)
        r = _cli(cfg, "fleet", "sync")
        assert r.exit_code == 2 and f"delete {rec}" in r.output and "Traceback" not in r.output, r.output
        with pytest.raises(StoreError, match="fleet sync of"):  # publish names the way out too
            publish(cfg, name, version=3)
    assert rec.exists()
    assert follow_alias(cfg, "production", 1, once=True, names=[name]) == []  # the store is back: done
    s = snapshot(cfg, name)
    assert (s["production"], s["previous"], s["pending"]) == (3, 2, False), s
