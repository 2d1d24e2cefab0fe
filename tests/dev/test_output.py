"""Where `pipeline dev tiny-base` / `real-base` may write (new-user finding: `tiny-base ""` removed
every file in the working directory; `tiny-base ADAPTER_DIR` silently replaced an adapter)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.dev.output import check_output_dir, write_whole
from pipeline.errors import UsageError


@pytest.mark.parametrize("out", ["", ".", "..", "./", "/"])
def test_the_working_directory_and_its_parents_are_refused(tmp_path, monkeypatch, out):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "precious.txt").write_text("keep")
    r = CliRunner().invoke(app, ["dev", "tiny-base", out])
    assert r.exit_code == 2, r.output
    assert (tmp_path / "precious.txt").read_text() == "keep"
    with pytest.raises(UsageError):
        check_output_dir(tmp_path)  # the working directory by absolute path


def test_a_directory_that_is_no_checkpoint_is_never_replaced(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    adapter = tmp_path / "ad"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    r = CliRunner().invoke(app, ["dev", "tiny-base", "ad"])
    assert r.exit_code == 2 and "no model checkpoint" in r.output
    assert [p.name for p in adapter.iterdir()] == ["adapter_config.json"]


def test_a_checkpoint_or_an_empty_directory_is_replaced_whole(tmp_path):
    old = tmp_path / "base"
    old.mkdir()
    (old / "config.json").write_text("{}")
    (old / "stale.safetensors").write_text("old")
    with write_whole(old) as partial:
        assert partial.name == "base.partial"
        (partial / "config.json").write_text('{"new": 1}')
    assert sorted(p.name for p in old.iterdir()) == ["config.json"]
    assert not (tmp_path / "base.partial").exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    assert check_output_dir(empty) == empty


def test_a_failed_build_leaves_out_as_it_was(tmp_path):
    old = tmp_path / "base"
    old.mkdir()
    (old / "config.json").write_text("old")
    with pytest.raises(RuntimeError), write_whole(old) as partial:
        (partial / "config.json").write_text("half")
        raise RuntimeError("killed mid-write")
    assert (old / "config.json").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base"]


def test_tiny_base_seed_out_of_range_writes_nothing(tmp_path):
    r = CliRunner().invoke(
        app, ["dev", "tiny-base", str(tmp_path / "b"), "--seed", "99999999999999999999999"]
    )
    assert r.exit_code == 2 and not (tmp_path / "b").exists()
