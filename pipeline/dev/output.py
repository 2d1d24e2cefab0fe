"""Where the dev builders (`pipeline dev tiny-base`, `real-base`) may write, and writing it whole.

A checkpoint directory OUT is "replaced" only when that cannot destroy anything else: OUT must
name a directory below the working directory's level (not `""`, `.`, `..`, `/`, the working
directory or one of its parents), and an existing OUT must be empty or a model checkpoint
(`config.json` inside). The checkpoint is written into `OUT.partial` next to it and moved into
place only when complete, so a failed build leaves OUT as it was.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from pathlib import Path

from pipeline.errors import UsageError


def check_output_dir(out: Path) -> Path:
    """Return `out` if a builder may (re)write it. Raises UsageError saying why not (nothing written)."""
    out = Path(out)
    if out.name in ("", ".."):  # "", "." and "/" have no name; ".." is a parent
        raise UsageError(f"{str(out)!r} is not a directory name: give a new directory, e.g. ./tiny-base")
    resolved = out.resolve()
    cwd = Path.cwd().resolve()
    if resolved == cwd or resolved in cwd.parents:
        raise UsageError(
            f"{out} is the working directory or one of its parents: give a new directory below it"
        )
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise UsageError(f"{out} exists and is not a directory: give a directory path to write the base into")
    if out.is_dir() and any(out.iterdir()) and not (out / "config.json").is_file():
        raise UsageError(
            f"{out} is not empty and holds no model checkpoint (no config.json): it is only replaced when it "
            "is a checkpoint a builder wrote; choose another directory or empty it first"
        )
    return out


@contextlib.contextmanager
def write_whole(out: Path) -> Iterator[Path]:
    """Yield `OUT.partial` to write into; on success replace `out` with it, on failure remove it.

    Raises UsageError (see `check_output_dir`) before anything is written.
    """
    final = check_output_dir(out)
    partial = final.with_name(final.name + ".partial")
    if partial.exists():
        shutil.rmtree(partial)
    partial.mkdir(parents=True)
    try:
        yield partial
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    if final.exists():
        shutil.rmtree(final)
    partial.rename(final)
