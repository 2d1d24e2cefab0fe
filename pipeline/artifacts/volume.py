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
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from pipeline.artifacts.atomic import fsync_dir, rmtree, seal_tree
from pipeline.artifacts.locks import try_lock
from pipeline.artifacts.manifest import MANIFEST, read_adapter_manifest, verify_files
from pipeline.artifacts.names import name_problem
from pipeline.errors import VolumeError

STAGING = ".staging"
LOCKS = ".locks"
TXN = ".txn"
VERSION_RE = re.compile(r"^(?P<name>.+)-v(?P<version>\d+)$")
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
    m = re.match(r"^(?P<name>.+)-v\d+\.[^/]+$", entry)
    return m["name"] if m and name_problem(m["name"]) is None else None


def os_failure(e: OSError, doing: str, path: Path | str) -> VolumeError:
    """A VolumeError saying what failed where and how to fix it, for an OSError from `doing`."""
    hint = {
        errno.EROFS: "the filesystem is mounted read-only: publish from a host that mounts the volume "
        "read-write (fleet instances only need it read-only)",
        errno.ENOSPC: "the filesystem is full: prune old versions (`pipeline fleet prune NAME --keep N`) "
        "or grow the volume",
        errno.EDQUOT: "the disk quota is exhausted: prune old versions or raise the quota",
        errno.EACCES: "permission denied: run as a user that may write there",
        errno.EPERM: "operation not permitted: run as a user that may write there",
        errno.ENAMETOOLONG: "a file name is too long for this filesystem",
        errno.EIO: "an I/O error: check the disk or the network filesystem",
    }.get(e.errno, "")
    what = e.strerror or str(e)
    return VolumeError(f"{doing}: {path}: {what}" + (f" ({hint})" if hint else ""))


def check_writable(directory: Path) -> None:
    """Raise VolumeError unless `directory` (created if missing) can be written."""
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise os_failure(e, "cannot create the directory", directory) from e
    if not os.access(directory, os.W_OK):
        try:  # os.access says no; the filesystem says why (EROFS, EACCES)
            probe = directory / f".write-probe-{os.getpid()}"
            probe.touch()
            probe.unlink()
        except OSError as e:
            raise os_failure(e, "cannot write", directory) from e


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


def copy_tree(src: Path, dst: Path) -> None:
    """Copy the regular files and directories of `src` to the new directory `dst` (symlinks are not followed).

    Raises VolumeError (with the fix) on any filesystem error; `dst` is removed again then.
    """
    try:
        shutil.copytree(src, dst, symlinks=True, ignore_dangling_symlinks=True)
    except (OSError, shutil.Error) as e:
        rmtree(dst)
        if isinstance(e, shutil.Error):  # copytree collects per-file errors: report the first
            first = e.args[0][0] if e.args and e.args[0] else ("?", "?", str(e))
            raise VolumeError(f"cannot copy {first[0]} to {first[1]}: {first[2]}") from e
        raise os_failure(e, "cannot copy", dst) from e


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
    if not Path(root).is_dir():
        return removed
    for entry in sorted(Path(root).iterdir()):
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
    try:
        stage_root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise os_failure(e, "cannot create the staging directory", stage_root) from e
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


# -- integrity: a version directory against its manifest ----------------------------------------------
_verified: dict[str, tuple] = {}


def _signature(directory: Path) -> tuple:
    out = []
    for p in sorted(Path(directory).rglob("*")):
        try:
            st = p.lstat()
        except FileNotFoundError:
            continue
        out.append((str(p.relative_to(directory)), st.st_mode, st.st_size, st.st_mtime_ns, st.st_ino))
    return tuple(out)


def verify_version_dir(directory: Path, cache: bool = True) -> list[str]:
    """Problems of a version directory against its `manifest.json` (empty: intact).

    Missing directory, missing/unreadable manifest, a file missing, extra or with another
    sha256 are each one problem. With `cache`, a directory verified intact earlier in this
    process is not re-hashed while no file's size, mtime, inode or mode changed (a `fleet sync
    --watch` pass stays cheap); a first check always hashes every byte.
    """
    directory = Path(directory)
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


def verify_version(volume: Path, name: str, version: int, cache: bool = True) -> list[str]:
    """`verify_version_dir` of `<volume>/<NAME>-v<N>`: call before any instance is told to load it."""
    return verify_version_dir(version_dir(volume, name, version), cache=cache)
