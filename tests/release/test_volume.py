"""The volume fails or is tampered with: clear errors, nothing partial, debris removed by the next publish
(issue 16 sections 1 and 4).

Read-only and full volumes are real tmpfs mounts (skipped where this process may not mount);
staging debris comes from a publish really killed with SIGKILL at a checkpoint.
"""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from pipeline import registry
from pipeline.errors import VolumeError
from pipeline.release.publish import PublishError, publish
from pipeline.release.rollback import rollback
from tests.support import release_support
from tests.support.release_support import (
    Gate,
    Worker,
    hooked,
    new_project,
    pipeline_cli,
    register_versions,
    snapshot,
)

release_adapters = release_support.release_adapters


@pytest.fixture
def tmpfs(tmp_path):
    """mount(size, ro=False) -> a tmpfs directory; unmounted afterwards. Skips without mount rights."""
    mounted = []

    def mount(size: str) -> object:
        mnt = tmp_path / f"mnt{len(mounted)}"
        mnt.mkdir()
        r = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], capture_output=True
        )
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
        mounted.append(mnt)
        return mnt

    yield mount
    for m in reversed(mounted):
        subprocess.run(["umount", "-l", str(m)], capture_output=True)


def remount_ro(mnt) -> None:
    subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)


def test_read_only_volume_is_a_clear_error(tmp_path, tmpfs, release_adapters):
    """Issue 16: a read-only volume gave a traceback (OSError EROFS) on publish."""
    mnt = tmpfs("4m")
    (mnt / "volume").mkdir()
    cfg = new_project(tmp_path / "p", volume={"path": str(mnt / "volume")})
    register_versions(cfg, "ro", release_adapters, 1)
    remount_ro(mnt)
    with pytest.raises(VolumeError, match="read-only") as e:
        publish(cfg, "ro", version=1)
    assert str(mnt / "volume") in str(e.value)
    r = pipeline_cli(cfg, "publish", "ro", "--version", "1")
    assert r.returncode == 2 and "read-only" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert registry.alias_version(cfg, "ro", "production") is None
    # sibling: rollback and prune on the same volume
    r = pipeline_cli(cfg, "fleet", "prune", "ro", "--keep", "1")
    # nothing of `ro` is on the volume (its publish was refused): prune plans first and has nothing to change
    assert r.returncode == 0 and "nothing to prune" in r.stdout and "Traceback" not in r.stderr, r.stderr


def test_full_volume_is_refused_before_copying(tmp_path, tmpfs, release_adapters):
    """Issue 16: a volume full mid-copy gave a traceback. Free space is checked first."""
    mnt = tmpfs("256k")  # the adapter is ~0.5 MB
    cfg = new_project(tmp_path / "p", volume={"path": str(mnt / "volume")})
    register_versions(cfg, "full", release_adapters, 1)
    with pytest.raises(VolumeError, match="MB free, the copy needs") as e:
        publish(cfg, "full", version=1)
    assert "prune old versions" in str(e.value)
    s = snapshot(cfg, "full")
    assert not s["pending"] and s["staging"] == [] and s["production"] is None
    assert not (cfg.volume.path / "full-v1").exists()
    r = pipeline_cli(cfg, "publish", "full", "--version", "1")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr


def test_volume_filling_up_mid_copy_leaves_nothing_partial(tmp_path, tmpfs, release_adapters, monkeypatch):
    """Sibling: the space was there at the check and is gone during the copy (another writer): the
    kernel's ENOSPC becomes a VolumeError, the staging copy and the record are removed."""
    import pipeline.artifacts.volume as vol

    mnt = tmpfs("300k")
    cfg = new_project(tmp_path / "p", volume={"path": str(mnt / "volume")})
    register_versions(cfg, "midcopy", release_adapters, 1)
    monkeypatch.setattr(vol, "check_free_space", lambda *a, **k: None)  # pretend it fit when checked
    with pytest.raises(VolumeError, match="No space left"):
        publish(cfg, "midcopy", version=1)
    s = snapshot(cfg, "midcopy")
    assert not s["pending"] and s["staging"] == [] and not (cfg.volume.path / "midcopy-v1").exists()


def test_killed_publish_debris_is_removed_by_the_next_publish_of_any_adapter(tmp_path, release_adapters):
    """Issue 16: staging debris of killed publishes survived later publishes (removed only after an hour)."""
    cfg = new_project(tmp_path / "p")
    register_versions(cfg, "killed", release_adapters, 1)
    register_versions(cfg, "other", release_adapters, 1)
    r = pipeline_cli(cfg, "publish", "killed", "--version", "1", env={"PIPELINE_TEST_KILL_AT": "after-copy"})
    assert r.returncode == -9, r.stderr  # SIGKILL at the checkpoint: no clean-up ran
    debris = list((cfg.volume.path / ".staging").rglob("adapter_model.safetensors"))
    assert debris, "the killed publish left its staging copy"
    assert list((cfg.state_dir / "tmp").iterdir())  # and its local download
    res = publish(cfg, "other", version=1)  # seconds later, another adapter
    assert res.created
    assert not (cfg.volume.path / ".staging").exists()
    assert not list((cfg.state_dir / "tmp").iterdir())
    res = publish(cfg, "killed", version=1)  # the killed one's record is abandoned, the publish works
    assert res.created and any("abandoned" in w for w in res.warnings)
    assert snapshot(cfg, "killed") == {
        "production": 1,
        "previous": None,
        "desired": 1,
        "pending": False,
        "staging": [],
    }


def test_debris_goes_with_a_publish_that_copies_nothing(tmp_path, release_adapters):
    """Sibling (new-user helper): only a publish that copied cleared debris; promote/rollback and a
    re-publish of a version already on the volume left it."""
    cfg = new_project(tmp_path / "p")
    register_versions(cfg, "calm", release_adapters, 2)
    publish(cfg, "calm", version=1)
    publish(cfg, "calm", version=2)
    stale = cfg.volume.path / ".staging" / "killed" / "calm-v9.x"  # what a killed publish of `killed` leaves
    stale.mkdir(parents=True)
    (stale / "adapter_model.safetensors").write_bytes(b"half a copy")
    (cfg.state_dir / "tmp").mkdir(exist_ok=True)
    (cfg.state_dir / "tmp" / "killed-v9.abc").mkdir()
    res = publish(cfg, "calm", version=1)  # v1 is on the volume already: nothing copied
    assert not res.created
    assert not stale.exists() and not list((cfg.state_dir / "tmp").iterdir())


def test_debris_clean_up_never_touches_a_live_publish(tmp_path, release_adapters):
    cfg = new_project(tmp_path / "p")
    register_versions(cfg, "live", release_adapters, 1)
    register_versions(cfg, "cleaner", release_adapters, 1)
    gate = Gate("after-copy", "A")
    with hooked(gate):
        a = Worker("A", lambda: publish(cfg, "live", version=1))
        a.start()
        assert gate.reached.wait(60)
        staged = list((cfg.volume.path / ".staging" / "live").iterdir())
        assert staged
        b = Worker("B", lambda: publish(cfg, "cleaner", version=1))
        b.start()
        b.join(120)
        assert b.error is None, b.error
        assert all(p.exists() for p in staged)  # A holds its adapter's lock: not debris
        gate.release()
        a.join(120)
    assert a.error is None, a.error
    assert a.result.created and (cfg.volume.path / "live-v1" / "manifest.json").exists()


def test_legacy_debris_names_are_recognised(tmp_path, release_adapters):
    """Debris in the older layout (`.staging/<NAME>-v<N>.<random>`) and unknown entries older than an hour."""
    import os

    cfg = new_project(tmp_path / "p")
    register_versions(cfg, "fresh", release_adapters, 1)
    old = cfg.volume.path / ".staging" / "agent-tools-v9.k2j4h5"
    (old / "adapter").mkdir(parents=True)
    stray = cfg.volume.path / ".staging" / "Not A Name"
    stray.mkdir()
    os.utime(stray, (time.time() - 7200, time.time() - 7200))
    publish(cfg, "fresh", version=1)
    assert not old.exists() and not stray.exists()


# -- integrity: a byte flipped in a published version -----------------------------------------------------
def _flip_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.chmod(0o644)
    path.write_bytes(bytes(data))


def test_tampered_version_is_refused_everywhere_before_an_instance_would_load_it(tmp_path, release_adapters):
    """Issue 16: a byte flipped in a published, served version was not noticed by `fleet status`,
    `fleet sync` or `status`. Here without instances: publish, rollback and `fleet status`."""
    cfg = new_project(tmp_path / "p")
    register_versions(cfg, "tamper", release_adapters, 2)
    publish(cfg, "tamper", version=1)
    publish(cfg, "tamper", version=2)
    _flip_byte(cfg.volume.path / "tamper-v1" / "adapter_model.safetensors")
    with pytest.raises(PublishError, match="differs from its manifest"):
        rollback(cfg, "tamper", to=1)
    with pytest.raises(PublishError, match="differs from its manifest"):
        publish(cfg, "tamper", version=1)
    assert snapshot(cfg, "tamper")["production"] == 2

    r = pipeline_cli(cfg, "fleet", "status", "--json")
    assert r.returncode == 0, r.stdout + r.stderr  # the desired v2 is intact
    _flip_byte(cfg.volume.path / "tamper-v2" / "adapter_model.safetensors")
    r = pipeline_cli(cfg, "fleet", "status", "--json")
    assert r.returncode == 4, r.stdout + r.stderr
    rows = [x for x in json.loads(r.stdout) if x["adapter"] == "tamper"]
    assert [x["state"] for x in rows] == ["corrupt"] and "sha256" in rows[0]["detail"]
    r = pipeline_cli(cfg, "status", "tamper", "--json")
    assert r.returncode == 0, r.stderr
    assert [x["state"] for x in json.loads(r.stdout)["volume"]] == ["corrupt"]
    r = pipeline_cli(cfg, "status", "tamper", env={"COLUMNS": "200"})
    assert "corrupt:" in r.stderr and "tamper-v2/adapter_model.safetensors" in r.stderr  # messages: stderr
