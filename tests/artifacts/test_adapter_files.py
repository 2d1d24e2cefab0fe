"""What the pipeline copies out of an adapter directory is bounded by what an adapter is (issue 30 kind 1).

Unit level: `copy_adapter` (register and publish both copy through it) on plain files; the
end-to-end cases (register refuses, nothing is published) are in tests/release/test_links.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pipeline.artifacts.adapter_files import (
    ADAPTER_FILES,
    UnsafeAdapterError,
    adapter_file_problems,
    copy_adapter,
)


def _adapter(d: Path) -> Path:
    d.mkdir()
    (d / "adapter_config.json").write_text('{"r": 8}')
    (d / "adapter_model.safetensors").write_bytes(b"\0" * 64)
    (d / "manifest.json").write_text("{}")
    return d


def _kinds(d: Path) -> list[tuple[str, str]]:
    return [(p.path.name, p.kind) for p in adapter_file_problems(d)]


def test_a_plain_adapter_is_copied_whole(tmp_path):
    src = _adapter(tmp_path / "a")
    assert copy_adapter(src, tmp_path / "out") == sorted(p.name for p in src.iterdir())
    for p in src.iterdir():
        assert (tmp_path / "out" / p.name).read_bytes() == p.read_bytes()
        assert (tmp_path / "out" / p.name).stat().st_mode & 0o777 == 0o644


def test_hard_link_to_a_root_only_file_is_refused(tmp_path):
    """The issue's instance: a hard link is a regular file, so it was copied and published 0444."""
    secret = tmp_path / "shadow"
    secret.write_text("root:$6$secret")
    secret.chmod(0o600)
    src = _adapter(tmp_path / "a")
    os.link(secret, src / "tokenizer.json")
    assert _kinds(src) == [("tokenizer.json", "link")]
    with pytest.raises(UnsafeAdapterError, match="hard link"):
        copy_adapter(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()  # nothing written


@pytest.mark.parametrize("mode", [0o000, 0o200, 0o4644])
def test_secret_mode_is_refused(tmp_path, mode):
    """Sibling: a file its owner cannot read (only root could copy it), or a setuid one, would be
    published world-readable."""
    src = _adapter(tmp_path / "a")
    (src / "README.md").write_text("internal notes")
    (src / "README.md").chmod(mode)
    with pytest.raises(UnsafeAdapterError, match=f"mode {mode:04o} says it is not to be read"):
        copy_adapter(src, tmp_path / "out")


def test_owner_only_weights_are_an_adapter_as_peft_writes_it(tmp_path):
    """safetensors >= 0.8 writes 0600: that is no secret (else no adapter could be published)."""
    import numpy as np
    from safetensors.numpy import save_file

    src = _adapter(tmp_path / "a")
    save_file({"x": np.zeros(2, dtype=np.float32)}, str(src / "adapter_model.safetensors"))
    assert (src / "adapter_model.safetensors").stat().st_mode & 0o777 == 0o600
    assert adapter_file_problems(src) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_file_of_another_user_is_refused(tmp_path):
    """Sibling: a file owned by someone else (here `nobody`) in the directory of the one who publishes."""
    src = _adapter(tmp_path / "a")
    os.chown(src / "adapter_config.json", 65534, 65534)
    assert _kinds(src) == [("adapter_config.json", "owner")]
    with pytest.raises(UnsafeAdapterError, match="owned by uid 65534"):
        copy_adapter(src, tmp_path / "out")


def test_only_adapter_files_within_their_sizes(tmp_path):
    """Sibling: copied was whatever the directory held (an `.env`, a subdirectory, a 2 MiB config)."""
    src = _adapter(tmp_path / "a")
    (src / ".env").write_text("AWS_SECRET_ACCESS_KEY=x")
    (src / "checkpoint-10").mkdir()
    (src / "chat_template.jinja").write_bytes(b" " * (ADAPTER_FILES["chat_template.jinja"] + 1))
    os.symlink("/etc/hostname", src / "vocab.json")
    assert _kinds(src) == [
        (".env", "unexpected"),
        ("chat_template.jinja", "size"),
        ("checkpoint-10", "type"),
        ("vocab.json", "type"),
    ]
    with pytest.raises(UnsafeAdapterError) as e:
        copy_adapter(src, tmp_path / "out")
    assert all(n in str(e.value) for n in (".env", "checkpoint-10", "chat_template.jinja", "vocab.json"))


def test_a_file_swapped_for_a_link_after_the_check_is_not_copied(tmp_path, monkeypatch):
    """The copy re-checks the descriptor it reads (opened without following links), not the name."""
    import pipeline.artifacts.adapter_files as af

    src = _adapter(tmp_path / "a")
    real = af._problems

    def check_then_swap(dfd, d):
        found = real(dfd, d)
        (src / "adapter_config.json").unlink()
        os.symlink("/etc/hostname", src / "adapter_config.json")
        return found

    monkeypatch.setattr(af, "_problems", check_then_swap)
    with pytest.raises(OSError):  # ELOOP from O_NOFOLLOW
        copy_adapter(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_the_directory_swapped_for_a_link_after_the_check_is_not_read(tmp_path, monkeypatch):
    """Sibling (a directory replaced between check and use): whoever may rename entries of the adapter's
    parent swapped the checked directory for a link to one of the operator's private directories, whose
    files pass every per-file rule (own, one name, readable by the owner): the copy published them 0444.
    The copy now reads through the one descriptor it checked."""
    import pipeline.artifacts.adapter_files as af

    parent = tmp_path / "drop"  # e.g. a drop directory another user may write
    parent.mkdir()
    src = _adapter(parent / "a")
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    (private / "README.md").write_text("TOP SECRET")
    (private / "README.md").chmod(0o600)
    real = af._problems

    def check_then_swap(dfd, d):
        found = real(dfd, d)
        src.rename(parent / "a.checked")
        os.symlink(private, src)
        return found

    monkeypatch.setattr(af, "_problems", check_then_swap)
    names = copy_adapter(src, tmp_path / "out")
    assert names == ["adapter_config.json", "adapter_model.safetensors", "manifest.json"]
    assert not (tmp_path / "out" / "README.md").exists()
