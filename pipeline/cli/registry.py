"""Registry commands: `pipeline register`, `pipeline status`, `pipeline ui`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from pipeline import registry
from pipeline.cli._common import JsonOption, adapter_name, err, exit_as, project_config
from pipeline.errors import CheckFailed, UsageError
from pipeline.registry.ui import model_url, start
from pipeline.release.status import collect, render
from pipeline.validate import validate_with_config

app = typer.Typer()


@app.command()
def register(
    adapter: Annotated[
        Path, typer.Argument(help="adapter directory from `pipeline train` (with manifest.json)")
    ],
    name: Annotated[
        str,
        typer.Option(help="registered model name (the fleet's stable adapter name)", callback=adapter_name),
    ],
    base: Annotated[Path | None, typer.Option(help="bf16 base checkpoint dir for validation")] = None,
):
    """Validate, then record the adapter in MLflow as a model version.

    Validate, then record the adapter in MLflow as a model version with alias `candidate`."""
    cfg = project_config()
    if not adapter.is_dir():  # also a symlink loop or a path through a file: before validation reads it
        raise UsageError(
            f"{adapter}: not an adapter directory (give the `adapter/` directory `pipeline train` wrote)"
        )
    rep = validate_with_config(cfg, adapter, base)
    reg = registry.register_adapter(cfg, adapter, name, rep.to_dict())
    typer.echo(
        f"registered {reg.name} version {reg.version} (alias candidate), validation {rep.verdict}, "
        f"model {reg.model_id}, run {reg.run_id}"
    )
    if not rep.passed:  # recorded for lineage, but it must not look like a success
        failed = ", ".join(sorted({c.id for c in rep.checks if c.severity == "error"}))
        err(
            f"validation failed ({failed}): version {reg.version} is registered but `publish` will refuse it; "
            f"see `pipeline validate {adapter}`"
        )
        exit_as(CheckFailed)


@app.command()
def status(
    name: Annotated[
        str | None, typer.Argument(help="registered model (default: all)", callback=adapter_name)
    ] = None,
    as_json: JsonOption = False,
    fleet: Annotated[bool, typer.Option(help="ask the fleet's instances what they serve")] = True,
):
    """Versions, aliases, verdicts, published paths and what instances serve.

    Versions, aliases, validation verdict, published path and what each instance serves."""
    data = collect(project_config(), name, fleet=fleet)
    if as_json:
        typer.echo(json.dumps(data, indent=2))
    else:
        render(data)


@app.command()
def ui(
    port: Annotated[int, typer.Option(help="port on 127.0.0.1 (0: any free port)")] = 5000,
    name: Annotated[str | None, typer.Option(help="model whose page URL to print")] = None,
):
    """Start the MLflow UI on 127.0.0.1 against the project's store.

    Start the MLflow UI on 127.0.0.1 against the project's store; Ctrl-C stops it."""
    cfg = project_config()
    registry.check_store(cfg)  # a store that cannot be used fails now, not after the server's start-up
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
