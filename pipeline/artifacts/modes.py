"""Modes of what the pipeline creates, whatever the operator's umask, and whether the fleet can read it.

The umask decides the modes of `mkdir`, `open` and `mkstemp`: under `umask 077` a volume root made
by `mkdir` is 0700 and instances running as another user read no version; under `umask 000` every
directory is writable by anyone, so any local user could add, swap or delete what the fleet loads.
So the pipeline never leaves a mode to the umask where it matters:

  - directories it creates on the volume and under its state directory: `make_dir`, each one
    `chmod`ed to 0755 after `mkdir` (readable by the fleet, writable by the operator only);
  - published versions: files 0444, directories 0555 (`pipeline.artifacts.atomic.seal_tree`);
    records the fleet may read (`fleet-state.json`): 0644 (`write_json_atomic`);
  - private things stay private: lock files 0600 (`pipeline.artifacts.locks`), the embedded
    store 0600/0700 (`pipeline.registry.store.keep_private`), temporary download areas 0700;
  - everything else a command writes (runs, logs, schedule files, MLflow's own files): the CLI adds
    group and other write to the umask (`no_writes_by_others`), so nothing is writable by others,
    while an operator's stricter umask still keeps training data private.

Who the fleet reads as: `volume.fleet_user` in pipeline.yaml (a user name or uid). Unset, the
fleet may run as any user: the volume root and everything below it must be readable by all
(`fleet_access_problems`); set, every directory from `/` down to each file is checked for that
user's uid and groups, as the kernel would. `publish` checks before it writes anything and
refuses (exit 2) with the path and the fix (docs/fleet.md, "Who may read the volume").
"""

from __future__ import annotations

import grp
import os
import pwd
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

DIR_MODE = 0o755  # directories the fleet reads: only the operator writes
FILE_MODE = 0o644  # records the fleet reads
OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH


def no_writes_by_others() -> int:
    """Add group and other write to the process umask (keeping what it already masks); returns the old umask.

    For everything the pipeline writes without an explicit mode (MLflow's files, run directories,
    logs, schedule files): never writable by others, and an operator's `umask 077` still holds.
    """
    old = os.umask(0o022)
    os.umask(old | 0o022)
    return old


def make_dir(path: Path, mode: int = DIR_MODE) -> bool:
    """Create directory `path` and its missing parents, each with exactly `mode` (umask-proof).

    `mkdir`'s mode is cut by the umask, so each directory this call creates is `chmod`ed after;
    an existing `path` keeps its mode, less group and other write when this user owns it
    (`tighten`: made under a looser umask earlier). Returns True when `path` was created. Raises
    OSError as `mkdir` does (read-only filesystem, permissions; a file in the way: FileExistsError).
    """
    path = Path(path)
    missing: list[Path] = []
    p = path
    while not os.path.lexists(p) and p != p.parent:
        missing.append(p)
        p = p.parent
    created = False
    for d in reversed(missing):
        try:
            os.mkdir(d, mode)
        except FileExistsError:  # made meanwhile by another process: theirs to set
            if not os.path.isdir(d):
                raise
            continue
        os.chmod(d, mode)
        created = True
    if not missing:
        if not path.is_dir():
            raise FileExistsError(17, "exists and is not a directory", str(path))
        tighten(path)
    return created


def tighten(path: Path) -> None:
    """Take group and other write off `path` when this user owns it (a directory made under `umask 000`
    or `002` by an earlier version); another user's is left alone. Links are not followed."""
    st = os.lstat(path)
    if st.st_uid == os.geteuid() and not stat.S_ISLNK(st.st_mode) and stat.S_IMODE(st.st_mode) & OTHERS_WRITE:
        os.chmod(path, stat.S_IMODE(st.st_mode) & ~OTHERS_WRITE)


def share_tree(root: Path) -> None:
    """Make a tree this user wrote readable by others (directories 0755, files 0644); links untouched.

    For what another user's process reads while it exists (the canary's staging instance reads the
    unpacked adapter). Raises OSError.
    """
    root = Path(root)
    os.chmod(root, DIR_MODE)
    for d, dirs, files in os.walk(root, followlinks=False):
        for n in dirs:
            p = os.path.join(d, n)
            if stat.S_ISDIR(os.lstat(p).st_mode):
                os.chmod(p, DIR_MODE)
        for n in files:
            p = os.path.join(d, n)
            if stat.S_ISREG(os.lstat(p).st_mode):
                os.chmod(p, FILE_MODE)


@dataclass(frozen=True)
class Reader:
    """Who the fleet reads the volume as: a uid and its groups, or None for any user."""

    uid: int | None = None
    gids: frozenset[int] = frozenset()
    label: str = "any user (volume.fleet_user unset)"

    def can(self, st: os.stat_result, need: int) -> bool:
        """Whether this reader has the `need` bits (4 read, 1 search/execute, as in `other`) on `st`."""
        if self.uid == 0:
            return True  # root reads and searches everything (CAP_DAC_READ_SEARCH)
        mode = stat.S_IMODE(st.st_mode)
        if self.uid is None:
            bits = mode & 0o7
        elif st.st_uid == self.uid:
            bits = (mode >> 6) & 0o7
        elif st.st_gid in self.gids:
            bits = (mode >> 3) & 0o7
        else:
            bits = mode & 0o7
        return bits & need == need


def fleet_reader(user: str | int | None) -> Reader:
    """The `Reader` for `volume.fleet_user` (a name or a uid; None: any user).

    Raises ValueError naming the user when the system does not know it.
    """
    if user is None:
        return Reader()
    try:
        pw = pwd.getpwuid(int(user)) if str(user).isdigit() else pwd.getpwnam(str(user))
    except KeyError:
        raise ValueError(
            f"no local user {user!r}: give the user the fleet's vLLM runs as (a name or a uid)"
        ) from None
    gids = {pw.pw_gid} | {g.gr_gid for g in grp.getgrall() if pw.pw_name in g.gr_mem}
    return Reader(pw.pw_uid, frozenset(gids), f"user {pw.pw_name} (uid {pw.pw_uid}, volume.fleet_user)")


def _problem(path: Path, st: os.stat_result, reader: Reader, directory: bool) -> str | None:
    need = 5 if directory else 4
    if reader.can(st, need):
        return None
    what = "read and enter" if directory else "read"
    return f"{path} (mode {stat.S_IMODE(st.st_mode):04o}, owner uid {st.st_uid}, group gid {st.st_gid}): {reader.label} cannot {what} it"


def fleet_access_problems(path: Path, reader: Reader, volume: Path, tree: bool = True) -> list[str]:
    """What keeps `reader` from reading `path` (a directory and everything in it), as one line each.

    Checked: every directory from the volume root down to `path`'s parent (with `volume.fleet_user`
    set, from `/`), then, with `tree`, `path` and every directory and regular file under it, else
    `path` alone. Links are not followed (the pipeline writes none). Empty: the fleet can read it.
    Raises OSError when a path cannot be examined.
    """
    path, volume = Path(path), Path(volume)
    chain = [path, *path.parents]
    if reader.uid is None:  # any user: what the pipeline controls, the volume root and below
        chain = [p for p in chain if p == volume or volume in p.parents]
    out = []
    for d in reversed(chain[1:]):
        why = _problem(d, os.stat(d), reader, True)
        if why:
            out.append(why)
    if not tree:
        why = _problem(path, os.stat(path), reader, True)
        return out + ([why] if why else [])
    for d, _dirs, files in os.walk(path, followlinks=False):
        why = _problem(Path(d), os.lstat(d), reader, True)
        if why:
            out.append(why)
        for n in files:
            st = os.lstat(os.path.join(d, n))
            if stat.S_ISREG(st.st_mode):
                why = _problem(Path(d) / n, st, reader, False)
                if why:
                    out.append(why)
    return out


def foreign_entries(path: Path) -> list[str]:
    """Entries of the tree `path` (itself included) this user does not own, or that others may write.

    A version directory another user owns can be changed by that user at any time (they may `chmod`
    their own files), and one writable by others by anyone: the fleet would load what they put there.
    """
    uid = os.geteuid()
    out = []
    entries = [str(path)]
    for d, dirs, files in os.walk(path, followlinks=False):
        entries += [os.path.join(d, n) for n in dirs + files]
    for p in entries:
        st = os.lstat(p)
        if st.st_uid != uid:
            out.append(f"{p}: owned by uid {st.st_uid}, not by this user (uid {uid})")
        elif stat.S_IMODE(st.st_mode) & OTHERS_WRITE and not stat.S_ISLNK(st.st_mode):
            out.append(f"{p}: mode {stat.S_IMODE(st.st_mode):04o} lets others write it")
    return out


def writable_problem(what: str, path: Path) -> str | None:
    """None when this user can create or write `path` (a directory), else one line naming it.

    Probes the nearest existing ancestor with a directory created and removed at once (a dry run's check
    too: it leaves nothing)."""
    p = Path(path)
    probe = p
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if probe != p and not probe.is_dir():
        return f"{what} {p}: {probe} is in the way (not a directory)"
    if probe == p and not p.is_dir():
        return f"{what} {p}: not a directory"
    where = f"{'cannot be created in ' + str(probe) if probe != p else 'not writable'} by uid {os.geteuid()}"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{what} {p}: {where} (the user the command or job runs as)"
    try:  # root passes os.access everywhere; the filesystem has the last word (/proc, a read-only mount)
        os.rmdir(tempfile.mkdtemp(prefix=".pipeline-probe-", dir=probe))
    except OSError as e:
        return f"{what} {p}: {where} ({e.strerror})"
    return None
