"""sha256 of files and directories, and which files of a directory may be read at all.

One implementation for datasets, adapter weights, manifests and checkpoints: the file is
read through a read-only memory map (no copy into Python buffers; a multi-GB shard is
hashed at disk speed and its pages stay cached for whatever reads it next).

Adapter directories are untrusted input: only regular files inside the directory are hashed,
listed, copied or registered. `scan_directory` tells regular files from everything else
(symlinks, even to regular files; FIFOs, sockets, devices), and `file_hashes` refuses a directory
holding any of the latter, so every caller (manifest, register, publish, volume verify) inherits it.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.errors import UsageError

CHUNK = 1 << 24  # bytes hashed per update (16 MiB)


class UnsafeFileError(UsageError):
    """A directory holds a symlink or a special file: it is not read, copied or registered."""


@dataclass
class DirectoryScan:
    """Entries under a directory (recursive, symlinks never followed)."""

    files: list[Path] = field(default_factory=list)  # regular files
    unsafe: list[tuple[Path, str]] = field(default_factory=list)  # (path, what it is)


def _kind(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "symlink"
    if stat.S_ISFIFO(mode):
        return "FIFO"
    if stat.S_ISSOCK(mode):
        return "socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "device"
    return "special file"


def scan_directory(directory: Path) -> DirectoryScan:
    """Regular files and unsafe entries under `directory`, sorted; symlinks are reported, never followed.

    Raises FileNotFoundError / NotADirectoryError when `directory` itself is not a directory.
    """
    directory = Path(directory)
    if not directory.is_dir():  # the directory itself may be reached through a link: its entries may not
        raise NotADirectoryError(f"{directory}: not a directory")
    out = DirectoryScan()
    for root, dirs, files in os.walk(directory, followlinks=False):
        for name in sorted(dirs + files):
            p = Path(root) / name
            mode = os.lstat(p).st_mode
            if stat.S_ISREG(mode):
                out.files.append(p)
            elif not stat.S_ISDIR(mode):
                out.unsafe.append((p, _kind(mode)))
        dirs[:] = sorted(d for d in dirs if not os.path.islink(Path(root) / d))
    out.files.sort()
    out.unsafe.sort()
    return out


def regular_files(directory: Path) -> list[Path]:
    """Every regular file under `directory`.

    Raises UnsafeFileError naming each symlink or special file (nothing is read then).
    """
    scan = scan_directory(directory)
    if scan.unsafe:
        listed = ", ".join(f"{p} ({what})" for p, what in scan.unsafe[:10])
        raise UnsafeFileError(
            f"{directory}: holds {len(scan.unsafe)} entr{'y' if len(scan.unsafe) == 1 else 'ies'} that are not "
            f"regular files: {listed}; adapter directories must hold regular files only (a symlink can expose "
            "files from outside the directory): replace them with the files they point to, or remove them"
        )
    return scan.files


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's bytes. Raises OSError (FileNotFoundError, IsADirectoryError...)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        if size:
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m, memoryview(m) as mv:
                for i in range(0, size, CHUNK):
                    h.update(mv[i : i + CHUNK])
    return h.hexdigest()


def sha256_bytes(data: bytes) -> str:
    """Hex sha256 of bytes (config texts, canonical JSON payloads)."""
    return hashlib.sha256(data).hexdigest()


def file_hashes(directory: Path, exclude: tuple[str, ...] = ()) -> dict[str, str]:
    """{relative POSIX path: sha256} of every regular file under `directory`, names in `exclude` left out.

    Raises UnsafeFileError when the directory holds a symlink or special file (`regular_files`).
    """
    directory = Path(directory)
    return {
        p.relative_to(directory).as_posix(): sha256_file(p)
        for p in regular_files(directory)
        if p.name not in exclude
    }
