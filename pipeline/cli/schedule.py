"""`pipeline schedule emit`: scheduler manifests that call `pipeline run`."""

from __future__ import annotations

import os
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer
from pydantic import ValidationError

from pipeline.artifacts.modes import FILE_MODE, make_dir
from pipeline.artifacts.names import check_name
from pipeline.cli._common import adapter_name, project_config
from pipeline.errors import UsageError
from pipeline.jobs.schedule import ScheduleSpec, emit
from pipeline.redact import redact_uri

app = typer.Typer(help="Scheduler manifests that call `pipeline run`.", no_args_is_help=True)


def _project_yaml() -> Path | None:
    """This project's pipeline.yaml (`--config`, $PIPELINE_CONFIG, or found up the tree), if any."""
    cfg = project_config()
    return cfg.source if cfg.source and cfg.source.is_file() else None


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
    config: Annotated[str, typer.Option(help="axolotl config path as the job sees it")],
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
        str, typer.Option(help="the project directory the job runs in (systemd/scrontab: its pipeline.yaml)")
    ] = "/srv/lora-pipeline",
    pipeline_yaml: Annotated[
        Path | None,
        typer.Option(help="cronjob: the pipeline.yaml to put in the ConfigMap (default: this project's)"),
    ] = None,
    out: Annotated[Path | None, typer.Option(help="directory to write files into (default: stdout)")] = None,
):
    """Print (or write) a Kubernetes CronJob, systemd service+timer, or Slurm scrontab entry.

    The CronJob comes with its ConfigMap (pipeline.yaml) and a header naming the image, Secret
    keys and volume claims it needs; systemd and Slurm run the absolute path of `pipeline`."""
    text = ""
    _check_name_for_job(name, pipeline_yaml if kind is Kind.cronjob else Path(workdir) / "pipeline.yaml")
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
            gpus=gpus,
            image=image,
            pipeline_bin=pipeline_bin,
            workdir=workdir,
            pipeline_yaml=text,
        )
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
    for fname, text in files.items():
        if out:
            make_dir(out)  # 0755 and 0644 whatever the umask: nobody else may edit what a scheduler runs
            (out / fname).write_text(text)
            os.chmod(out / fname, FILE_MODE)
            typer.echo(f"wrote {out / fname}")
        else:
            typer.echo(f"# --- {fname}\n{text}")
