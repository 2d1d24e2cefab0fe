"""`pipeline schedule emit`: scheduler manifests that call `pipeline run`."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer
from pydantic import ValidationError

from pipeline.cli._common import adapter_name
from pipeline.errors import UsageError
from pipeline.jobs.schedule import ScheduleSpec, emit

app = typer.Typer(help="Scheduler manifests that call `pipeline run`.", no_args_is_help=True)


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
        str, typer.Option(help="container image (cronjob)")
    ] = "registry.example.com/lora-pipeline:latest",
    pipeline_bin: Annotated[
        str, typer.Option(help="path of the `pipeline` executable (systemd/scrontab)")
    ] = "pipeline",
    workdir: str = "/srv/lora-pipeline",
    out: Annotated[Path | None, typer.Option(help="directory to write files into (default: stdout)")] = None,
):
    """Print (or write) a Kubernetes CronJob, systemd service+timer, or Slurm scrontab entry."""
    try:
        spec = ScheduleSpec(
            name=name,
            config=config,
            schedule=schedule,
            gpus=gpus,
            image=image,
            pipeline_bin=pipeline_bin,
            workdir=workdir,
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
            out.mkdir(parents=True, exist_ok=True)
            (out / fname).write_text(text)
            typer.echo(f"wrote {out / fname}")
        else:
            typer.echo(f"# --- {fname}\n{text}")
