"""sha256 of files and directories: the identity of every artifact the pipeline moves.

One implementation for datasets, adapter weights, manifests and checkpoints: the file is
read through a read-only memory map (no copy into Python buffers; a multi-GB shard is
hashed at disk speed and its pages stay cached for whatever reads it next).
"""

from __future__ import annotations

import hashlib
import mmap
from pathlib import Path

CHUNK = 1 << 24  # bytes hashed per update (16 MiB)


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
    """{relative POSIX path: sha256} of every regular file under `directory`, names in `exclude` left out."""
    out = {}
    directory = Path(directory)
    for p in sorted(directory.rglob("*")):
        if p.is_file() and p.name not in exclude:
            out[p.relative_to(directory).as_posix()] = sha256_file(p)
    return out
