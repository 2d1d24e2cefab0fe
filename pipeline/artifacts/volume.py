"""The adapter volume's layout: where version `N` of adapter `NAME` lives and what it is called.

    <volume>/<NAME>-v<N>/          one immutable directory per version (adapter + manifest.json)
    <volume>/fleet-state.json      what each adapter should serve (pipeline.fleet.state)
    <volume>/.staging/<NAME>/      publishes of NAME in progress (same filesystem: the last step
                                   is a rename); whatever is there while nobody holds NAME's lock
                                   is debris of a killed publish, removed by the next publish
    <volume>/.locks/<NAME>.lock    NAME's transaction lock (publish, promote, rollback, prune)
    <volume>/.txn/<NAME>.json      NAME's transaction in progress (pipeline.release.transaction)
    <volume>/.fleet-state.lock     the fleet lock (fleet-state.json and every instance change)

The directory name is also the name fleet instances serve the version under (vLLM's
filesystem resolver maps a requested model id to `<dir>/<id>`). Names follow
`pipeline.artifacts.names` (no name ends in `-v<digits>`), so `<NAME>-v<N>` never equals
another adapter's name or another version's directory. Directories are never modified after
creation: vLLM never re-reads a resolved adapter and keys its prefix cache on the adapter's
name (docs/vllm.md).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import stat
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from pipeline.artifacts.atomic import fsync_dir, rmtree, seal_tree
from pipeline.artifacts.locks import try_lock
from pipeline.artifacts.manifest import MANIFEST, read_adapter_manifest, read_manifest, verify_files
from pipeline.artifacts.modes import fleet_access_problems, fleet_reader, foreign_entries, make_dir, tighten
from pipeline.artifacts.names import name_problem
from pipeline.errors import VolumeError

STAGING = ".staging"
LOCKS = ".locks"
TXN = ".txn"
VERSION_RE = re.compile(r"(?P<name>.+)-v(?P<version>\d+)\Z")  # \Z: `$` also matches before a final newline
SPACE_MARGIN = 1 << 20  # bytes kept free beyond what a copy needs (manifest, directory entries)


def version_name(name: str, version: int) -> str:
    """`NAME-vN`: the version directory's name and the served name of that version."""
    return f"{name}-v{version}"


def version_dir(volume: Path, name: str, version: int) -> Path:
    """`<volume>/<NAME>-v<N>`."""
    return Path(volume) / version_name(name, version)


def parse_version_name(dirname: str) -> tuple[str, int] | None:
    """(`NAME`, N) for a `NAME-vN` directory name whose NAME is a valid adapter name, else None."""
    m = VERSION_RE.match(dirname)
    if not m or name_problem(m["name"]) is not None:
        return None
    return m["name"], int(m["version"])


def adapter_lock_path(volume: Path, name: str) -> Path:
    """`<volume>/.locks/<NAME>.lock`."""
    return Path(volume) / LOCKS / f"{name}.lock"


def staging_dir(volume: Path, name: str) -> Path:
    """`<volume>/.staging/<NAME>`: where publishes of NAME stage their copy."""
    return Path(volume) / STAGING / name


def staging_owner(entry: str) -> str | None:
    """The adapter a `.staging/` entry belongs to: `NAME` (current layout) or `NAME-vN.<random>` (older)."""
    if name_problem(entry) is None:
        return entry
    m = re.match(r"(?P<name>.+)-v\d+\.[^/]+\Z", entry)
    return m["name"] if m and name_problem(m["name"]) is None else None


def os_failure(e: OSError, doing: str, path: Path | str) -> VolumeError:
    """A VolumeError saying what failed where and how to fix it, for an OSError from `doing`."""
    hint = {
        errno.EROFS: "the filesystem is mounted read-only: publish from a host that mounts the volume "
        "read-write (fleet instances only need it read-only)",
        errno.ENOSPC: "the filesystem is full: prune old versions (`pipeline fleet prune NAME --keep N`) "
        "or grow the volume",
        errno.EDQUOT: "the disk quota is exhausted: prune old versions or raise the quota",
        errno.EACCES: "permission denied: run as a user that may use it (its owner), or fix its modes",
        errno.EPERM: "operation not permitted: run as a user that may use it (its owner)",
        errno.ENAMETOOLONG: "a file name is too long for this filesystem",
        errno.EIO: "an I/O error: check the disk or the network filesystem",
    }.get(e.errno, "")
    what = e.strerror or str(e)
    return VolumeError(f"{doing}: {path}: {what}" + (f" ({hint})" if hint else ""))


# -- the volume's own entries are real ones ---------------------------------------------------------
def _device(volume: Path) -> int:
    try:
        return os.stat(volume).st_dev  # the volume root itself may be reached through a link
    except OSError as e:
        raise os_failure(e, "cannot read the volume", volume) from e


def real_dir(path: Path, volume: Path, create: bool = False) -> bool:
    """Whether `path` is a real directory of the volume; absent: False (created, mode 0755 whatever the
    umask, when `create`).

    Everything the pipeline itself reads or deletes under the volume (`.staging`, `.txn`, `.locks`,
    version directories) must be a directory of the volume, not a link to one elsewhere (a deletion
    or a copy would follow it out of the volume) and not on another filesystem. Raises VolumeError
    saying what it is and how to fix it.
    """
    path = Path(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        if not create:
            return False
        try:
            make_dir(path)
            st = os.lstat(path)
        except OSError as e:
            raise os_failure(e, "cannot create the directory", path) from e
    except OSError as e:
        raise os_failure(e, "cannot read", path) from e
    what = _not_real(st, volume, directory=True)
    if what:
        raise VolumeError(
            f"{path}: {what}; the pipeline only uses real directories of the volume {volume} there "
            "(a link would lead reads and deletions out of it): remove it (`rm`, not `rm -r`)"
        )
    if create:
        try:
            tighten(path)  # nobody else writes into the pipeline's own directories, whatever umask made them
        except OSError as e:
            raise os_failure(e, "cannot set the mode of", path) from e
    return True


def real_file(path: Path, volume: Path) -> bool:
    """Whether `path` is a real file of the volume (regular, one name, the volume's filesystem); absent: False.

    For the volume's records the pipeline reads (`fleet-state.json`, `.txn/<NAME>.json`). Raises
    VolumeError saying what it is instead.
    """
    path = Path(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    except OSError as e:
        raise os_failure(e, "cannot read", path) from e
    what = _not_real(st, volume, directory=False)
    if what:
        raise VolumeError(
            f"{path}: {what}; the pipeline reads only its own records there: move it away and run the "
            "command again (publish and rollback write a new one)"
        )
    return True


def _not_real(st: os.stat_result, volume: Path, directory: bool) -> str | None:
    if stat.S_ISLNK(st.st_mode):
        return "a symbolic link"
    if directory and not stat.S_ISDIR(st.st_mode):
        return "not a directory"
    if not directory and not stat.S_ISREG(st.st_mode):
        return "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
    if not directory and st.st_nlink > 1:
        return f"a file with {st.st_nlink} names (a hard link to a file elsewhere)"
    if st.st_dev != _device(volume):
        return "on another filesystem than the volume (a mount point)"
    return None


def version_dirs(volume: Path, name: str | None = None) -> dict[str, list[int]]:
    """{NAME: [versions, newest first]} of the real `NAME-vN` directories on the volume (links are no versions)."""
    out: dict[str, list[int]] = {}
    try:
        entries = list(os.scandir(volume))
    except FileNotFoundError:
        return out
    except OSError as e:
        raise os_failure(e, "cannot list", volume) from e
    for e in entries:
        parsed = parse_version_name(e.name)
        if parsed and (name is None or parsed[0] == name) and e.is_dir(follow_symlinks=False):
            out.setdefault(parsed[0], []).append(parsed[1])
    return {n: sorted(v, reverse=True) for n, v in out.items()}


def check_writable(directory: Path) -> None:
    """Raise VolumeError unless `directory` (created if missing: mode 0755 whatever the umask) can be written."""
    directory = Path(directory)
    try:
        make_dir(directory)
    except OSError as e:
        raise os_failure(e, "cannot create the directory", directory) from e
    if not os.access(directory, os.W_OK):
        try:  # os.access says no; the filesystem says why (EROFS, EACCES)
            probe = directory / f".write-probe-{os.getpid()}"
            probe.touch()
            probe.unlink()
        except OSError as e:
            raise os_failure(e, "cannot write", directory) from e


def check_fleet_access(volume: Path, path: Path, fleet_user: str | int | None, tree: bool = True) -> None:
    """Raise VolumeError unless the fleet's user (`volume.fleet_user`; None: any user) can read `path`.

    `tree`: also every directory and file under `path` (a version directory); else only the
    directories down to `path` (the volume root, before anything is written). The message names each
    path that stops it, its mode and owner, and the fix. Raises VolumeError for a `fleet_user` the
    system does not know, too. See `pipeline.artifacts.modes`.
    """
    try:
        reader = fleet_reader(fleet_user)
    except ValueError as e:
        raise VolumeError(f"volume.fleet_user: {e}") from None
    path, volume = Path(path), Path(volume)
    try:
        problems = fleet_access_problems(path, reader, volume, tree=tree)
    except OSError as e:
        raise os_failure(e, "cannot examine", e.filename or path) from e
    if problems:
        raise VolumeError(
            "fleet instances could not read what this would publish:\n  "
            + "\n  ".join(problems[:10])
            + (f"\n  ... and {len(problems) - 10} more" if len(problems) > 10 else "")
            + "\nGive the fleet read and search access (e.g. `chmod 0755` the directories named, or `chgrp` them "
            "to the fleet's group with mode 0750 and set volume.fleet_user), or set volume.fleet_user to the "
            'user the fleet\'s vLLM runs as (docs/fleet.md, "Who may read the volume"); nothing was published'
        )


def check_own_version_dir(directory: Path) -> None:
    """Raise VolumeError when a version directory (or an entry in it) is another user's or writable by others.

    Its owner could change it after it was verified, and the fleet would load what they put there.
    """
    try:
        foreign = foreign_entries(directory)
    except OSError as e:
        raise os_failure(e, "cannot examine", e.filename or directory) from e
    if foreign:
        raise VolumeError(
            f"{directory}: not this user's own sealed version directory, so it can be changed under the fleet:\n  "
            + "\n  ".join(foreign[:10])
            + "\nMove it away (another user's copy is not trusted) and publish the version again; nothing changed"
        )


def check_free_space(directory: Path, need_bytes: int, files: int = 0) -> None:
    """Raise VolumeError when `directory`'s filesystem lacks `need_bytes` (+ margin) or `files` inodes."""
    try:
        st = os.statvfs(directory)
    except OSError as e:
        raise os_failure(e, "cannot read free space", directory) from e
    free = st.f_bavail * st.f_frsize
    if free < need_bytes + SPACE_MARGIN:
        raise VolumeError(
            f"{directory}: {free / 1e6:.1f} MB free, the copy needs {(need_bytes + SPACE_MARGIN) / 1e6:.1f} MB: "
            f"nothing was written; prune old versions (`pipeline fleet prune NAME --keep N`) or grow the volume"
        )
    if files and st.f_files and st.f_favail < files + 8:
        raise VolumeError(
            f"{directory}: {st.f_favail} inodes free, the copy needs {files}: nothing was written"
        )


def tree_size(directory: Path) -> tuple[int, int]:
    """(bytes, regular files) under `directory`."""
    total = n = 0
    for p in Path(directory).rglob("*"):
        if p.is_file() and not p.is_symlink():
            total += p.stat().st_size
            n += 1
    return total, n


# -- the staging lifecycle: how a version directory comes to exist ------------------------------------
STALE_UNKNOWN_S = 3600  # `.staging/` entries that name no adapter: removed when this old


def clear_debris(root: Path, volume: Path) -> list[Path]:
    """Remove entries of `root` (`<volume>/.staging` or a local download area) left by killed writers.

    An entry belongs to an adapter (`staging_owner`); it is debris when nobody holds that adapter's
    lock (a live publish holds it from before it stages until after the rename), so a concurrent
    publish of another adapter is never disturbed. Entries naming no adapter are removed once an
    hour old. Returns the removed paths. Raises VolumeError when an entry cannot be removed.
    """
    removed: list[Path] = []
    root = Path(root)
    if not real_dir(root, root.parent):
        return removed
    real_dir(Path(volume) / LOCKS, volume)  # the locks asked below are the volume's own
    for entry in sorted(root.iterdir()):
        owner = staging_owner(entry.name)
        try:
            if owner is None:
                if time.time() - entry.lstat().st_mtime > STALE_UNKNOWN_S:
                    rmtree(entry)
                    removed.append(entry)
                continue
            with try_lock(adapter_lock_path(volume, owner)) as free:
                if free:
                    rmtree(entry)
                    removed.append(entry)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise os_failure(e, "cannot remove staging debris", entry) from e
    return removed


def _rmdir_if_empty(*dirs: Path) -> None:
    for d in dirs:
        try:
            d.rmdir()  # only when empty: a concurrent publish may be staging
        except OSError:
            pass


@dataclass
class Staged:
    """A version directory being written: the body of `staged_version` fills `path`."""

    path: Path  # `<volume>/.staging/<NAME>/v<N>.<random>/adapter`: becomes the version directory
    target: Path  # `<volume>/<NAME>-v<N>`
    created: bool = False  # set on exit: True when this copy was renamed into place


@contextlib.contextmanager
def staged_version(
    volume: Path,
    name: str,
    version: int,
    need_bytes: int,
    files: int,
    checkpoint: Callable[[str], None] = lambda point: None,
) -> Iterator[Staged]:
    """The one way a version directory is written: stage, seal, rename. Call holding NAME's lock.

    Before the body: the volume's free space is checked for `need_bytes` / `files` (a full
    volume gets no partial copy) and a private directory is made under `<volume>/.staging/<NAME>/`
    (same filesystem, so the last step is a rename). The body fills `Staged.path`, the manifest
    last. On a normal exit the tree is sealed (files 0444, directories 0555, each fsynced),
    `checkpoint("before-rename")` is called (crash injection), the directory is renamed to
    `<volume>/<NAME>-v<N>` (mode 0555, the volume fsynced) and `created` is True; when the target
    appeared meanwhile (a writer not holding this lock), this copy is dropped and `created` stays
    False. The staging directory is removed however the block ends, so a version directory either
    does not exist or is complete; what a SIGKILL leaves in `.staging/` is debris for
    `clear_debris`. Raises VolumeError (with the fix) for any filesystem error.
    """
    volume = Path(volume)
    target = version_dir(volume, name, version)
    stage_root = staging_dir(volume, name)
    real_dir(volume / STAGING, volume, create=True)
    real_dir(stage_root, volume, create=True)
    try:
        check_free_space(stage_root, need_bytes, files)
        work = Path(tempfile.mkdtemp(prefix=f"v{version}.", dir=stage_root))
    except OSError as e:
        _rmdir_if_empty(stage_root, volume / STAGING)
        raise os_failure(e, "cannot create a staging directory in", stage_root) from e
    except BaseException:
        _rmdir_if_empty(stage_root, volume / STAGING)
        raise
    staged = Staged(work / "adapter", target)
    try:
        try:
            yield staged
            seal_tree(staged.path)
            checkpoint("before-rename")
            try:
                os.rename(staged.path, target)
            except OSError as e:
                if target.exists():  # written meanwhile by a writer not holding this lock
                    return
                raise os_failure(e, f"cannot move {staged.path} to", target) from e
            os.chmod(target, 0o555)
            fsync_dir(volume)
            staged.created = True
        except OSError as e:
            raise os_failure(e, "cannot write the version directory", work) from e
    finally:
        rmtree(work)
        _rmdir_if_empty(stage_root, volume / STAGING)


def remove_version(
    volume: Path, name: str, version: int, tag: str, checkpoint: Callable[[str], None] = lambda point: None
) -> Path | None:
    """Delete `<volume>/<NAME>-v<N>`: renamed into `.staging/<NAME>/` first (one atomic step, so the
    version directory is whole or gone however the process ends), then removed there. Call holding
    NAME's lock. `tag` names the staging entry (a transaction id); `checkpoint("prune-moved")` runs
    between the two steps. Returns the directory, or None when it was not there (or is a link: no
    version directory, left alone). Raises VolumeError.
    """
    volume = Path(volume)
    d = version_dir(volume, name, version)
    if d.is_symlink() or not real_dir(d, volume):
        return None
    trash_root = staging_dir(volume, name)
    real_dir(volume / STAGING, volume, create=True)
    real_dir(trash_root, volume, create=True)
    trash = trash_root / f"pruned-v{version}.{tag[:12]}"
    try:
        os.chmod(d, 0o755)  # a sealed directory (0555) cannot move to another parent
        os.rename(d, trash)
        fsync_dir(volume)
    except OSError as e:
        raise os_failure(e, "cannot delete", d) from e
    checkpoint("prune-moved")
    rmtree(trash)
    if os.path.lexists(trash):
        raise os_failure(PermissionError(13, "some files could not be removed"), "cannot delete", trash)
    _rmdir_if_empty(trash_root, volume / STAGING)
    return d


# -- integrity: a version directory against its manifest ----------------------------------------------
_verified: dict[str, tuple] = {}


def _signature(directory: Path) -> tuple:
    """Per file: name, mode, size, mtime, ctime, inode. The ctime (ns) is what a rewrite cannot
    put back: `touch -r`, `cp -p`, `rsync -a` and `os.utime` restore a file's mtime, and an
    in-place write keeps its size and inode, but every change of content or metadata sets ctime
    to now (POSIX `stat`)."""
    out = []
    for p in sorted(Path(directory).rglob("*")):
        try:
            st = p.lstat()
        except FileNotFoundError:
            continue
        out.append(
            (str(p.relative_to(directory)), st.st_mode, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)
        )
    return tuple(out)


def verify_version_dir(directory: Path, cache: bool = True) -> list[str]:
    """Problems of a version directory against its `manifest.json` (empty: intact).

    Missing directory, missing/unreadable manifest, a file missing, extra or with another
    sha256 are each one problem. With `cache`, a directory verified intact earlier in this
    process is not re-hashed while no file's size, mtime, ctime, inode or mode changed (a `fleet
    sync --watch` pass stays cheap; ctime because an in-place rewrite can restore the mtime); a
    first check always hashes every byte.
    """
    directory = Path(directory)
    if directory.is_symlink():
        return [f"{directory}: a symbolic link, not a version directory of the volume (move it away)"]
    if not directory.is_dir():
        return [f"{directory}: missing"]
    key = str(directory.resolve())
    sig = _signature(directory) if cache else None
    if cache and _verified.get(key) == sig:
        return []
    try:
        manifest = read_adapter_manifest(directory)
    except FileNotFoundError:
        return [f"{directory}/{MANIFEST}: missing (not written by the pipeline, or a partial copy)"]
    except (OSError, ValueError) as e:
        return [f"{directory}/{MANIFEST}: {e}"]
    try:
        problems = verify_files(directory, manifest.files)
    except OSError as e:
        return [f"{directory}: cannot read ({e})"]
    if cache and not problems:
        _verified[key] = sig
    elif not problems:
        _verified.pop(key, None)
    return problems


def incomplete(directory: Path) -> str | None:
    """Why a version directory is not whole, without hashing (its manifest is unreadable, or a file it
    lists is missing), or None. Cheap enough for every version on the volume; `verify_version_dir`
    hashes."""
    try:
        files = read_manifest(directory).files
    except FileNotFoundError:
        return f"{directory}/{MANIFEST}: missing (not written by the pipeline, or a partial copy or deletion)"
    except (OSError, ValueError) as e:
        return f"{directory}/{MANIFEST}: {e}"
    for rel in sorted(files):
        if not (Path(directory) / rel).is_file():
            return f"{directory}/{rel}: missing (a partial copy or deletion)"
    return None


def verify_version(volume: Path, name: str, version: int, cache: bool = True) -> list[str]:
    """`verify_version_dir` of `<volume>/<NAME>-v<N>`: call before any instance is told to load it."""
    return verify_version_dir(version_dir(volume, name, version), cache=cache)
