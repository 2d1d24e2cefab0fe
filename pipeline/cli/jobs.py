"""Jobs a scheduler or a sidecar runs: `pipeline run` and `pipeline follow-alias`."""

from __future__ import annotations

import contextlib
import json
import os
import threading
from pathlib import Path
from typing import Annotated

import typer

from pipeline.cli._common import (
    adapter_name,
    as_pipeline_error,
    err,
    exit_code_for,
    finite,
    log,
    project_config,
)
from pipeline.errors import GateFailed, UsageError
from pipeline.jobs.follow import WebhookReceiver, follow_alias
from pipeline.jobs.run import run

app = typer.Typer()


@app.command("run")
def run_cmd(
    config: Annotated[Path, typer.Argument(help="axolotl YAML")],
    name: Annotated[
        str | None, typer.Option(help="adapter name (default: config stem)", callback=adapter_name)
    ] = None,
    force: Annotated[bool, typer.Option(help="train even if the inputs are unchanged")] = False,
    set_: Annotated[list[str], typer.Option("--set", help="override a config key: key=value")] = [],
    overlay: Annotated[
        list[Path], typer.Option(help="YAML merged over CONFIG, e.g. axolotl_configs/fsdp2.yml")
    ] = [],
    allow: Annotated[list[str], typer.Option(help="accept a setting the fleet refuses (check id)")] = [],
):
    """The scheduled job: retrain if inputs changed, validate, register, publish.

    Retrain if inputs changed, validate, register, gate, publish. Last line: one JSON object.

    Exit codes: 0 published or skipped, 1 check failed, 2 usage, 3 locked, 4 fleet, 5 gated.
    """
    try:
        out = run(
            project_config(),
            config,
            name=name,
            force=force,
            overrides=set_,
            overlays=overlay,
            allow=set(allow),
            echo=log.info,
            show_progress=True,  # a bar on a terminal, a progress line every 30 s otherwise
        )
    except GateFailed as e:
        err(str(e))
        typer.echo(e.outcome.to_json())
        raise typer.Exit(exit_code_for(e)) from None
    except Exception as e:
        code = exit_code_for(e)
        if code is None:
            e = as_pipeline_error(e)
            if e is None:
                raise
            code = exit_code_for(e)
        err(str(e))
        status = "locked" if code == 3 else "failed"
        typer.echo(json.dumps({"status": status, "reason": str(e).splitlines()[0], "exit_code": code}))
        raise typer.Exit(code) from None
    typer.echo(out.to_json())


@app.command("follow-alias")
def follow_alias_cmd(
    alias: Annotated[str, typer.Argument(help="alias to follow")] = "production",
    interval: Annotated[
        float, typer.Option(min=0.1, callback=finite, help="seconds between registry polls")
    ] = 30.0,
    once: Annotated[bool, typer.Option(help="poll once and exit")] = False,
    name: Annotated[
        list[str] | None,
        typer.Option("--name", help="models to follow (default: all)", callback=adapter_name),
    ] = None,
    webhook_port: Annotated[
        int | None, typer.Option(min=0, max=65535, help="also take MLflow webhooks on 127.0.0.1:PORT")
    ] = None,
    webhook_host: Annotated[str, typer.Option(help="webhook listen address")] = "127.0.0.1",
    webhook_secret_env: Annotated[
        str, typer.Option(help="env var holding the webhook's HMAC secret")
    ] = "PIPELINE_WEBHOOK_SECRET",
):
    """Publish a model's ALIAS version whenever the alias moves.

    Publish a model's ALIAS version whenever the alias moves (e.g. in the MLflow UI)."""
    cfg = project_config(store="read")  # a sidecar may start before the first registration
    wake = threading.Event()
    ctx = contextlib.nullcontext()
    if webhook_port is not None:
        secret = os.environ.get(webhook_secret_env, "")
        if not secret:
            raise UsageError(f"--webhook-port needs the HMAC secret in ${webhook_secret_env}")
        ctx = WebhookReceiver(webhook_host, webhook_port, secret, wake, alias=alias)
        typer.echo(f"webhook receiver: {ctx.url}")
    with ctx:
        try:
            done = follow_alias(cfg, alias, interval, once, names=name or None, echo=typer.echo, wake=wake)
        except KeyboardInterrupt:
            return
    if once:
        typer.echo(f"published {len(done)} version(s)")
