"""Publish, promote and rollback are transactions: a crash at any checkpoint is completed or undone by the
next command, and concurrent commands on one adapter never interleave (issue 16 section 1).

Real sqlite MLflow and a real volume; no fleet here (tests/fleet/test_fleet_vllm.py runs the transaction against real vLLM instances, `test_txn_*`).
Crashes are injected at `pipeline.release.transaction.checkpoint`s, never by timing.
"""

from __future__ import annotations

import threading
import time
import uuid

import pytest

from pipeline import registry
from pipeline.errors import LockedError, UsageError
from pipeline.fleet.state import load_state
from pipeline.release.publish import publish
from pipeline.release.rollback import rollback
from pipeline.release.transaction import intent_path, load_intent
from tests.support import release_support
from tests.support.release_support import (
    Gate,
    Killed,
    Worker,
    crash_at,
    hooked,
    new_project,
    register_versions,
    snapshot,
)

release_adapters = release_support.release_adapters

PUBLISH_POINTS = [
    "after-intent",
    "after-copy",
    "before-rename",
    "after-volume",
    "after-fleet",
    "after-state",
    "between-aliases",
    "after-aliases",
    "after-events",
]
# one point per phase the recovery tells apart (prepared, volume, fleet done, aliases half / all written)
PHASE_POINTS = ["after-copy", "after-volume", "after-state", "between-aliases", "after-events"]
ROLLBACK_POINTS = [
    "after-intent",
    "after-state",
    "after-fleet",
    "between-aliases",
    "after-aliases",
    "after-events",
]


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    """One store and volume for the module (creating a sqlite schema costs seconds); tests use own names."""
    return new_project(tmp_path_factory.mktemp("txn"))


@pytest.fixture
def uniq():
    """A unique adapter-name suffix per test (the store is shared)."""
    return uuid.uuid4().hex[:6]


def events_of(cfg, name, version, etype):
    mv = registry.client(cfg).get_model_version(name, str(version))
    return [e for e in registry.events(mv) if e["type"] == etype]


def assert_consistent(cfg, name, production, previous):
    s = snapshot(cfg, name)
    assert s == {
        "production": production,
        "previous": previous,
        "desired": production,
        "pending": False,
        "staging": [],
    }, s


# -- the instances ---------------------------------------------------------------------------
def test_killed_between_alias_writes_rerun_repairs_previous_and_rollback_goes_back_one(
    cfg, release_adapters, uniq
):
    """Issue 16: killed between the `production` and `previous` writes, `previous` stayed wrong for good
    and `rollback` then went v7 -> v5 instead of v6."""
    N = f"killed-betwe-{uniq}"
    register_versions(cfg, N, release_adapters, 7)
    for v in (5, 6):
        publish(cfg, N, version=v)
    with crash_at("between-aliases"), pytest.raises(Killed):
        publish(cfg, N, version=7)
    s = snapshot(cfg, N)
    assert (s["production"], s["previous"], s["pending"]) == (7, 5, True)  # the broken state the crash left
    res = publish(cfg, N, version=7)  # the re-run completes the killed transaction
    assert res.previous_production == 6 and any("completed an interrupted publish" in w for w in res.warnings)
    assert_consistent(cfg, N, 7, 6)
    assert len(events_of(cfg, N, 7, "publish")) == 1  # completed once, not published twice
    assert rollback(cfg, N)[:2] == (7, 6)
    assert_consistent(cfg, N, 6, 7)


@pytest.mark.parametrize("point", PUBLISH_POINTS)
def test_publish_killed_anywhere_is_completed_by_the_rerun(cfg, release_adapters, uniq, point):
    N = f"publish-kill-{uniq}"
    register_versions(cfg, N, release_adapters, 3)
    publish(cfg, N, version=1)
    publish(cfg, N, version=2)
    with crash_at(point), pytest.raises(Killed):
        publish(cfg, N, version=3)
    res = publish(cfg, N, version=3)
    assert (res.version, res.previous_production) == (3, 2)
    assert_consistent(cfg, N, 3, 2)
    assert (cfg.volume.path / f"{N}-v3" / "manifest.json").exists()
    assert len(events_of(cfg, N, 3, "publish")) == 1
    assert load_state(cfg.volume.path).adapters[N]["history"] == [1, 2, 3]


@pytest.mark.parametrize("point", PHASE_POINTS)
def test_publish_killed_anywhere_then_rollback_lands_consistently(cfg, release_adapters, uniq, point):
    """The next command is not the same publish: a rollback undoes a publish the registry does not show
    yet, and completes one it does; either way it then rolls back from what `production` showed."""
    N = f"publish-kill-{uniq}"
    register_versions(cfg, N, release_adapters, 3)
    publish(cfg, N, version=1)
    publish(cfg, N, version=2)
    with crash_at(point), pytest.raises(Killed):
        publish(cfg, N, version=3)
    shown = registry.alias_version(cfg, N, "production")  # what the operator sees before rolling back
    res = rollback(cfg, N)
    assert res[0] == shown
    s = snapshot(cfg, N)
    assert s["production"] == s["desired"] == res[1] and not s["pending"] and s["staging"] == []
    if shown == 2:  # the publish had not moved `production`: undone, then 2 -> 1
        assert res[:2] == (2, 1) and s["previous"] == 2
        assert events_of(cfg, N, 3, "publish") == []
    else:  # it had: completed first (previous = 2), then 3 -> 2
        assert res[:2] == (3, 2) and s["previous"] == 3


@pytest.mark.parametrize("point", ROLLBACK_POINTS)
def test_rollback_killed_anywhere_is_completed_once(cfg, release_adapters, uniq, point):
    N = f"rollback-kil-{uniq}"
    register_versions(cfg, N, release_adapters, 3)
    for v in (1, 2, 3):
        publish(cfg, N, version=v)
    with crash_at(point), pytest.raises(Killed):
        rollback(cfg, N)
    res = rollback(cfg, N)  # the re-run: completes the killed rollback, does not roll back twice
    assert res[:2] == (3, 2) and res.notes
    assert_consistent(cfg, N, 2, 3)
    assert len(events_of(cfg, N, 2, "rollback")) == 1 and len(events_of(cfg, N, 3, "rolled_back")) == 1


@pytest.mark.parametrize("point", ["after-intent", "after-fleet", "between-aliases"])
def test_rollback_killed_anywhere_then_publish_completes_it_first(cfg, release_adapters, uniq, point):
    N = f"rollback-kil-{uniq}"
    register_versions(cfg, N, release_adapters, 4)
    for v in (1, 2, 3):
        publish(cfg, N, version=v)
    with crash_at(point), pytest.raises(Killed):
        rollback(cfg, N, to=1)
    res = publish(cfg, N, version=4)
    assert res.previous_production == 1  # the rollback to 1 was completed, then 4 replaced it
    assert_consistent(cfg, N, 4, 1)


def test_promote_killed_is_completed_by_promote(cfg, release_adapters, uniq):
    N = f"promote-kill-{uniq}"
    from typer.testing import CliRunner

    from pipeline.cli import app

    register_versions(cfg, N, release_adapters, 2)
    publish(cfg, N, version=1)
    env = {"PIPELINE_CONFIG": str(cfg.source)}
    with crash_at("after-state"), pytest.raises(Killed):
        CliRunner().invoke(app, ["promote", N, "2"], env=env, catch_exceptions=False)
    r = CliRunner().invoke(app, ["promote", N, "2"], env=env)
    assert r.exit_code == 0, r.output
    assert "previous: v1" in r.output and "completed an interrupted publish" in r.output
    assert_consistent(cfg, N, 2, 1)


def test_publish_killed_before_the_volume_write_is_abandoned_and_writes_nothing_else(
    cfg, release_adapters, uniq
):
    N = f"publish-kill-{uniq}"
    register_versions(cfg, N, release_adapters, 2)
    publish(cfg, N, version=1)
    before = snapshot(cfg, N)
    with crash_at("after-copy"), pytest.raises(Killed):
        publish(cfg, N, version=2)
    assert load_intent(cfg.volume.path, N).phase == "prepared"
    assert not (cfg.volume.path / f"{N}-v2").exists()
    res = publish(cfg, N, version=1)  # any later transaction on the adapter clears the record
    assert any("abandoned" in w for w in res.warnings)
    assert snapshot(cfg, N) == before


def test_a_failure_after_the_volume_leaves_a_record_the_next_command_completes(cfg, release_adapters, uniq):
    """Not a kill: the registry fails while the aliases are written. The error says that the next
    command finishes it, and it does."""
    N = f"a-failure-af-{uniq}"
    from pipeline.errors import StoreError

    register_versions(cfg, N, release_adapters, 2)
    publish(cfg, N, version=1)

    def registry_down(point: str) -> None:
        if point == "after-state":  # the next step writes the aliases
            raise StoreError("the MLflow store is gone for a moment")

    with hooked(registry_down), pytest.raises(StoreError, match=f"next publish, promote or rollback of {N}"):
        publish(cfg, N, version=2)
    assert snapshot(cfg, N)["pending"]
    rollback_res = rollback(cfg, N, to=1)  # production had not moved: the publish is undone
    assert rollback_res.notes and "undone" in rollback_res.notes[0]
    assert_consistent(cfg, N, 1, None)


def test_unreadable_intent_record_is_a_clear_error(cfg, release_adapters, uniq):
    N = f"unreadable-i-{uniq}"
    register_versions(cfg, N, release_adapters, 1)
    p = intent_path(cfg.volume.path, N)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text("{half a record")
    with pytest.raises(UsageError, match="unreadable record of an interrupted transaction"):
        publish(cfg, N, version=1)


# -- concurrency ------------------------------------------------------------------------------------
def test_two_concurrent_publishes_keep_the_alias_chain(cfg, release_adapters, uniq):
    """Issue 16: two publishes at once (one delayed at its first registry write) both printed
    `v15 -> vN (previous = v15)`; v16 fell out of the chain. The adapter lock serialises them."""
    N = f"two-concurre-{uniq}"
    register_versions(cfg, N, release_adapters, 3)
    publish(cfg, N, version=1)
    gate = Gate("after-intent", "A")
    with hooked(gate):
        a = Worker("A", lambda: publish(cfg, N, version=2))
        a.start()
        assert gate.reached.wait(60)
        b = Worker("B", lambda: publish(cfg, N, version=3))
        b.start()
        time.sleep(1.5)
        assert b.is_alive() and b.result is None  # waits for A's lock, has read nothing
        gate.release()
        a.join(120)
        b.join(120)
    assert a.error is None and b.error is None, (a.error, b.error)
    assert (a.result.previous_production, b.result.previous_production) == (1, 2)
    assert_consistent(cfg, N, 3, 2)
    assert load_state(cfg.volume.path).adapters[N]["history"] == [1, 2, 3]


def test_two_concurrent_publishes_of_one_version(cfg, release_adapters, uniq):
    N = f"two-concurre-{uniq}"
    register_versions(cfg, N, release_adapters, 2)
    publish(cfg, N, version=1)
    ws = [Worker(n, lambda: publish(cfg, N, version=2)) for n in ("A", "B")]
    for w in ws:
        w.start()
    for w in ws:
        w.join(120)
    assert [w.error for w in ws] == [None, None]
    assert sorted(w.result.created for w in ws) == [False, True]
    assert_consistent(cfg, N, 2, 1)


def test_two_concurrent_rollbacks_go_back_one_version(cfg, release_adapters, uniq):
    N = f"two-concurre-{uniq}"
    register_versions(cfg, N, release_adapters, 3)
    for v in (1, 2, 3):
        publish(cfg, N, version=v)
    gate = Gate("after-intent", "A")
    with hooked(gate):
        a = Worker("A", lambda: rollback(cfg, N))
        a.start()
        assert gate.reached.wait(60)
        b = Worker("B", lambda: rollback(cfg, N))
        b.start()
        time.sleep(1.5)
        gate.release()
        a.join(120)
        b.join(120)
    assert a.error is None and a.result[:2] == (3, 2)
    assert isinstance(b.error, LockedError) and "moved from v3 to v2" in str(b.error)
    assert_consistent(cfg, N, 2, 3)  # not toggled back to 3


def test_publish_and_rollback_at_once_serialise(cfg, release_adapters, uniq):
    N = f"publish-and-{uniq}"
    register_versions(cfg, N, release_adapters, 3)
    publish(cfg, N, version=1)
    publish(cfg, N, version=2)
    gate = Gate("after-state", "A")
    with hooked(gate):
        a = Worker("A", lambda: publish(cfg, N, version=3))
        a.start()
        assert gate.reached.wait(60)
        b = Worker("B", lambda: rollback(cfg, N, to=1))
        b.start()
        time.sleep(1.5)
        assert b.is_alive()
        gate.release()
        a.join(120)
        b.join(120)
    assert a.error is None and b.error is None, (a.error, b.error)
    assert b.result[:2] == (3, 1)
    assert_consistent(cfg, N, 1, 3)


def test_aliases_and_desired_state_move_inside_the_fleet_lock(cfg, release_adapters, uniq):
    """Issue 16: the alias moved outside the fleet lock, so a `fleet sync` between them saw the
    desired state and `production` disagree. From the rollout to the last alias write, the fleet
    lock is held: another fleet operation is refused there."""
    N = f"aliases-and-{uniq}"
    from pipeline.fleet.state import fleet_lock

    register_versions(cfg, N, release_adapters, 1)
    seen: dict[str, bool] = {}

    def probe(point: str) -> None:
        if point not in ("after-volume", "after-state", "between-aliases", "after-aliases"):
            return
        out: list[bool] = []

        def other():
            try:
                with fleet_lock(cfg.volume.path, 0.1):
                    out.append(False)
            except LockedError:
                out.append(True)

        t = threading.Thread(target=other)
        t.start()
        t.join()
        seen[point] = out[0]

    with hooked(probe):
        publish(cfg, N, version=1)
    assert seen == {
        "after-volume": False,
        "after-state": True,
        "between-aliases": True,
        "after-aliases": True,
    }


def test_a_rollback_waiting_for_a_publish_does_not_use_stale_aliases(cfg, release_adapters, uniq):
    N = f"a-rollback-w-{uniq}"
    register_versions(cfg, N, release_adapters, 3)
    publish(cfg, N, version=1)
    publish(cfg, N, version=2)
    gate = Gate("after-volume", "A")
    with hooked(gate):
        a = Worker("A", lambda: publish(cfg, N, version=3))
        a.start()
        assert gate.reached.wait(60)
        b = Worker("B", lambda: rollback(cfg, N))
        b.start()
        time.sleep(1.0)
        gate.release()
        a.join(120)
        b.join(120)
    assert a.error is None
    assert isinstance(b.error, LockedError)  # production moved 2 -> 3 while it waited: refused
    assert_consistent(cfg, N, 3, 2)
