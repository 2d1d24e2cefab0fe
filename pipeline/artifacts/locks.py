"""File locks for whole operations: per-adapter transactions and the volume's fleet lock.

`file_lock` wraps `filelock.FileLock` (POSIX `flock`: released by the kernel when the holder
dies, even by SIGKILL, so a crashed publish never leaves a stale lock). It is re-entrant per
thread: a publish holding the fleet lock may call code (the fleet rollout, sync) that takes it
again. Two threads or processes exclude each other.

Every lock file of the pipeline is made by `private_lock`: mode 0600. `flock` needs only an open
descriptor, read-only will do, so a lock file other users can read (0644, the umask's default) is
one any local account can hold forever: `nobody` holding `<volume>/.locks/NAME.lock` stopped every
publish and rollback of NAME, and holding `<state_dir>/locks/NAME.lock` made every scheduled
`pipeline run` exit 3 ("another run holds the lock", 0 with `--locked-ok`). A lock file made
earlier with another mode is set to 0600 when this user owns it (a descriptor someone opened
before stays open: the kernel checks modes at open only).
"""

from __future__ import annotations

import contextlib
import os
import stat
import threading
from pathlib import Path

from filelock import FileLock, Timeout

from pipeline.artifacts.modes import make_dir
from pipeline.errors import LockedError, VolumeError

_held = threading.local()
LOCK_MODE = 0o600


def private_lock(path: Path) -> FileLock:
    """A `filelock.FileLock` on `path` whose file only this user can open (module doc)."""
    path = Path(path)
    with contextlib.suppress(OSError):  # absent, or a filesystem that refuses: acquiring says why
        st = os.lstat(path)
        if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) != LOCK_MODE:
            os.chmod(path, LOCK_MODE)
    return FileLock(str(path), mode=LOCK_MODE)


def _depths() -> dict[str, int]:
    if not hasattr(_held, "depth"):
        _held.depth = {}
    return _held.depth


@contextlib.contextmanager
def file_lock(path: Path, timeout_s: float, what: str):
    """Hold the lock file `path` for the `with` block.

    `what` names the operation for the error message. Raises LockedError (exit 3) after
    `timeout_s` seconds of waiting (0: do not wait), VolumeError when the lock file cannot be
    created (read-only or full filesystem).
    """
    path = Path(path)
    key = os.path.realpath(path)
    depth = _depths()
    if depth.get(key):
        depth[key] += 1
        try:
            yield
        finally:
            depth[key] -= 1
        return
    try:
        make_dir(path.parent)  # 0755 whatever the umask
        lock = private_lock(path)
        lock.acquire(timeout=timeout_s)
    except Timeout as e:
        raise LockedError(f"{path}: {what} holds the lock; waited {timeout_s:.0f} s") from e
    except OSError as e:
        raise VolumeError(f"cannot create the lock file {path}: {e.strerror or e}") from e
    depth[key] = 1
    try:
        yield
    finally:
        depth.pop(key, None)
        lock.release()


def held(path: Path) -> bool:
    """True when this thread holds the lock file `path` (through `file_lock`)."""
    return bool(_depths().get(os.path.realpath(Path(path))))


@contextlib.contextmanager
def try_lock(path: Path):
    """Yield True while holding `path` if it is free right now, else yield False (never waits)."""
    path = Path(path)
    if held(path):
        yield True
        return
    lock = private_lock(path)
    try:
        lock.acquire(timeout=0)
    except (Timeout, OSError):
        yield False
        return
    try:
        yield True
    finally:
        lock.release()
