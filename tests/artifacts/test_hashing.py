"""Only regular files inside a directory are hashed, listed, copied or registered (issue 16 section 3)."""

import os

import pytest

from pipeline.artifacts.hashing import UnsafeFileError, file_hashes, scan_directory


def test_regular_files_are_hashed(tmp_path):
    (tmp_path / "a.txt").write_text("a")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.txt").write_text("b")
    assert set(file_hashes(tmp_path)) == {"a.txt", "sub/b.txt"}


@pytest.mark.parametrize("kind", ["symlink_file", "symlink_outside", "symlink_dir", "fifo", "dangling"])
def test_unsafe_entries_are_refused_with_their_name(tmp_path, kind):
    (tmp_path / "a.txt").write_text("a")
    name = {
        "symlink_file": lambda: os.symlink(tmp_path / "a.txt", tmp_path / "x"),
        "symlink_outside": lambda: os.symlink("/etc/shadow", tmp_path / "x"),
        "symlink_dir": lambda: os.symlink("/etc", tmp_path / "x"),
        "fifo": lambda: os.mkfifo(tmp_path / "x"),
        "dangling": lambda: os.symlink(tmp_path / "nowhere", tmp_path / "x"),
    }[kind]
    name()
    scan = scan_directory(tmp_path)
    assert [p.name for p, _ in scan.unsafe] == ["x"] and [p.name for p in scan.files] == ["a.txt"]
    with pytest.raises(UnsafeFileError, match=r"x \("):
        file_hashes(tmp_path)


def test_the_directory_itself_may_be_reached_through_a_link(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "a.txt").write_text("a")
    os.symlink(tmp_path / "real", tmp_path / "link")
    assert list(file_hashes(tmp_path / "link")) == ["a.txt"]
