"""`pipeline validate`: an adapter against the base, the served checkpoint and the fleet."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from pipeline.cli._common import JsonOption, exit_as, project_config
from pipeline.errors import CheckFailed, UsageError
from pipeline.validate import REGISTRY, default_base, validate_with_config

app = typer.Typer()


def render_report(rep) -> None:
    """The report as a rich table plus the verdict line."""
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"validation: {rep.adapter}", show_lines=False)
    for col in ("check", "severity", "where", "message"):
        t.add_column(col, overflow="fold")
    colors = {"error": "red", "warning": "yellow", "info": "cyan"}
    for c in rep.checks:
        t.add_row(c.id, f"[{colors.get(c.severity, 'white')}]{c.severity}[/]", c.where, c.message)
    con = Console()
    if rep.checks:
        con.print(t)
    con.print(f"verdict: [bold {'green' if rep.passed else 'red'}]{rep.verdict}[/]  stats: {rep.stats}")


@app.command()
def validate(
    adapter: Annotated[Path, typer.Argument(help="adapter directory")],
    base: Annotated[
        Path | None, typer.Option(help="bf16 base checkpoint dir (headers only are read)")
    ] = None,
    served: Annotated[
        Path | None, typer.Option(help="served checkpoint dir, e.g. NVFP4 (default: served.path)")
    ] = None,
    training_config: Annotated[
        Path | None, typer.Option(help="resolved axolotl config of the run (default: from manifest.json)")
    ] = None,
    behaviour: Annotated[
        bool,
        typer.Option(
            "--behaviour",
            help="also compare eval loss and canary outputs (loads the model: CPU for tiny models)",
        ),
    ] = False,
    fold_rslora: Annotated[
        bool,
        typer.Option(
            "--fold-rslora",
            help="rewrite an rsLoRA adapter's lora_alpha to the "
            "plain-LoRA equivalent (in place, parity-checked) before validating",
        ),
    ] = False,
    allow: Annotated[
        list[str] | None,
        typer.Option("--allow", help="check id whose refusal to override, e.g. serving.version_unknown"),
    ] = None,
    as_json: JsonOption = False,
):
    """Check an adapter against the base, the served checkpoint and the fleet. Exit 0 pass, 1 fail, 2 usage."""
    cfg = project_config()
    if not adapter.is_dir():
        raise UsageError(f"{adapter}: adapter directory not found")
    if base is not None and not base.is_dir():
        raise UsageError(f"{base}: base checkpoint directory not found")
    unknown = sorted(set(allow or ()) - set(REGISTRY))
    if unknown:
        raise UsageError(f"--allow {unknown}: unknown check id (see docs/validation.md)")
    if (base or default_base(cfg, adapter)) is None:
        raise UsageError("no base checkpoint: pass --base DIR or set base.path in pipeline.yaml")
    rep = validate_with_config(
        cfg,
        adapter,
        base,
        served_dir=served,
        training_config=training_config,
        behaviour=behaviour,
        fold_rslora=fold_rslora,
        allow=set(allow or ()),
    )
    if as_json:
        typer.echo(json.dumps(rep.to_dict(), indent=2))
    else:
        render_report(rep)
    exit_as(CheckFailed, not rep.passed)
