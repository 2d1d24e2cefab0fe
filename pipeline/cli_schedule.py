"""`pipeline run` (the scheduled job) and `pipeline schedule emit` (its manifests)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

schedule_app = typer.Typer(help="Scheduler manifests that call `pipeline run`.", no_args_is_help=True)


def register(app: typer.Typer) -> None:
    app.command("run")(run_cmd)
    app.add_typer(schedule_app, name="schedule")


def run_cmd(
    config: Annotated[Path, typer.Argument(help="axolotl YAML")],
    name: Annotated[str | None, typer.Option(help="adapter name (default: config stem)")] = None,
    force: Annotated[bool, typer.Option(help="train even if the inputs are unchanged")] = False,
    set_: Annotated[list[str], typer.Option("--set", help="override a config key: key=value")] = [],
    overlay: Annotated[
        list[Path], typer.Option(help="YAML merged over CONFIG, e.g. axolotl_configs/fsdp2.yml")
    ] = [],
    allow: Annotated[list[str], typer.Option(help="accept a setting the fleet refuses (check id)")] = [],
):
    """Retrain if inputs changed, validate, register, gate, publish. Last line: one JSON object.

    Exit codes: 0 published or skipped, 1 check failed, 2 usage, 3 locked, 4 fleet, 5 gated.
    """
    import json
    import sys

    from pipeline.cli import _err, project_config
    from pipeline.config import ConfigError
    from pipeline.errors import GateFailed, PipelineError
    from pipeline.run import run

    try:
        out = run(
            project_config(),
            config,
            name=name,
            force=force,
            overrides=set_,
            overlays=overlay,
            allow=set(allow),
            echo=lambda m: typer.echo(m, err=True),
            show_progress=sys.stderr.isatty(),
        )
    except GateFailed as e:
        _err(str(e))
        typer.echo(e.outcome.to_json())
        raise typer.Exit(e.exit_code) from None
    except (PipelineError, ConfigError, FileNotFoundError) as e:
        _err(str(e))
        code = getattr(e, "exit_code", 2)
        typer.echo(
            json.dumps(
                {
                    "status": "locked" if code == 3 else "failed",
                    "reason": str(e).splitlines()[0],
                    "exit_code": code,
                }
            )
        )
        raise typer.Exit(code) from None
    typer.echo(out.to_json())


@schedule_app.command("emit")
def emit_cmd(
    kind: Annotated[str, typer.Option(help="cronjob | systemd | scrontab")],
    name: Annotated[str, typer.Option(help="adapter name")],
    config: Annotated[str, typer.Option(help="axolotl config path as the job sees it")],
    schedule: Annotated[str, typer.Option(help="cron expression")] = "0 3 * * *",
    gpus: int = 1,
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
    from pydantic import ValidationError

    from pipeline.cli import _err
    from pipeline.schedule import ScheduleSpec, emit

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
        files = emit(kind, spec)
    except (ValidationError, ValueError) as e:
        _err(str(e))
        raise typer.Exit(2) from None
    for fname, text in files.items():
        if out:
            out.mkdir(parents=True, exist_ok=True)
            (out / fname).write_text(text)
            typer.echo(f"wrote {out / fname}")
        else:
            typer.echo(f"# --- {fname}\n{text}")
