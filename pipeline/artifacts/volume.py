"""The adapter volume's layout: where version `N` of adapter `NAME` lives and what it is called.

    <volume>/<NAME>-v<N>/      one immutable directory per version (adapter + manifest.json)
    <volume>/.staging/         publishes in progress (same filesystem: the final step is a rename)

The directory name is also the name fleet instances serve the version under (vLLM's
filesystem resolver maps a requested model id to `<dir>/<id>`). Directories are never
modified after creation: vLLM never re-reads a resolved adapter and keys its prefix cache on
the adapter's name (docs/vllm.md).
"""

from __future__ import annotations

import re
from pathlib import Path

STAGING = ".staging"
VERSION_RE = re.compile(r"^(?P<name>.+)-v(?P<version>\d+)$")


def version_name(name: str, version: int) -> str:
    """`NAME-vN`: the version directory's name and the served name of that version."""
    return f"{name}-v{version}"


def version_dir(volume: Path, name: str, version: int) -> Path:
    """`<volume>/<NAME>-v<N>`."""
    return Path(volume) / version_name(name, version)


def parse_version_name(dirname: str) -> tuple[str, int] | None:
    """(`NAME`, N) for a `NAME-vN` directory name, else None."""
    m = VERSION_RE.match(dirname)
    return (m["name"], int(m["version"])) if m else None
