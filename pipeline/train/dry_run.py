"""`pipeline train --dry-run`: the resolved config and the launcher command, without training.

The same option handling and config checks as `pipeline.train.launch.train` (the launcher and
strategy, `--set`/`--overlay`/`-- key value`, the fleet's rules, axolotl's own schema); then the
config axolotl would run (`launch.resolve`) and its command line (`launch.launcher_command`) for a
run directory named as `train` would name it. Nothing is written and no MLflow run is created;
the datasets are not read (`pipeline dataset check` reads them; `train` checks them first).
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path

from pipeline.artifacts.names import check_name, default_name
from pipeline.config import ProjectConfig
from pipeline.train.config import check_training_config
from pipeline.train.launch import launcher_command, resolve, training_setup
from pipeline.train.preflight import detect_gpus, packing_problems
from pipeline.train.schema import check_axolotl_schema
from pipeline.validate.report import FleetRules


def training_plan(
    cfg: ProjectConfig,
    config_path: Path,
    *,
    overrides: list[str] = (),
    overlays: list[Path] = (),
    allow: set[str] = frozenset(),
    name: str | None = None,
    gpus: int = 1,
    launcher: str | None = None,
    launcher_args: list[str] = (),
    strategy: str = "auto",
) -> dict:
    """What `train` with these arguments would run, as a JSON-ready dict: `run_dir`, `resolved_config`
    (the dict `resolved.yml` would hold), `command` (argv), `launcher`, `processes`, `strategy`.

    Raises what `train` raises before it writes anything about the config: UsageError (bad option,
    key or value), CheckFailed (a setting the fleet refuses, axolotl's validation).
    """
    name = check_name(
        name or default_name(Path(config_path).stem),
        "adapter name (--name, default: from the config file name)",
    )
    tc, plan = training_setup(
        Path(config_path), list(overrides), list(overlays), gpus, launcher, list(launcher_args), strategy
    )
    check_training_config(
        tc, FleetRules.from_config(cfg), set(allow), packing=packing_problems(tc, detect_gpus())
    )
    check_axolotl_schema(tc)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%S%fZ")
    run_dir = cfg.train.runs_dir / f"{name}-{stamp}"
    resolved = resolve(tc, run_dir, cfg)
    return {
        "dry_run": True,
        "action": "train",
        "name": name,
        "run_dir": str(run_dir),
        "launcher": plan.launcher,
        "processes": plan.world,
        "strategy": (
            {"strategy": plan.choice.strategy, "reason": plan.choice.reason} if plan.choice else None
        ),
        "command": launcher_command(run_dir / "resolved.yml", plan.gpus, plan.launcher, plan.launcher_args),
        "resolved_config": resolved,
    }
