"""Crash-safe writes: a file or a directory either appears complete or not at all.

POSIX `rename` within one filesystem is atomic; data reaches the disk before the rename
(fsync of the file, then of its directory), so a power cut never leaves a name pointing at a
partial file.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """fsync a directory (makes renames and creations inside it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path: Path, data: dict) -> None:
    """Write JSON via a temp file in the same directory, fsync, rename (POSIX-atomic); mode 0644."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; fleet instances may run as another user
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_text_atomic(path: Path, text: str) -> None:
    """Write `text` (UTF-8) via a temp file in the same directory, fsync, rename (POSIX-atomic); mode 0644."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def seal_tree(root: Path) -> None:
    """Make files world-readable and read-only (0444, dirs 0555) and fsync them.

    Read-only guards a published version against edits in place; `rmtree` restores write
    permission before deleting. `root` itself stays writable until renamed into place
    (moving a directory needs write permission on it).
    """
    for p in sorted(Path(root).rglob("*"), reverse=True):
        if p.is_file():
            os.chmod(p, 0o444)
            with open(p, "rb") as f:
                os.fsync(f.fileno())
        elif p.is_dir():
            os.chmod(p, 0o555)
            fsync_dir(p)
    fsync_dir(root)


def rmtree(path: Path) -> None:
    """Remove a tree even where `seal_tree` made it read-only; absent is fine. Never follows a link.

    A symlink (to a directory or anything else) or a file is unlinked itself, never what it
    points at; inside the tree only real directories are made writable (`os.walk` does not
    descend into links) and `shutil.rmtree`'s fd-based walk removes entries without following
    links, so a link planted in the tree cannot make this delete or chmod anything outside it.
    """
    path = Path(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        path.unlink(missing_ok=True)
        return
    os.chmod(path, 0o755)
    for root, dirs, _ in os.walk(path, followlinks=False):
        for d in dirs:
            p = os.path.join(root, d)
            if stat.S_ISDIR(os.lstat(p).st_mode):
                os.chmod(p, 0o755)
    shutil.rmtree(path, ignore_errors=True)
