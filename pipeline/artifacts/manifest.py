"""`manifest.json`: what an adapter directory holds and where it came from.

The manifest lists the sha256 of every other file in the directory, so any copy (registry
artifact, volume directory) can be verified byte for byte. It is always written last and
atomically (`pipeline.artifacts.atomic.write_json_atomic`): a directory whose manifest exists
is complete. `Manifest` is its schema (version `SCHEMA`); unknown keys are kept, so an older
pipeline can read a newer manifest's known fields.
"""

from __future__ import annotations

import json
from importlib import metadata
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pipeline.artifacts import hashing

MANIFEST = "manifest.json"
SCHEMA = 1


class Manifest(BaseModel):
    """The fields every stage relies on; the rest (metrics, dataset, served, merge, parity...) pass through."""

    model_config = ConfigDict(extra="allow")

    schema_: int = Field(SCHEMA, alias="schema", description="manifest schema version")
    files: dict[str, str] = Field(description="relative path -> sha256 of every other file")
    name: str | None = None
    base_model: dict | None = None
    adapter: dict | None = None
    published: dict | None = None


def package_versions(names=("axolotl", "peft", "transformers", "torch", "mlflow", "lora-pipeline")) -> dict:
    """{distribution: installed version or None} for the libraries that shape an adapter."""
    out = {}
    for n in names:
        try:
            out[n] = metadata.version(n)
        except metadata.PackageNotFoundError:
            out[n] = None
    return out


def file_hashes(directory: Path) -> dict[str, str]:
    """{relative path: sha256} of every regular file under `directory`, the manifest itself excluded."""
    return hashing.file_hashes(directory, exclude=(MANIFEST,))


def read_manifest(directory: Path) -> dict:
    """Load and check `manifest.json` against `Manifest`; returns it as a dict.

    Raises FileNotFoundError (absent) or ValueError (not JSON, or a field of the wrong type),
    naming the file.
    """
    p = Path(directory) / MANIFEST
    try:
        data = json.loads(p.read_text())
    except UnicodeDecodeError as e:
        raise ValueError(f"{p}: not a text file (byte {e.start} is not UTF-8)") from e
    except IsADirectoryError as e:
        raise ValueError(f"{p}: is a directory, not a manifest file") from e
    except json.JSONDecodeError as e:
        raise ValueError(f"{p}: not valid JSON ({e.msg} at line {e.lineno})") from e
    if not isinstance(data, dict):
        raise ValueError(f"{p}: must be a JSON object")
    try:
        Manifest.model_validate(data)
    except ValidationError as e:
        bad = "; ".join(f"{'.'.join(map(str, x['loc']))}: {x['msg']}" for x in e.errors())
        raise ValueError(f"{p}: not a pipeline manifest ({bad})") from e
    return data


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
