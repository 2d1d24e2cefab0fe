"""Files reached through links (issue 30 kind 1): what register and publish copy out of an adapter, and
what the pipeline itself reads or deletes under the volume, are real files and directories of their own.

Real sqlite MLflow and a real volume; no fleet.
"""

from __future__ import annotations

import os
import shutil

import pytest

from pipeline import registry
from pipeline.artifacts.adapter_files import UnsafeAdapterError
from pipeline.artifacts.atomic import rmtree
from pipeline.artifacts.manifest import file_hashes, read_manifest, write_manifest
from pipeline.artifacts.volume import verify_version
from pipeline.errors import VolumeError
from pipeline.fleet.state import load_state
from pipeline.release.publish import publish
from pipeline.release.transaction import load_intent
from tests.support import release_support
from tests.support.release_support import new_project, register_versions

release_adapters = release_support.release_adapters


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    return new_project(tmp_path_factory.mktemp("links"))


def _victim(root):
    """A directory outside the volume that must come out of every test exactly as it went in."""
    v = root / "victim"
    (v / "agent").mkdir(parents=True)
    (v / "agent" / "data").write_text("keep me")
    (v / "agent").chmod(0o700)
    return v, {p: (p.lstat().st_mode, p.read_bytes() if p.is_file() else None) for p in v.rglob("*")}


def _intact(v, before):
    return {p: (p.lstat().st_mode, p.read_bytes() if p.is_file() else None) for p in v.rglob("*")} == before


def test_register_refuses_a_hard_link_to_a_root_only_file(cfg, release_adapters, tmp_path):
    """The issue's instance: a hard link to a root-only file was registered and published 0444."""
    secret = tmp_path / "shadow"
    secret.write_text("root:$6$hash")
    secret.chmod(0o600)
    a = tmp_path / "adapter"
    shutil.copytree(release_adapters[0][0], a)
    (a / "README.md").unlink()
    os.link(secret, a / "README.md")
    m = read_manifest(a)
    m.files = file_hashes(a)
    write_manifest(a, m)  # a manifest that lists it
    with pytest.raises(UnsafeAdapterError, match="README.md: has 2 names"):
        registry.register_adapter(cfg, a, "hardlinked", release_adapters[0][1])
    assert not registry.model_exists(cfg, "hardlinked")  # nothing registered


def test_publish_copies_only_adapter_files_from_the_artifact_store(cfg, release_adapters, tmp_path):
    """Sibling: a version whose artifact holds more than an adapter (logged through MLflow directly,
    its manifest listing an `.env`): publish copied it onto the volume, readable by every user."""
    a = tmp_path / "extra"
    shutil.copytree(release_adapters[0][0], a)
    (a / ".env").write_text("AWS_SECRET_ACCESS_KEY=x")
    m = read_manifest(a)
    m.files = file_hashes(a)
    write_manifest(a, m)
    mlflow = registry.mlflow_for(cfg)
    model = mlflow.initialize_logged_model(name="extra", experiment_id=registry.experiment_id(cfg))
    registry.client(cfg).log_model_artifacts(model.model_id, str(a))
    mlflow.finalize_logged_model(model.model_id, "READY")
    mv = mlflow.register_model(
        f"models:/{model.model_id}",
        "extra",
        tags=registry.version_tags(cfg, read_manifest(a), release_adapters[0][1], None),
    )
    with pytest.raises(UnsafeAdapterError, match=r"\.env: not a file an adapter holds"):
        publish(cfg, "extra", version=int(mv.version))
    assert not (cfg.volume.path / f"extra-v{mv.version}").exists()


def test_staging_that_links_out_of_the_volume_is_refused(cfg, release_adapters, tmp_path):
    """Sibling: `.staging` a link to another directory: debris clean-up would delete its entries."""
    register_versions(cfg, "agent", release_adapters, 1)
    victim, before = _victim(tmp_path)
    staging = cfg.volume.path / ".staging"
    rmtree(staging)
    os.symlink(victim, staging)
    try:
        with pytest.raises(VolumeError, match=r"\.staging: a symbolic link"):
            publish(cfg, "agent", version=1)
        assert _intact(victim, before)
    finally:
        staging.unlink()


def test_a_linked_version_directory_is_no_version(cfg, release_adapters, tmp_path):
    """Sibling: `NAME-v9` a link to a complete copy elsewhere: verified as intact, served, and prune
    would chmod the target tree before failing to delete it."""
    from pipeline.release.prune import prune

    register_versions(cfg, "linked", release_adapters, 2)
    for v in (1, 2):
        publish(cfg, "linked", version=v)
    outside = tmp_path / "linked-v9"
    shutil.copytree(cfg.volume.path / "linked-v1", outside)
    os.symlink(outside, cfg.volume.path / "linked-v9")
    modes = {p: p.lstat().st_mode for p in [outside, *outside.rglob("*")]}
    assert "symbolic link" in verify_version(cfg.volume.path, "linked", 9)[0]
    assert [p.name for p in prune(cfg, "linked", keep=1)] == ["linked-v1"]  # v9 is not counted
    assert {p: p.lstat().st_mode for p in [outside, *outside.rglob("*")]} == modes
    assert (cfg.volume.path / "linked-v9").is_symlink()


def test_records_are_read_only_as_real_files_of_the_volume(cfg, tmp_path):
    """Sibling: `fleet-state.json` and `.txn/NAME.json` as links (or hard links) to files elsewhere."""
    vol = cfg.volume.path
    other = tmp_path / "other-state.json"
    other.write_text('{"schema": 1, "adapters": {"x": {"version": 1, "history": [1]}}}')
    state = vol / "fleet-state.json"
    saved = state.read_bytes() if state.exists() else None
    try:
        for make in (os.symlink, os.link):
            state.unlink(missing_ok=True)
            state.parent.mkdir(parents=True, exist_ok=True)
            make(other, state)
            with pytest.raises(VolumeError, match="fleet-state.json: a (symbolic link|file with 2 names)"):
                load_state(vol)
    finally:
        state.unlink(missing_ok=True)
        if saved is not None:
            state.write_bytes(saved)
    (vol / ".txn").mkdir(exist_ok=True)
    os.symlink(other, vol / ".txn" / "agent.json")
    try:
        with pytest.raises(VolumeError, match=r"agent.json: a symbolic link"):
            load_intent(vol, "agent")
    finally:
        (vol / ".txn" / "agent.json").unlink()


def test_rmtree_never_follows_a_link(tmp_path):
    victim, before = _victim(tmp_path)
    tree = tmp_path / "tree"
    (tree / "sub").mkdir(parents=True)
    (tree / "sub" / "f").write_text("x")
    (tree / "sub").chmod(0o555)
    os.symlink(victim, tree / "sub2")
    os.symlink(victim / "agent", tree / "sub" / "link")
    rmtree(tree)
    assert not os.path.lexists(tree) and _intact(victim, before)
    os.symlink(victim, tmp_path / "alias")
    rmtree(tmp_path / "alias")  # the link goes, not what it points at
    assert not os.path.lexists(tmp_path / "alias") and _intact(victim, before)
