"""`pipeline schedule emit`: scheduler manifests that call `pipeline run`."""

from __future__ import annotations

import os
import pwd
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import click
import typer
from pydantic import ValidationError

from pipeline.artifacts.modes import FILE_MODE, make_dir, writable_problem
from pipeline.artifacts.names import check_name
from pipeline.cli._common import CONFIG_META, DryRunOption, adapter_name, log, print_plan, project_config
from pipeline.errors import UsageError
from pipeline.jobs.schedule import ScheduleSpec, emit, scrontab_log_dir
from pipeline.jobs.schedule_checks import host_job
from pipeline.redact import redact_uri

app = typer.Typer(help="Scheduler manifests that call `pipeline run`.", no_args_is_help=True)


def _project_yaml() -> Path | None:
    """This project's pipeline.yaml (`--config`, $PIPELINE_CONFIG, or found up the tree), if any."""
    cfg = project_config()
    return cfg.source if cfg.source and cfg.source.is_file() else None


def _check_host_job(spec: ScheduleSpec, kind: str, log_dir: Path | None, no_check: bool) -> None:
    """Fill `spec` from the checks the job will make (pipeline.jobs.schedule_checks): the project
    config to pin, `User=` (this user, whose access was checked), what must exist where; raises
    UsageError listing what would fail, unless `no_check` (then it is logged and in the header)."""
    ctx = click.get_current_context(silent=True)
    explicit = (ctx.meta.get(CONFIG_META) if ctx else None) or os.environ.get("PIPELINE_CONFIG")
    job = host_job(
        Path(spec.workdir), spec.config, spec.executable(kind), Path(explicit) if explicit else None, log_dir
    )
    spec.project_config = job.project_config
    spec.needs = job.needs
    if os.geteuid() != 0 and kind == "systemd":
        spec.user = pwd.getpwuid(os.geteuid()).pw_name  # a system unit runs as root otherwise
    if job.problems and not no_check:
        raise UsageError(
            f"the {kind} job would fail (checked from {spec.workdir} as uid {os.geteuid()}):\n  "
            + "\n  ".join(job.problems)
            + "\nfix these and emit again, or pass --no-check to emit anyway"
        )
    for p in job.problems:
        log.warning("--no-check: the job would fail: %s", p)
    spec.needs = [*job.needs, *(f"NOT FOUND WHEN EMITTED: {p}" for p in job.problems)]


def _check_name_for_job(name: str, job_yaml: Path | None) -> None:
    """The job reads its own pipeline.yaml (`--pipeline-yaml`, or `<workdir>/pipeline.yaml` here): the
    name must not take a name its fleet serves the base model under either (the callback checked this
    project's). A unit emitted with one would exit 2 on every run."""
    if job_yaml is None or not job_yaml.is_file():
        return
    from pipeline.config import load_config  # lazy: pydantic-settings (~0.4 s), as `project_config` loads it

    check_name(
        name, f"adapter name (for the job's {job_yaml})", served=load_config(job_yaml).served_base_names
    )


class Kind(StrEnum):
    cronjob = "cronjob"  # Kubernetes CronJob
    systemd = "systemd"  # service + timer
    scrontab = "scrontab"  # Slurm


@app.command("emit")
def emit_cmd(
    kind: Annotated[Kind, typer.Option(help="scheduler")],
    name: Annotated[str, typer.Option(help="adapter name", callback=adapter_name)],
    config: Annotated[
        str,
        typer.Option(
            help="the axolotl config: systemd/scrontab, relative to --workdir as the job reads it; cronjob, "
            "read here and shipped in the ConfigMap with its paths on the pod's mounts"
        ),
    ],
    schedule: Annotated[
        str, typer.Option(help="cron expression, 5 fields (minute hour day-of-month month day-of-week)")
    ] = "0 3 * * *",
    gpus: Annotated[int, typer.Option(min=0, help="GPUs per run (0: CPU)")] = 1,
    image: Annotated[
        str | None, typer.Option(help="container image with lora-pipeline installed (cronjob: required)")
    ] = None,
    pipeline_bin: Annotated[
        str | None,
        typer.Option(
            help="the `pipeline` executable: absolute for systemd/scrontab (default: this one, "
            "e.g. /srv/lora-pipeline/.venv/bin/pipeline); cronjob: `pipeline` on the image's PATH"
        ),
    ] = None,
    workdir: Annotated[
        str | None,
        typer.Option(
            help="systemd/scrontab: the project directory the job runs in (default: the current one); "
            "checked from here unless --no-check"
        ),
    ] = None,
    timezone: Annotated[
        str, typer.Option(help="IANA time zone of --schedule (systemd, cronjob)")
    ] = "Etc/UTC",
    no_check: Annotated[
        bool,
        typer.Option(
            "--no-check",
            help="emit even when the job would fail from here (e.g. for another machine); the file's "
            "header lists what must exist where",
        ),
    ] = False,
    pipeline_yaml: Annotated[
        Path | None,
        typer.Option(help="cronjob: the pipeline.yaml to put in the ConfigMap (default: this project's)"),
    ] = None,
    out: Annotated[Path | None, typer.Option(help="directory to write files into (default: stdout)")] = None,
    dry_run: DryRunOption = False,
):
    """Print (or write) a Kubernetes CronJob, systemd service+timer, or Slurm scrontab entry.

    systemd and Slurm run the absolute path of `pipeline` in --workdir; the checks the job will make
    run first, from there (config found and valid, data files and base there, state, runs, prepared
    datasets and volume writable), and a failing one refuses the emit (exit 2) unless --no-check.
    The CronJob comes with its ConfigMap (pipeline.yaml and the training config, its paths on the
    pod's mounts) and a header naming the image, Secret keys, volume claims and the files the
    datasets claim must hold.

    Example: pipeline schedule emit --kind systemd --name my-task --config my-task.yml --out schedule/"""
    text = ""
    if out is not None and (problem := writable_problem("--out", out)):
        raise UsageError(problem)
    _check_name_for_job(
        name, pipeline_yaml if kind is Kind.cronjob else Path(workdir or Path.cwd()) / "pipeline.yaml"
    )
    if kind is Kind.cronjob:
        src = pipeline_yaml or _project_yaml()
        if src is not None:
            try:
                text = src.read_text()
            except (OSError, UnicodeDecodeError) as e:
                raise UsageError(f"--pipeline-yaml {src}: cannot read it ({e})") from None
            if redact_uri(text) != text:  # a ConfigMap is readable by anyone who can read the namespace
                raise UsageError(
                    f"--pipeline-yaml {src}: holds a URI with credentials (user:password@); a ConfigMap is "
                    "not secret: put them in the Secret (MLFLOW_TRACKING_URI, MLFLOW_TRACKING_PASSWORD)"
                )
    try:
        spec = ScheduleSpec(
            name=name,
            config=config,
            schedule=schedule,
            timezone=timezone,
            gpus=gpus,
            image=image,
            pipeline_bin=pipeline_bin,
            workdir=str(Path(workdir or Path.cwd()).absolute()),
            pipeline_yaml=text,
            project_dir=str(Path.cwd()),
        )
        log_dir = None
        if kind is not Kind.cronjob:
            log_dir = Path(scrontab_log_dir(spec)) if kind is Kind.scrontab else None
            _check_host_job(spec, kind.value, log_dir, no_check)
        files = emit(kind.value, spec)
    except ValidationError as e:  # one line per field, never pydantic's dump
        raise UsageError(
            "; ".join(
                f"--{'-'.join(map(str, x['loc'])).replace('_', '-')}: {str(x['msg']).removeprefix('Value error, ')}"
                for x in e.errors()
            )
        ) from None
    except ValueError as e:
        raise UsageError(str(e)) from None
    if dry_run:  # the checks above ran; print what would be written and created, write nothing
        lines = []
        if log_dir is not None and Path(spec.workdir).is_dir() and not log_dir.exists():
            lines.append(f"would create {log_dir} (the scrontab's --output directory)")
        for fname, text in files.items():
            if out:
                lines.append(f"would {'replace' if (out / fname).exists() else 'write'} {out / fname}")
            lines.append(f"# --- {fname}\n{text}")
        return print_plan({}, False, lines)
    if log_dir is not None and Path(spec.workdir).is_dir() and not log_dir.exists():
        log_dir.mkdir(parents=True)  # Slurm opens --output there and does not create directories
        log.info("created %s (the scrontab's --output directory)", log_dir)
    for fname, text in files.items():
        if out:
            make_dir(out)  # 0755 and 0644 whatever the umask: nobody else may edit what a scheduler runs
            (out / fname).write_text(text)
            os.chmod(out / fname, FILE_MODE)
            typer.echo(f"wrote {out / fname}")
        else:
            typer.echo(f"# --- {fname}\n{text}")
