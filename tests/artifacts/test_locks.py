"""Lock files only their owner can open (a sibling of issue 30 kinds 1 and 5: what another local user may do).

`flock` needs only an open descriptor, read-only will do. The lock files were made with the umask
(0644), so any local account could hold one for ever: `nobody` holding `<volume>/.locks/NAME.lock`
stopped every publish, rollback and prune of NAME; holding `<state_dir>/locks/NAME.lock` made every
scheduled `pipeline run` exit 3 (0 with `--locked-ok`: retraining silently never ran again). The
test as user `nobody` is in tests/registry/test_ui_auth.py; here the modes.
"""

from __future__ import annotations

import os
import stat

import pytest

from pipeline.artifacts.locks import file_lock, try_lock
from tests.support.helpers import REPO, write_project_config


def _mode(p) -> int:
    return stat.S_IMODE(os.stat(p).st_mode)


def test_lock_files_are_made_0600_and_old_ones_set_so(tmp_path):
    new = tmp_path / ".locks" / "agent.lock"
    with file_lock(new, 1, "a publish"):
        assert _mode(new) == 0o600
    old = tmp_path / ".fleet-state.lock"  # as an earlier version left it
    old.write_text("")
    old.chmod(0o644)
    with try_lock(old) as free:
        assert free and _mode(old) == 0o600


def test_the_run_lock_and_the_store_lock(tmp_path, monkeypatch):
    """`pipeline run`'s lock (taken before anything slow) and the store's first-use lock."""
    from pipeline import registry
    from pipeline.config import load_config
    from pipeline.errors import UsageError
    from pipeline.jobs.run import run

    cfg = load_config(write_project_config(tmp_path))
    monkeypatch.chdir(REPO)
    with pytest.raises(UsageError, match="does not exist"):  # after the lock: the base does not exist
        run(
            cfg,
            REPO / "axolotl_configs" / "tiny-cpu.yml",
            name="agent",
            overrides=[f"base_model={tmp_path}/x"],
        )
    assert _mode(cfg.state_dir / "locks" / "agent.lock") == 0o600
    registry.experiment_id(cfg)
    assert _mode(cfg.state_dir / "mlflow-init.lock") == 0o600
