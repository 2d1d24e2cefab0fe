"""Kills that leave something half-done (issue 30 kind 7): every destructive or multi-step command is a
transaction (intent, work, record), and a recovery never undoes the operator's latest intent.

Real sqlite MLflow and a real volume; crashes are injected in-process at the transaction's
checkpoints (`tests.support.release_support.crash_at`), as in tests/release/test_transaction.py.
"""

from __future__ import annotations

import sys
import uuid

import pytest

from pipeline import registry
from pipeline.fleet.state import load_state
from pipeline.jobs.follow import follow_alias
from pipeline.release.desired import volume_rows
from pipeline.release.prune import prune
from pipeline.release.publish import publish
from pipeline.release.rollback import rollback
from pipeline.release.transaction import intent_path, load_intent
from tests.support import release_support
from tests.support.helpers import log_messages
from tests.support.release_support import Killed, crash_at, new_project, register_versions, snapshot

release_adapters = release_support.release_adapters


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    return new_project(tmp_path_factory.mktemp("kills"))


@pytest.fixture
def name():
    return f"k-{uuid.uuid4().hex[:6]}"


def _versions_on_volume(cfg, n):
    return sorted(int(p.name.rsplit("-v", 1)[1]) for p in cfg.volume.path.glob(f"{n}-v*"))


def _rows(cfg, n):
    return [(r.state, r.detail) for r in volume_rows(cfg, [n])]


def test_prune_killed_mid_delete_leaves_no_version_without_its_weights(cfg, release_adapters, name):
    """The issue's instance: a prune killed mid-delete left a version directory without its weights,
    and `fleet status` reported OK. Now a version goes in one rename, the record says what is left,
    `fleet status` reports the unfinished prune, and the next command on the adapter finishes it."""
    register_versions(cfg, name, release_adapters, 4)
    for v in (1, 2, 3, 4):
        publish(cfg, name, version=v)
    with crash_at("prune-moved"), pytest.raises(Killed):
        prune(cfg, name, keep=1)
    left = _versions_on_volume(cfg, name)
    assert left in ([1, 2, 4], [2, 3, 4], [1, 3, 4])  # one version moved out whole, two still whole
    assert all((cfg.volume.path / f"{name}-v{v}" / "adapter_model.safetensors").is_file() for v in left)
    assert load_intent(cfg.volume.path, name).op == "prune"
    assert any(s == "drift" and "interrupted prune" in d for s, d in _rows(cfg, name))  # not OK
    res = publish(cfg, name, version=4)  # any next transaction on the adapter finishes it
    assert any("finished an interrupted prune" in w for w in res.warnings)
    assert _versions_on_volume(cfg, name) == [4] and not intent_path(cfg.volume.path, name).exists()
    assert snapshot(cfg, name)["staging"] == [] and _rows(cfg, name) == []


@pytest.mark.parametrize("how", ["alias moved", "rollback --to"])
def test_recovered_prune_keeps_what_the_operator_wants_now(cfg, release_adapters, name, how):
    """Sibling: after the killed prune the operator wants one of its versions again (moved `production`
    back in the UI, or `rollback --to` it): finishing the prune must not delete that version."""
    register_versions(cfg, name, release_adapters, 3)
    for v in (1, 2, 3):
        publish(cfg, name, version=v)
    with crash_at("after-intent"), pytest.raises(Killed):
        prune(cfg, name, keep=1)
    if how == "alias moved":
        registry.client(cfg).set_registered_model_alias(name, "production", "1")
        res = publish(cfg, name, version=1)
        assert any("kept v1" in w for w in res.warnings), res.warnings
    else:
        assert rollback(cfg, name, to=1)[:2] == (3, 1)
    assert _versions_on_volume(cfg, name) == [1, 3]  # v2 pruned; v1 kept: it is wanted now
    assert load_state(cfg.volume.path).version(name) == 1


def test_pruned_versions_are_no_longer_called_published(cfg, release_adapters, name):
    """Sibling (a state the next command does not report): after `fleet prune` the registry still said
    "PUBLISHED to <volume>/NAME-v1" (status's PUBLISHED column, the UI's headline) of a directory that
    was gone. A prune (and a killed prune finished later) records a `pruned` event once per version;
    publishing the version again makes it published again."""
    from pipeline.release.status import collect

    register_versions(cfg, name, release_adapters, 3)
    for v in (1, 2, 3):
        publish(cfg, name, version=v)
    with crash_at("prune-moved"), pytest.raises(Killed):
        prune(cfg, name, keep=1)
    publish(cfg, name, version=3)  # finishes the prune

    def published():
        (model,) = collect(cfg, name, fleet=False)["models"]
        return {v["version"]: v["published_path"] for v in model["versions"]}

    assert published() == {3: str(cfg.volume.path / f"{name}-v3"), 2: None, 1: None}
    client = registry.client(cfg)
    for v in (1, 2):
        mv = client.get_model_version(name, str(v))
        assert mv.description.startswith("PRUNED from the volume"), mv.description
        assert [e["type"] for e in registry.events(mv)].count("pruned") == 1
    publish(cfg, name, version=1)
    assert published()[1] == str(cfg.volume.path / f"{name}-v1")
    assert client.get_model_version(name, "1").description.startswith("PUBLISHED to ")


def test_an_incomplete_version_directory_is_not_ok(cfg, release_adapters, name):
    """Sibling: a version directory that lost a file some other way (not desired, so never hashed):
    `fleet status` said nothing; a rollback to it would fail at the worst moment."""
    register_versions(cfg, name, release_adapters, 2)
    for v in (1, 2):
        publish(cfg, name, version=v)
    d = cfg.volume.path / f"{name}-v1"
    d.chmod(0o755)
    (d / "adapter_model.safetensors").unlink()
    rows = _rows(cfg, name)
    assert [s for s, _ in rows] == ["corrupt"], rows and "adapter_model.safetensors: missing" in rows[0][1]


def test_publish_killed_between_its_event_and_summary_tags_gets_its_path(
    cfg, release_adapters, name, monkeypatch
):
    """The issue's instance: killed between the event tag and the summary tags, the re-run found the
    event (same transaction) and stopped: `published.path` never came, `status` showed no path."""
    ev = sys.modules["pipeline.registry.events"]  # the package's `events` attribute is the function

    register_versions(cfg, name, release_adapters, 2)
    publish(cfg, name, version=1)
    real = ev._append

    def killed_after_event(client, n, v, event, *a):
        real(client, n, v, event, *a)
        if n == name:
            raise Killed("after the event")

    # as an older pipeline wrote it: the event first, then the summary tags (killed in between)
    monkeypatch.setattr(ev, "_set_summary", lambda *a, **k: None)
    monkeypatch.setattr(ev, "_append", killed_after_event)
    with pytest.raises(Killed):
        publish(cfg, name, version=2)
    monkeypatch.undo()
    mv = registry.client(cfg).get_model_version(name, "2")
    assert "published.path" not in mv.tags and [e["type"] for e in registry.events(mv)] == ["publish"]
    publish(cfg, name, version=2)  # completes the killed transaction
    mv = registry.client(cfg).get_model_version(name, "2")
    assert mv.tags["published.path"] == str(cfg.volume.path / f"{name}-v2")
    assert [e["type"] for e in registry.events(mv)] == ["publish"]  # recorded once


def test_summary_tags_are_written_before_the_event(cfg, release_adapters, name, monkeypatch):
    """Sibling: the order itself: killed right after the summary tags, the re-run records the event."""
    ev = sys.modules["pipeline.registry.events"]

    register_versions(cfg, name, release_adapters, 1)
    real = ev._append

    def killed_at_event(client, n, v, event, *a):
        if n == name:
            raise Killed("before the event")
        real(client, n, v, event, *a)

    monkeypatch.setattr(ev, "_append", killed_at_event)
    with pytest.raises(Killed):
        publish(cfg, name, version=1)
    monkeypatch.undo()
    mv = registry.client(cfg).get_model_version(name, "1")
    assert "published.path" in mv.tags and registry.events(mv) == []
    publish(cfg, name, version=1)
    mv = registry.client(cfg).get_model_version(name, "1")
    assert [e["type"] for e in registry.events(mv)] == ["publish"]


def test_follower_after_a_killed_publish_never_reverts_it(cfg, release_adapters, name):
    """The issue's instance: the follower completed the killed publish of v3, then published the older
    alias value (v2) over it: the operator's publish was silently reverted."""
    register_versions(cfg, name, release_adapters, 3)
    publish(cfg, name, version=1)
    publish(cfg, name, version=2)
    with crash_at("after-state"), pytest.raises(Killed):  # desired v3, `production` still v2
        publish(cfg, name, version=3)
    with log_messages() as notes:
        shipped = follow_alias(cfg, "production", 1, once=True, names=[name])
    assert shipped == [] and any("completed an interrupted publish" in n for n in notes), notes
    s = snapshot(cfg, name)
    assert (s["production"], s["previous"], s["desired"], s["pending"]) == (3, 2, 3, False)
    assert follow_alias(cfg, "production", 1, once=True, names=[name]) == []


def test_follower_after_a_killed_rollback_never_reverts_it(cfg, release_adapters, name):
    """Sibling: a rollback v3 -> v2 killed after the desired state: the follower saw `production` v3
    not shipped, and its publish (after completing the rollback) shipped v3 again."""
    register_versions(cfg, name, release_adapters, 3)
    for v in (1, 2, 3):
        publish(cfg, name, version=v)
    with crash_at("after-state"), pytest.raises(Killed):
        rollback(cfg, name)
    shipped = follow_alias(cfg, "production", 1, once=True, names=[name])
    assert shipped == []
    s = snapshot(cfg, name)
    assert (s["production"], s["desired"], s["pending"]) == (2, 2, False)


def test_register_killed_after_the_version_exists_keeps_its_verdict_binding(
    cfg, release_adapters, name, monkeypatch
):
    """Sibling: `register` wrote the version, then its `validation.report` tag in a second call; killed
    in between, the version had no binding and publish had to re-validate it."""
    from mlflow import MlflowClient

    def killed(*a, **k):
        raise Killed("after create")

    monkeypatch.setattr(MlflowClient, "update_model_version", killed)
    with pytest.raises(Killed):
        register_versions(cfg, name, release_adapters, 1)
    monkeypatch.undo()
    tags = registry.client(cfg).get_model_version(name, "1").tags
    assert tags["validation.verdict"] == "pass" and '"bound"' in tags["validation.report"]


def test_prune_makes_room_on_a_full_volume(cfg, release_adapters, name, monkeypatch):
    """Sibling (a full disk): every "the filesystem is full" error says to prune, and prune's first
    write was its record: with no byte free it failed the same way (measured on a full tmpfs). The
    oldest version now goes first, without a record, and the record of the rest follows."""
    import errno

    from pipeline.release import transaction

    register_versions(cfg, name, release_adapters, 3)
    for v in (1, 2, 3):
        publish(cfg, name, version=v)
    real, calls = transaction.write_json_atomic, []

    def full_once(path, data):  # the volume is full until something is deleted
        calls.append(path)
        if len(calls) == 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, data)

    monkeypatch.setattr(transaction, "write_json_atomic", full_once)
    removed = prune(cfg, name, keep=1)
    assert sorted(p.name for p in removed) == [f"{name}-v1", f"{name}-v2"]
    assert _versions_on_volume(cfg, name) == [3] and len(calls) == 2
    assert load_intent(cfg.volume.path, name) is None
