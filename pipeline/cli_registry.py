"""CLI commands for the registry area, registered on the main app by `pipeline.cli`.

Keep this module light: import heavy libraries inside the command functions.
"""

from __future__ import annotations

import json
import os
from typing import Annotated

import typer


def register(app: typer.Typer) -> None:
    """Add this area's commands (or sub-apps) to the main `pipeline` app."""
    from pipeline.cli import handle_errors, project_config

    @app.command()
    @handle_errors
    def promote(
        name: Annotated[str, typer.Argument(help="registered model name")],
        version: Annotated[int, typer.Argument(help="model version to ship")],
    ):
        """Move alias `production` to VERSION and publish it (volume, then the fleet if configured)."""
        from pipeline.publish import publish

        res = publish(project_config(), name, version=version)
        prev = (
            f" (previous: v{res.previous_production})"
            if res.previous_production not in (None, res.version)
            else ""
        )
        typer.echo(f"promoted {res.name} v{res.version} to production{prev}: {res.path}")

    @app.command()
    @handle_errors
    def status(
        name: Annotated[str | None, typer.Argument(help="registered model (default: all)")] = None,
        as_json: Annotated[bool, typer.Option("--json", help="machine-readable")] = False,
        fleet: Annotated[bool, typer.Option(help="ask the fleet's instances what they serve")] = True,
    ):
        """Versions, aliases, validation verdict, published path and what each instance serves."""
        from pipeline.status import collect, render

        data = collect(project_config(), name, fleet=fleet)
        if as_json:
            typer.echo(json.dumps(data, indent=2))
        else:
            render(data)

    @app.command()
    @handle_errors
    def ui(
        port: Annotated[int, typer.Option(help="port on 127.0.0.1 (0: any free port)")] = 5000,
        name: Annotated[str | None, typer.Option(help="model whose page URL to print")] = None,
    ):
        """Start the MLflow UI on 127.0.0.1 against the project's store; Ctrl-C stops it."""
        from pipeline import registry
        from pipeline.ui import model_url, start

        cfg = project_config()
        if registry.is_server_uri(cfg.tracking_uri):
            typer.echo(f"the registry is a server: {model_url(cfg.tracking_uri, name)}")
            return
        typer.echo(f"starting mlflow server (log: {cfg.state_dir / 'mlflow-ui.log'}) ...")
        server = start(cfg, port=port)
        try:
            names = [name] if name else registry.model_names(cfg)
            typer.echo(f"MLflow UI: {model_url(server.url)}")
            for n in names:
                typer.echo(f"  {n}: {model_url(server.url, n)}")
            typer.echo("Ctrl-C to stop")
            server.proc.wait()
        except KeyboardInterrupt:
            pass
        finally:
            server.stop()

    @app.command("follow-alias")
    @handle_errors
    def follow_alias_cmd(
        alias: Annotated[str, typer.Argument(help="alias to follow")] = "production",
        interval: Annotated[float, typer.Option(help="seconds between registry polls")] = 30.0,
        once: Annotated[bool, typer.Option(help="poll once and exit")] = False,
        name: Annotated[
            list[str] | None, typer.Option("--name", help="models to follow (default: all)")
        ] = None,
        webhook_port: Annotated[
            int | None, typer.Option(help="also take MLflow webhooks on 127.0.0.1:PORT")
        ] = None,
        webhook_host: Annotated[str, typer.Option(help="webhook listen address")] = "127.0.0.1",
        webhook_secret_env: Annotated[str, typer.Option(help="env var holding the webhook's HMAC secret")] = (
            "PIPELINE_WEBHOOK_SECRET"
        ),
    ):
        """Publish a model's ALIAS version whenever the alias moves (e.g. in the MLflow UI)."""
        import contextlib
        import threading

        from pipeline.errors import UsageError
        from pipeline.follow import WebhookReceiver, follow_alias

        cfg = project_config()
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
                done = follow_alias(
                    cfg, alias, interval, once, names=name or None, echo=typer.echo, wake=wake
                )
            except KeyboardInterrupt:
                return
        if once:
            typer.echo(f"published {len(done)} version(s)")
