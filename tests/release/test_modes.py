"""Modes the operator's umask cannot weaken; versions the fleet's user can read (issue 40 kind 3).

Under `umask 077` the volume root was created 0700: instances running as another user could read no
version, yet `publish` exited 0. Under `umask 000` every directory the pipeline made was writable by
anyone. The tests publish through the console script under both umasks and then act as `nobody`
(`setpriv --reuid=nobody --regid=nogroup --clear-groups`): it reads every file of the version and
writes nowhere. Siblings: a volume root the fleet cannot enter is refused before anything is written
(any user, and `volume.fleet_user` checked from `/`), a version directory another user owns or others
can write is refused, the state directory and `schedule emit --out` are not writable by others.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from pipeline.artifacts.modes import DIR_MODE, make_dir
from pipeline.artifacts.volume import version_dir
from tests.support import release_support
from tests.support.helpers import REPO
from tests.support.release_support import new_project, register_versions

release_adapters = release_support.release_adapters

SETPRIV = shutil.which("setpriv")
AS_NOBODY = [SETPRIV or "setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]
needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or SETPRIV is None,
    reason="acting as another local user needs root and setpriv (util-linux): run the suite as root",
)


@contextlib.contextmanager
def umask(mask: int):
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


@pytest.fixture
def shared(tmp_path):
    """A project directory `nobody` can reach (pytest's own temp root is 0700), removed afterwards."""
    d = Path(tempfile.mkdtemp(prefix="pipeline-modes-", dir="/tmp"))
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _pipeline(cfg, *args, mask: int = 0o022):
    """The console script as the operator runs it, under `mask`."""
    return subprocess.run(
        [sys.executable, "-m", "pipeline", *map(str, args)],
        env={**os.environ, "PIPELINE_CONFIG": str(cfg.source), "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        umask=mask,
        timeout=300,
    )


def _as_nobody(*cmd) -> subprocess.CompletedProcess:
    """`cmd` as user nobody, group nogroup, no other groups; stdout thrown away (files may be binary)."""
    return subprocess.run(
        [*AS_NOBODY, *map(str, cmd)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=60
    )


def _writable_by_others(*roots: Path) -> list[str]:
    """Modes with group or other write under `roots` (links aside)."""
    out = []
    for root in roots:
        for d, _dirs, files in os.walk(root):
            for p in [d, *(os.path.join(d, n) for n in files)]:
                st = os.lstat(p)
                if not stat.S_ISLNK(st.st_mode) and stat.S_IMODE(st.st_mode) & 0o022:
                    out.append(f"{p} {stat.S_IMODE(st.st_mode):04o}")
    return out


def _nobody_writes(*roots: Path) -> list[str]:
    """What `nobody` could change under `roots`: a file created in a directory, or a file appended to."""
    dirs, files = [], []
    for root in roots:
        for d, _dirs, fs in os.walk(root):
            dirs.append(d)
            files += [os.path.join(d, n) for n in fs]
    script = (
        'for d in $DIRS; do touch "$d/.planted" 2>/dev/null && echo "created in $d"; done; '
        'for f in $FILES; do (: >> "$f") 2>/dev/null && echo "appended to $f"; done; true'
    )
    r = subprocess.run(
        [*AS_NOBODY, "sh", "-c", script],
        env={"DIRS": " ".join(dirs), "FILES": " ".join(files), "PATH": os.environ["PATH"]},
        capture_output=True,
        text=True,
        timeout=120,
    )
    return r.stdout.split("\n")[:-1]


@needs_root
@pytest.mark.parametrize("mask", [0o000, 0o077], ids=["umask000", "umask077"])
def test_a_published_version_is_the_fleets_to_read_and_nobodys_to_write(shared, release_adapters, mask):
    (shared / "p").mkdir(mode=0o755)  # the operator's own directory: readable, as they made it
    with umask(mask):  # the store and the first registration under the operator's umask too
        cfg = new_project(shared / "p")
        register_versions(cfg, "agent", release_adapters, 1)
    r = _pipeline(cfg, "publish", "agent", "--version", "1", mask=mask)
    assert r.returncode == 0, r.stderr
    vol, target = cfg.volume.path, version_dir(cfg.volume.path, "agent", 1)
    assert stat.S_IMODE(os.stat(vol).st_mode) == DIR_MODE
    for f in ["manifest.json", *(p.name for p in target.iterdir())]:
        got = _as_nobody("cat", target / f)
        assert got.returncode == 0, f"nobody cannot read {target / f}: {got.stderr}"
    assert _as_nobody("cat", vol / "fleet-state.json").returncode == 0
    # nobody writes nowhere: the volume, the version, the pipeline's own directories, the state dir
    assert _nobody_writes(vol, cfg.state_dir) == []
    assert _writable_by_others(vol) == []  # the volume by its modes too (the state dir: its store is 0700)


@needs_root
def test_a_volume_root_the_fleet_cannot_enter_is_refused_before_anything_is_written(shared, release_adapters):
    """The issue's input: the root made 0700 by an earlier publish under `umask 077`."""
    cfg = new_project(shared / "p")
    register_versions(cfg, "agent", release_adapters, 1)
    cfg.volume.path.mkdir(mode=0o700)
    os.chmod(cfg.volume.path, 0o700)
    r = _pipeline(cfg, "publish", "agent", "--version", "1")
    assert r.returncode == 2, r.stderr
    assert f"{cfg.volume.path} (mode 0700" in r.stderr and "volume.fleet_user" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    assert sorted(p.name for p in cfg.volume.path.iterdir()) in ([], [".locks"])  # nothing published
    r = _pipeline(cfg, "status", "agent", "--json")
    assert '"production"' not in r.stdout
    os.chmod(cfg.volume.path, 0o755)  # the fix the message names
    assert _pipeline(cfg, "publish", "agent", "--version", "1").returncode == 0


@needs_root
def test_fleet_user_is_checked_from_the_root_of_the_filesystem(tmp_path, shared, release_adapters):
    """With `volume.fleet_user`, every directory above the volume counts (pytest's temp root is 0700)."""
    blocked = new_project(
        tmp_path / "p", volume={"path": str(tmp_path / "p" / "volume"), "fleet_user": "nobody"}
    )
    register_versions(blocked, "agent", release_adapters, 1)
    r = _pipeline(blocked, "publish", "agent", "--version", "1")
    assert r.returncode == 2 and "user nobody" in r.stderr and "cannot read and enter" in r.stderr, r.stderr
    assert not version_dir(blocked.volume.path, "agent", 1).exists()
    ok = new_project(shared / "p", volume={"path": str(shared / "p" / "volume"), "fleet_user": "nobody"})
    register_versions(ok, "agent", release_adapters, 1)
    r = _pipeline(ok, "publish", "agent", "--version", "1", mask=0o077)
    assert r.returncode == 0, r.stderr
    unknown = new_project(
        shared / "q", volume={"path": str(shared / "q" / "volume"), "fleet_user": "no-such-user-x"}
    )
    register_versions(unknown, "agent", release_adapters, 1)
    r = _pipeline(unknown, "publish", "agent", "--version", "1")
    assert r.returncode == 2 and "no local user 'no-such-user-x'" in r.stderr, r.stderr


@needs_root
@pytest.mark.parametrize("how", ["owned by nobody", "writable by others"])
def test_a_version_directory_not_the_operators_own_is_refused(shared, release_adapters, how):
    cfg = new_project(shared / "p")
    register_versions(cfg, "agent", release_adapters, 2)
    for v in (1, 2):
        assert _pipeline(cfg, "publish", "agent", "--version", v).returncode == 0
    target = version_dir(cfg.volume.path, "agent", 1)
    if how == "owned by nobody":
        os.chown(target / "manifest.json", 65534, 65534)
    else:
        os.chmod(target, 0o777)
    for args in (["publish", "agent", "--version", "1"], ["rollback", "agent"]):
        r = _pipeline(cfg, *args)
        assert r.returncode == 2, r.stderr
        assert "not this user's own sealed version directory" in r.stderr, r.stderr
        assert ("owned by uid 65534" if how == "owned by nobody" else "lets others write it") in r.stderr


@needs_root
@pytest.mark.parametrize("mask", [0o000, 0o077], ids=["umask000", "umask077"])
def test_schedule_files_and_directories_whatever_the_umask(shared, mask):
    cfg = new_project(shared / "p", store=False)
    out = shared / "schedule" / "units"
    r = _pipeline(
        cfg,
        "schedule",
        "emit",
        "--kind",
        "systemd",
        "--name",
        "agent",
        "--config",
        "c.yml",
        "--out",
        out,
        "--no-check",  # the job's own checks (c.yml, data) are not what this test is about
        mask=mask,
    )
    assert r.returncode == 0, r.stderr
    assert _writable_by_others(shared / "schedule") == []
    for f in out.iterdir():
        assert stat.S_IMODE(f.stat().st_mode) == 0o644
        assert _as_nobody("cat", f).returncode == 0  # a scheduler running as another user reads it


@pytest.mark.parametrize("mask", [0o000, 0o077])
def test_make_dir_ignores_the_umask(tmp_path, mask):
    with umask(mask):
        assert make_dir(tmp_path / "a" / "b" / "c")
        assert not make_dir(tmp_path / "a" / "b" / "c")
    for d in ("a", "a/b", "a/b/c"):
        assert stat.S_IMODE((tmp_path / d).stat().st_mode) == DIR_MODE
    (tmp_path / "file").write_text("")
    with pytest.raises(FileExistsError):
        make_dir(tmp_path / "file")


@needs_root
def test_the_canarys_staging_copy_is_readable_by_a_staging_instance_of_another_user(shared):
    """`canary NAME` unpacks the version into a `mkdtemp` directory (0700) under the operator's umask:
    a staging vLLM running as another user could not load it (`share_tree`)."""
    from pipeline.artifacts.modes import share_tree

    with umask(0o077):
        work = Path(tempfile.mkdtemp(dir=shared))
        (work / "adapter").mkdir()
        (work / "adapter" / "adapter_config.json").write_text("{}")
    assert _as_nobody("cat", work / "adapter" / "adapter_config.json").returncode != 0
    share_tree(work)
    assert _as_nobody("cat", work / "adapter" / "adapter_config.json").returncode == 0
    assert _nobody_writes(work) == []
