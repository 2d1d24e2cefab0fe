"""`pipeline config show`: the effective project config."""

from __future__ import annotations

import json

import typer

from pipeline.cli._common import JsonOption, project_config

app = typer.Typer(help="The project config file (pipeline.yaml).", no_args_is_help=True)


@app.command("show")
def show(as_json: JsonOption = False):
    """Print the effective config (file + environment overrides + defaults); API keys are never shown."""
    cfg = project_config()
    data = json.loads(cfg.model_dump_json())
    data["source"] = str(cfg.source) if cfg.source else None
    data["effective"] = {
        "tracking_uri": cfg.tracking_uri,
        "artifact_root": str(cfg.artifact_root),
        "project_root": str(cfg.root),
        "project_found": cfg.found,  # False: no pipeline.yaml or .state/mlflow.db up the tree
        "store_exists": cfg.store_exists(),
    }
    if as_json:
        typer.echo(json.dumps(data, indent=2))
    else:
        import yaml

        typer.echo(yaml.safe_dump(data, sort_keys=False))
