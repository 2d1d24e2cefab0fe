"""What an adapter directory may hold, and the one way the pipeline copies it out (register, publish).

An adapter directory is untrusted input that the pipeline copies to places other users read: the
registry's artifact store and the adapter volume, where every file becomes world-readable (0444)
so that fleet instances running as another user can load it. So what is copied is bounded by
what an adapter is, and never carries content its owner could not already give away:

- only the names in `ADAPTER_FILES` (PEFT's `save_pretrained` output, the tokenizer files
  axolotl saves beside it, the pipeline's `manifest.json`), each at most its size in bytes; no
  subdirectories;
- regular files only (no symlinks, FIFOs, sockets, devices: `pipeline.artifacts.hashing`);
- a link count of 1: a hard link is a regular file, but it may be a second name of a file
  someone else owns (e.g. a hard link to a root-only file), which the copy would publish;
- owned by the user the pipeline runs as;
- no mode that says secret: a file its owner cannot read (e.g. 0000, 0200: only a privileged
  process could copy it), or a setuid/setgid file. Owner-only modes (0600) are no such sign:
  safetensors >= 0.8 (PEFT's `save_pretrained`) writes every weights file 0600 (measured here:
  `safetensors.torch.save_file` at umask 022), so refusing them would refuse every adapter; the
  name and owner rules already keep other files out.

`adapter_file_problems` lists every rule a directory breaks (validation reports them);
`copy_adapter` refuses a directory that breaks any, and re-checks each file on the descriptor
it copies from (opened without following links), so a file swapped after the check is not copied
either. The directory itself is opened once and every entry is listed and opened relative to that
descriptor (`dir_fd`): a directory renamed away and replaced (by a link to another directory) between
the check and the copy cannot make the copy read another directory's files. The weights' size bound from the adapter's rank and modules is validation's
(`pipeline.validate`); `ADAPTER_FILES` only caps what no adapter reaches.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from pipeline.artifacts.atomic import rmtree
from pipeline.artifacts.hashing import UnsafeFileError

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30

# name -> the most bytes such a file may hold in an adapter directory.
ADAPTER_FILES: dict[str, int] = {
    "adapter_config.json": 1 * MIB,
    "adapter_model.safetensors": 64 * GIB,  # r=64 on every module of a 27B model is ~2 GB
    "manifest.json": 16 * MIB,
    "README.md": 1 * MIB,  # the model card peft's save_pretrained writes
    "tokenizer.json": 64 * MIB,
    "tokenizer_config.json": 16 * MIB,  # may embed the chat template
    "special_tokens_map.json": 1 * MIB,
    "added_tokens.json": 16 * MIB,
    "chat_template.jinja": 1 * MIB,
    "chat_template.json": 1 * MIB,
    "vocab.json": 64 * MIB,
    "merges.txt": 64 * MIB,
    "tokenizer.model": 64 * MIB,  # sentencepiece
}
COPY_CHUNK = 16 * MIB


class UnsafeAdapterError(UnsafeFileError):
    """An adapter directory holds something the pipeline does not copy out (exit 2; nothing written)."""


@dataclass(frozen=True)
class FileProblem:
    """One rule of the module doc broken by one entry: `kind` is unexpected | size | link | owner | secret | type."""

    path: Path
    kind: str
    message: str


def _limit(n: int) -> str:
    return f"{n // GIB} GiB" if n >= GIB else (f"{n // MIB} MiB" if n >= MIB else f"{n // KIB} KiB")


def stat_problem(path: Path, st: os.stat_result) -> FileProblem | None:
    """The first rule a file (its `lstat` or `fstat`) breaks, or None."""
    name = path.name
    if stat.S_ISDIR(st.st_mode):
        return FileProblem(path, "type", f"{path}: a subdirectory; adapter directories are flat: remove it")
    if not stat.S_ISREG(st.st_mode):
        what = "a symlink" if stat.S_ISLNK(st.st_mode) else "not a regular file"
        return FileProblem(
            path, "type", f"{path}: {what}; replace it with the file it stands for, or remove it"
        )
    if name not in ADAPTER_FILES:
        return FileProblem(
            path,
            "unexpected",
            f"{path}: not a file an adapter holds (an adapter is {', '.join(sorted(ADAPTER_FILES))}): "
            "remove it, or move it out of the adapter directory",
        )
    if st.st_size > ADAPTER_FILES[name]:
        return FileProblem(
            path,
            "size",
            f"{path}: {st.st_size} bytes, more than an adapter's {name} holds (at most {_limit(ADAPTER_FILES[name])})",
        )
    if st.st_nlink > 1:
        return FileProblem(
            path,
            "link",
            f"{path}: has {st.st_nlink} names (a hard link): it may be another user's file under a second name; "
            "copy it (`cp --no-preserve=links`) so the adapter holds its own file",
        )
    if st.st_uid != os.geteuid():
        return FileProblem(
            path,
            "owner",
            f"{path}: owned by uid {st.st_uid}, not by the user running the pipeline (uid {os.geteuid()}): "
            "copy the adapter into a directory of your own first",
        )
    if not st.st_mode & stat.S_IRUSR or st.st_mode & (stat.S_ISUID | stat.S_ISGID):
        return FileProblem(
            path,
            "secret",
            f"{path}: mode {stat.S_IMODE(st.st_mode):04o} says it is not to be read (published files are "
            "readable by every user, 0444): if it may be published, `chmod 0644` it; otherwise remove it",
        )
    return None


def _open_dir(directory: Path) -> int:
    """A descriptor of `directory` (links followed once, here); NotADirectoryError / FileNotFoundError."""
    return os.open(directory, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))


def _problems(dfd: int, directory: Path) -> list[FileProblem]:
    out = []
    with os.scandir(dfd) as it:
        entries = sorted(it, key=lambda e: e.name)
    for entry in entries:
        problem = stat_problem(directory / entry.name, entry.stat(follow_symlinks=False))
        if problem:
            out.append(problem)
    return out


def adapter_file_problems(directory: Path) -> list[FileProblem]:
    """Every entry of `directory` that breaks a rule of the module doc (sorted by name; empty: fine).

    Raises NotADirectoryError / FileNotFoundError when `directory` is no directory.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise NotADirectoryError(f"{directory}: not a directory")
    dfd = _open_dir(directory)
    try:
        return _problems(dfd, directory)
    finally:
        os.close(dfd)


def _refuse(directory: Path, problems: list[FileProblem]) -> UnsafeAdapterError:
    shown = "\n  ".join(p.message for p in problems[:10])
    more = f"\n  ... and {len(problems) - 10} more" if len(problems) > 10 else ""
    return UnsafeAdapterError(f"{directory}: not copied, nothing was written:\n  {shown}{more}")


def check_adapter_dir(directory: Path) -> None:
    """Raise UnsafeAdapterError listing what `directory` holds that `copy_adapter` would refuse."""
    problems = adapter_file_problems(directory)
    if problems:
        raise _refuse(Path(directory), problems)


def _copy_one(dfd: int, src: Path, dst: Path) -> None:
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0)
    fd = os.open(src.name, flags, dir_fd=dfd)
    try:
        st = os.fstat(fd)
        problem = stat_problem(src, st)  # the file actually opened, not the name checked before
        if problem:
            raise _refuse(src.parent, [problem])
        left = st.st_size + 1  # one byte more than it claims: a file growing while copied is refused
        with open(dst, "xb") as out:
            while left > 0:
                chunk = os.read(fd, min(COPY_CHUNK, left))
                if not chunk:
                    break
                out.write(chunk)
                left -= len(chunk)
            out.flush()
            os.fsync(out.fileno())
            copied = out.tell()
        if copied != st.st_size:
            raise _refuse(src.parent, [FileProblem(src, "size", f"{src}: changed while it was copied")])
        os.chmod(dst, 0o644)
    finally:
        os.close(fd)


def copy_adapter(src: Path, dst: Path) -> list[str]:
    """Copy the adapter directory `src` into the new directory `dst`; returns the names copied.

    The rules are checked and the files copied through one descriptor of `src` (module doc).

    Raises UnsafeAdapterError (a rule of the module doc broken; `dst` is removed again), OSError
    for a filesystem error (`dst` removed again), NotADirectoryError / FileNotFoundError.
    """
    src, dst = Path(src), Path(dst)
    if not src.is_dir():
        raise NotADirectoryError(f"{src}: not a directory")
    dfd = _open_dir(src)
    try:
        problems = _problems(dfd, src)
        if problems:
            raise _refuse(src, problems)
        dst.mkdir(parents=False, exist_ok=False)
        with os.scandir(dfd) as it:
            names = sorted(e.name for e in it)
        try:
            for name in names:
                _copy_one(dfd, src / name, dst / name)
        except BaseException:
            rmtree(dst)
            raise
        return names
    finally:
        os.close(dfd)
