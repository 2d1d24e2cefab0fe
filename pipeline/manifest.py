"""`manifest.json`: what an adapter directory holds and where it came from.

The manifest lists the sha256 of every other file in the directory, so any copy (registry
artifact, volume directory) can be verified byte for byte. It is always written last and
atomically: a directory whose manifest exists is complete.
"""

from __future__ import annotations

import json
import os
import tempfile
from importlib import metadata
from pathlib import Path

from pipeline.dataset import sha256_file

MANIFEST = "manifest.json"
SCHEMA = 1


def file_hashes(directory: Path) -> dict[str, str]:
    """{relative path: sha256} of every regular file under `directory`, manifest excluded."""
    out = {}
    for p in sorted(Path(directory).rglob("*")):
        if p.is_file() and p.name != MANIFEST:
            out[p.relative_to(directory).as_posix()] = sha256_file(p)
    return out


def package_versions(names=("axolotl", "peft", "transformers", "torch", "mlflow", "lora-pipeline")) -> dict:
    out = {}
    for n in names:
        try:
            out[n] = metadata.version(n)
        except metadata.PackageNotFoundError:
            out[n] = None
    return out


def write_json_atomic(path: Path, data: dict) -> None:
    """Write JSON via a temp file in the same directory, fsync, rename (POSIX-atomic)."""
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


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_manifest(directory: Path) -> dict:
    """Load `manifest.json`. Raises FileNotFoundError / ValueError (not JSON) naming the file."""
    p = Path(directory) / MANIFEST
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{p}: not valid JSON ({e.msg} at line {e.lineno})") from e


def verify_files(directory: Path, expected: dict[str, str]) -> list[str]:
    """Problems (missing, extra, sha256 mismatch) between `directory` and `expected` hashes."""
    actual = file_hashes(directory)
    problems = [f"{directory}/{n}: missing" for n in sorted(set(expected) - set(actual))]
    problems += [f"{directory}/{n}: not in the manifest" for n in sorted(set(actual) - set(expected))]
    problems += [
        f"{directory}/{n}: sha256 {actual[n][:12]}... != manifest {expected[n][:12]}..."
        for n in sorted(set(actual) & set(expected))
        if actual[n] != expected[n]
    ]
    return problems
