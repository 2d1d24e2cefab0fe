"""CLI commands for the fleet: `pipeline fleet status|sync|prune` and `pipeline rollback`.

Keep this module light: import heavy libraries inside the command functions.
Exit codes: 0 converged, 2 usage, 3 another fleet operation holds the lock, 4 not converged.
"""

from __future__ import annotations

import json
import time
from typing import Annotated

import typer

fleet_app = typer.Typer(
    help="The vLLM fleet: what it serves, reconcile, prune old versions.", no_args_is_help=True
)


def _print_reports(reports, as_json: bool = False) -> None:
    if as_json:
        typer.echo(json.dumps([r.to_dict() for r in reports], indent=2))
    else:
        for r in reports:
            typer.echo(r.line())


@fleet_app.command("status")
def status(as_json: Annotated[bool, typer.Option("--json", help="machine-readable")] = False):
    """Per instance: what it serves against the desired state (ok, missing, stale, unknown, unreachable).

    Exit 0 when every instance serves every desired version, else 4.
    """
    from pipeline.cli import handle_errors, project_config

    @handle_errors
    def run():
        from dataclasses import asdict

        from pipeline.fleet_rollout import status as fleet_status

        cfg = project_config()
        rows = fleet_status(cfg)
        if as_json:
            typer.echo(json.dumps([asdict(r) for r in rows], indent=2))
        else:
            from rich.console import Console
            from rich.table import Table

            t = Table(
                title=f"fleet ({cfg.fleet.loading_mode} mode, state {cfg.volume.path}/fleet-state.json)"
            )
            for col in ("instance", "adapter", "desired", "serving", "state", "detail"):
                t.add_column(col, overflow="fold")
            colors = {"ok": "green", "missing": "yellow", "stale": "yellow", "unknown": "cyan"}
            for r in rows:
                t.add_row(
                    r.instance,
                    r.adapter or "-",
                    f"v{r.desired}" if r.desired else "-",
                    r.serving or "-",
                    f"[{colors.get(r.state, 'red')}]{r.state}[/]",
                    r.detail,
                )
            Console().print(t)
        bad = [r for r in rows if r.state not in ("ok", "unknown")]
        raise typer.Exit(4 if bad else 0)

    run()


@fleet_app.command("sync")
def sync(
    watch: Annotated[bool, typer.Option("--watch", help="keep reconciling (sidecar / daemon)")] = False,
    interval: Annotated[float, typer.Option("--interval", help="seconds between passes with --watch")] = 30.0,
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable reports")] = False,
    follow_alias: Annotated[
        str | None,
        typer.Option(
            "--follow-alias",
            help="also poll the MLflow registry and publish when this alias moves (e.g. production)",
        ),
    ] = None,
):
    """Make every instance serve the desired versions (idempotent). Exit 0 converged, 4 not.

    With --follow-alias, moving the alias in the MLflow UI ships that version (polled every --interval).
    """
    from pipeline.cli import handle_errors, project_config

    @handle_errors
    def run():
        from pipeline.errors import LockedError
        from pipeline.fleet_rollout import sync as fleet_sync

        if follow_alias:
            from pipeline.follow import follow_alias as follow

            cfg = project_config()
            published = follow(
                cfg,
                follow_alias,
                interval,
                once=not watch,
                on_poll=(lambda: _print_reports(fleet_sync(cfg), as_json)) if cfg.fleet.instances else None,
                echo=lambda m: typer.echo(m, err=True),
            )
            if not watch:
                typer.echo(f"published {len(published)} version(s) following alias {follow_alias!r}")
            return

        while True:
            try:
                reports = fleet_sync(project_config())
            except LockedError as e:
                if not watch:
                    raise
                typer.echo(f"skipped pass: {e}", err=True)
                reports = None
            if reports is not None:
                _print_reports(reports, as_json)
            ok = reports is not None and all(r.ok for r in reports)
            if not watch:
                raise typer.Exit(0 if ok else 4)
            time.sleep(interval)

    run()


@fleet_app.command("prune")
def prune(
    name: Annotated[str, typer.Argument(help="adapter name")],
    keep: Annotated[int, typer.Option("--keep", help="newest version directories to keep")] = 2,
    force: Annotated[bool, typer.Option("--force", help="prune even if an instance is unreachable")] = False,
):
    """Delete <volume>/<NAME>-v<K> directories beyond the newest --keep (never the desired version)."""
    from pipeline.cli import handle_errors, project_config

    @handle_errors
    def run():
        from pipeline.fleet_rollout import prune as fleet_prune

        removed = fleet_prune(project_config(), name, keep, force)
        typer.echo("\n".join(f"removed {p}" for p in removed) if removed else "nothing to prune")

    run()


def register(app: typer.Typer) -> None:
    """Add `pipeline fleet ...` and `pipeline rollback` to the main app."""
    app.add_typer(fleet_app, name="fleet")

    @app.command("rollback")
    def rollback(
        name: Annotated[str, typer.Argument(help="adapter (registered model) name")],
        to: Annotated[
            int | None, typer.Option("--to", help="version (default: the previously desired one)")
        ] = None,
    ):
        """Make an earlier version desired, move alias `production` back, and sync the fleet. Exit 4: not converged."""
        from pipeline.cli import handle_errors, project_config

        @handle_errors
        def run():
            from pipeline.fleet_rollout import rollback as fleet_rollback

            cfg = project_config()
            cur, target, reports = fleet_rollback(cfg, name, to)
            typer.echo(f"{name}: desired version v{cur} -> v{target}; alias production -> {target}")
            if cfg.fleet.instances:
                _print_reports(reports)
            raise typer.Exit(0 if all(r.ok for r in reports) else 4)

        run()
