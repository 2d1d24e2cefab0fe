"""Issue 41.5: `train` could not show the resolved config and the launcher command without training."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from pipeline.cli import app
from tests.support.helpers import REPO


def test_train_dry_run_prints_the_resolved_config_and_command_and_writes_nothing(
    project, tiny_base, monkeypatch
):
    monkeypatch.chdir(REPO)  # the config's dataset paths are relative to the repo
    config = str(REPO / "axolotl_configs" / "tiny-cpu.yml")
    args = ["train", config, "--set", f"base_model={tiny_base}", "--set", "max_steps=3", "--dry-run"]
    r = CliRunner().invoke(app, [*args, "--json"])
    assert r.exit_code == 0, r.output
    plan = json.loads(r.stdout)
    run_dir = plan["run_dir"]
    assert run_dir.startswith(str(project.train.runs_dir / "tiny-cpu-"))
    assert plan["command"][-4:] == ["train", f"{run_dir}/resolved.yml", "--launcher", "python"]
    resolved = plan["resolved_config"]
    assert resolved["max_steps"] == 3 and resolved["output_dir"] == f"{run_dir}/output"
    assert resolved["base_model"] == str(tiny_base) and "mlflow_tracking_uri" not in resolved
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    assert "would launch: " in r.stdout and "resolved.yml:\nbase_model: " in r.stdout
    assert r.stdout.rstrip().endswith("(dry run: nothing changed)")
    assert not project.train.runs_dir.exists() and not project.store_exists()
    # the checks still run: a key axolotl does not know is refused, as without --dry-run
    r = CliRunner().invoke(app, [*args, "--set", "learning_rat=0.1"])
    assert r.exit_code == 1 and "learning_rat" in r.output and "learning_rate" in r.output, r.output
