"""verify_version_dir's in-process cache (what a `fleet sync --watch` pass re-hashes)."""

from __future__ import annotations

import copy
import json
import os

from pipeline.artifacts.hashing import sha256_file
from pipeline.artifacts.volume import verify_version_dir
from tests.artifacts.test_manifest import SCHEMA1_PUBLISHED


def test_a_rewrite_that_restores_size_and_mtime_is_hashed_again(tmp_path):
    """The cache's signature had size, mtime, inode and mode: a byte changed in place with the mtime put
    back (`touch -r`, `os.utime`) kept all four, and the corrupted version verified intact."""
    d = tmp_path / "agent-v1"
    d.mkdir()
    (d / "adapter_config.json").write_text('{"r": 8}')
    (d / "adapter_model.safetensors").write_bytes(b"\x00" * 4096)
    man = copy.deepcopy(SCHEMA1_PUBLISHED)
    man["files"] = {n: sha256_file(d / n) for n in ("adapter_config.json", "adapter_model.safetensors")}
    (d / "manifest.json").write_text(json.dumps(man))
    assert verify_version_dir(d) == []  # hashed, cached

    f = d / "adapter_model.safetensors"
    st = f.stat()
    with open(f, "r+b") as fh:  # one byte, in place: same inode, same size
        fh.seek(100)
        fh.write(b"\x01")
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    after = f.stat()
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == (st.st_size, st.st_mtime_ns, st.st_ino)
    problems = verify_version_dir(d)
    assert len(problems) == 1 and "adapter_model.safetensors" in problems[0], problems
