"""The checks `pipeline run` will make, made by `pipeline schedule emit` before it writes a unit.

A systemd unit or scrontab line that cannot start fails every night, silently: a `PIPELINE_CONFIG`
naming a pipeline.yaml that does not exist (exit 2, `config file not found`), an axolotl config
or data file that is not where the job looks, a store or volume the job's user cannot write.
`host_job` looks from the job's working directory, as the job's user (this one: the emitted
unit sets `User=` to it), at what the job reads first, in the order `pipeline.jobs.run.run` reads it:

- the project config as the job will find it: `--config`/`$PIPELINE_CONFIG` of this command
  (pinned in the unit), else the `pipeline.yaml` found up the tree from the working directory
  (pinned), else the project the job finds from there the same way (`.state/mlflow.db`; nothing
  pinned), loaded and validated (`pipeline.config.load_config`);
- the axolotl config (relative to the working directory), its data files and base, and the
  fleet's rules (`pipeline.train.config.check_training_config`: what the run checks before its
  inputs-unchanged skip);
- the places the job writes: the state directory (locks, the embedded store), the runs
  directory, the prepared datasets' directory, the adapter volume: each must be writable (or
  creatable) by this user;
- the `pipeline` executable, and Slurm's `--output` directory (Slurm does not create it).

Nothing is written. `HostJob.problems` is what would fail, one line each, naming the path and how
to fix it; `HostJob.needs` lists what the job needs to exist where (the unit's header says it).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.artifacts.modes import writable_problem
from pipeline.config import find_project, load_config
from pipeline.errors import PipelineError
from pipeline.train.config import check_training_config, load_training_config
from pipeline.train.prepared import prepared_root
from pipeline.validate.report import FleetRules


@dataclass
class HostJob:
    """What a systemd/Slurm job on this host will find: the pipeline.yaml to pin (None: the job
    finds the project from its working directory), what is wrong, and what must exist where."""

    project_config: str | None = None
    problems: list[str] = field(default_factory=list)
    needs: list[str] = field(default_factory=list)


def host_job(
    workdir: Path, config: str, executable: str, explicit_project: Path | None, log_dir: Path | None = None
) -> HostJob:
    """The checks of a systemd/Slurm job that runs `executable run CONFIG` in `workdir` (module doc).

    `explicit_project`: this command's `--config` or `$PIPELINE_CONFIG` (pinned in the unit);
    `log_dir`: Slurm's `--output` directory. Raises nothing: every failure is a `problems` line.
    """
    out = HostJob()
    workdir = Path(workdir)
    if not workdir.is_absolute():
        out.problems.append(f"--workdir {workdir}: give an absolute path (the job's working directory)")
        return out
    out.needs.append(f"the project directory {workdir} (the job's working directory)")
    if not workdir.is_dir():
        out.problems.append(
            f"--workdir {workdir}: no such directory here; emit on the machine that runs the job, from the "
            "project directory (or pass --no-check to emit anyway)"
        )
        return out
    if not os.access(executable, os.X_OK) or not Path(executable).is_file():
        out.problems.append(f"{executable}: not an executable file here (--pipeline-bin)")
    with contextlib.chdir(workdir):
        pinned = explicit_project.resolve() if explicit_project else find_project(workdir)[0]
        out.project_config = str(pinned) if pinned else None
        try:
            cfg = load_config(pinned)
        except PipelineError as e:
            out.problems.append(f"project config: {e}")
            return out
        out.needs.append(
            f"the project config {pinned}"
            if pinned
            else f"the project found from {workdir} ({cfg.root}; embedded store {cfg.embedded_store})"
        )
        cpath = Path(config)
        out.needs.append(f"the axolotl config {cpath if cpath.is_absolute() else workdir / cpath}")
        try:
            tc = load_training_config(cpath)
            check_training_config(tc, FleetRules.from_config(cfg), set())
        except PipelineError as e:
            out.problems.extend(
                f"--config {config}: {line.strip()}" for line in str(e).splitlines() if line.strip()
            )
            tc = None
        if tc is not None:
            for key in ("datasets", "test_datasets"):
                out.needs.extend(f"{key} file {workdir / p}" for p in tc.dataset_paths(key))
            base = str(tc.data.get("base_model") or "")
            if base and Path(base).exists():
                out.needs.append(f"base_model {(workdir / base).resolve()}")
        writes = [
            ("state_dir (locks, the embedded store)", cfg.state_dir),
            ("train.runs_dir", cfg.train.runs_dir),
            ("volume.path (the adapter volume)", cfg.volume.path),
        ]
        if tc is not None:
            writes.append(("dataset_prepared_path", prepared_root(tc.data, cfg.state_dir, cfg.root)))
        if log_dir is not None:
            writes.append(("Slurm --output directory", log_dir))
        for what, path in writes:
            out.needs.append(f"{what} {path}, writable")
            if msg := writable_problem(what, path):
                out.problems.append(msg)
    return out
