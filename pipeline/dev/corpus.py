"""A real text corpus available offline: the sources and documentation of installed Python packages.

`pipeline dev trained-base` trains its stand-in base from scratch on text nobody on this project wrote
and that every host of ours carries without a download: the `.py`, `.md`, `.rst` and `.txt` files of
the packages installed beside the pipeline (site-packages: torch, transformers, numpy, ...; on the GPU
image several hundred MB). The files are read in sorted path order, so the same installation gives the
same corpus, and the corpus is identified by its size and sha256 (recorded in the base's report).

The held-out split is by file (a file's path hash picks it), so no held-out text occurs in training.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.errors import UsageError

SUFFIXES = (".py", ".md", ".rst", ".txt")
MAX_FILE_BYTES = 512 * 1024  # larger files are mostly generated tables and data
MIN_FILE_BYTES = 256
HELDOUT_EVERY = 50  # about 2% of the files are held out


@dataclass
class Corpus:
    """Documents (one per file) of a corpus and its identity.

    `train` / `heldout`: texts; `files`, `bytes` (UTF-8 bytes of all documents), `sha256` (of the
    documents in order, each followed by a NUL), `roots` (the directories read).
    """

    train: list[str] = field(default_factory=list)
    heldout: list[str] = field(default_factory=list)
    files: int = 0
    bytes: int = 0
    heldout_bytes: int = 0
    sha256: str = ""
    roots: list[str] = field(default_factory=list)

    def describe(self) -> dict:
        return {
            "source": "sources and documentation of installed Python packages ("
            + ", ".join(self.roots)
            + ")",
            "suffixes": list(SUFFIXES),
            "files": self.files,
            "bytes": self.bytes,
            "sha256": self.sha256,
            "train_files": len(self.train),
            "heldout_files": len(self.heldout),
            "heldout_bytes": self.heldout_bytes,
            "heldout_rule": f"sha256(relative path) % {HELDOUT_EVERY} == 0 (else the file of smallest hash)",
        }


def default_roots() -> list[Path]:
    """The interpreter's site-packages (purelib and platlib), where installed packages live."""
    paths = sysconfig.get_paths()
    return sorted({Path(paths["purelib"]), Path(paths["platlib"])})


def _path_hash(rel: str) -> int:
    return int(hashlib.sha256(rel.encode()).hexdigest(), 16)


def collect(roots: list[Path] | None = None, max_bytes: int = 200_000_000) -> Corpus:
    """Read up to `max_bytes` (UTF-8 bytes) of text files under `roots` (default: `default_roots()`).

    Files are taken in sorted order of their path relative to their root, skipping files over
    `MAX_FILE_BYTES` or under `MIN_FILE_BYTES`, files that are not UTF-8, and `__pycache__`.
    Raises UsageError when a root is not a directory or fewer than 2 documents (one train, one
    held out) are found.
    """
    roots = [Path(r) for r in (roots or default_roots())]
    out = Corpus(roots=[str(r) for r in roots])
    digest = hashlib.sha256()
    for root in roots:
        if not root.is_dir():
            raise UsageError(f"corpus root {root} is not a directory: name a folder of text files (--corpus)")
    smallest: tuple[int, int] | None = None  # (path hash, index in train): held out when no file is
    candidates = sorted(
        (str(p.relative_to(root)), p)
        for root in roots
        for p in root.rglob("*")
        if p.suffix in SUFFIXES and "__pycache__" not in p.parts and p.is_file()
    )
    for rel, path in candidates:
        if out.bytes >= max_bytes:
            break
        try:
            size = path.stat().st_size
            if not MIN_FILE_BYTES <= size <= MAX_FILE_BYTES:
                continue
            text = path.read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        n = len(text.encode())
        digest.update(text.encode() + b"\0")
        out.files += 1
        out.bytes += n
        h = _path_hash(rel)
        if h % HELDOUT_EVERY == 0:
            out.heldout.append(text)
            out.heldout_bytes += n
        else:
            if smallest is None or h < smallest[0]:
                smallest = (h, len(out.train))
            out.train.append(text)
    if not out.heldout and len(out.train) > 1 and smallest is not None:  # a small corpus: hold one file out
        text = out.train.pop(smallest[1])
        out.heldout.append(text)
        out.heldout_bytes += len(text.encode())
    if not out.train or not out.heldout:
        raise UsageError(
            f"the corpus under {', '.join(out.roots)} has {len(out.train)} training and {len(out.heldout)} "
            f"held-out documents ({out.bytes} bytes); it needs at least one of each: raise --corpus-mb or "
            "name a larger folder with --corpus"
        )
    out.sha256 = digest.hexdigest()
    return out
