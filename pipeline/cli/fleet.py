"""`pipeline fleet status|sync|resolve|prune`: what each vLLM instance serves, reconcile, prune old versions.

Exit codes: 0 converged, 2 usage, 3 another fleet operation holds the lock, 4 not converged.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from typing import Annotated

import typer

from pipeline.cli._common import JsonOption, adapter_name_read, exit_as, finite, log, project_config
from pipeline.cli.render import NoHeadersOption, Output, OutputOption, output_format, print_fleet
from pipeline.errors import FleetError, LockedError
from pipeline.fleet.modes import loading_mode, resolve_served_name
from pipeline.fleet.reconcile import CONVERGED
from pipeline.fleet.reconcile import status as fleet_status
from pipeline.fleet.reconcile import sync as fleet_sync
from pipeline.interrupt import Interrupted
from pipeline.jobs.follow import follow_alias as follow
from pipeline.release.desired import volume_rows
from pipeline.release.prune import prune as fleet_prune

app = typer.Typer(help="The vLLM fleet: what it serves, reconcile, prune old versions.", no_args_is_help=True)


def print_reports(reports, as_json: bool = False) -> None:
    """Per-instance reports of a fleet operation, as text lines or one JSON list."""
    if as_json:
        typer.echo(json.dumps([r.to_dict() for r in reports], indent=2))
    else:
        for r in reports:
            typer.echo(r.line())


@app.command("status")
def status(as_json: JsonOption = False, output: OutputOption = None, no_headers: NoHeadersOption = False):
    """Per instance: what it serves against the desired state (ok, missing, stale, unknown, hung...).

    States: ok, missing, stale, extra (loaded, not desired), unknown (marked: a change got no
    answer; `fleet sync` verifies and clears it), hung (accepts connections, no answer), unreachable,
    mismatch (vLLM version or model differs from the config), error. Also (instance `-`): `drift`
    between the `production` alias and fleet-state.json or an unfinished transaction, `corrupt` or
    `absent` desired version directories. Exit 0 when every instance serves every desired version
    and nothing drifts, else 4. One line per row (`-o table|wide|json|tsv|name`, `--no-headers`).
    """
    cfg = project_config()
    rows = (fleet_status(cfg) if cfg.fleet.instances else []) + volume_rows(cfg)
    fmt = output_format(output, as_json)
    if fmt is not Output.json:
        mode = loading_mode(cfg)
        swap = f", {mode.plan.strategy} swap" if hasattr(mode, "plan") else ""
        log.info("fleet: %s mode%s, state %s/fleet-state.json", mode.name, swap, cfg.volume.path)
        if not cfg.fleet.instances:
            log.info("no fleet instances configured (fleet.instances): volume and registry checks only")
    print_fleet([asdict(r) for r in rows], fmt, no_headers)
    exit_as(FleetError, any(r.state not in CONVERGED for r in rows))


@app.command("resolve")
def resolve(
    name: Annotated[str, typer.Argument(help="adapter name", callback=adapter_name_read)],
    as_json: JsonOption = False,
):
    """The model id clients send for adapter NAME now (e.g. NAME-v3), from the desired state."""
    served = resolve_served_name(project_config(), name)
    typer.echo(json.dumps({"adapter": name, "model": served}) if as_json else served)


@app.command("sync")
def sync(
    watch: Annotated[bool, typer.Option("--watch", help="keep reconciling (sidecar / daemon)")] = False,
    interval: Annotated[
        float,
        typer.Option("--interval", min=0.1, callback=finite, help="seconds between passes with --watch"),
    ] = 30.0,
    as_json: JsonOption = False,
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
    try:
        _sync(watch, interval, as_json, follow_alias)
    except Interrupted as e:
        if not watch:
            raise
        log.info("fleet sync --watch: %s", e)  # a daemon's normal stop: a pass in flight was completed


def _sync(watch: bool, interval: float, as_json: bool, follow_alias: str | None) -> None:
    if follow_alias:
        cfg = project_config()
        published = follow(
            cfg,
            follow_alias,
            interval,
            once=not watch,
            on_poll=(lambda: print_reports(fleet_sync(cfg), as_json)) if cfg.fleet.instances else None,
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
            log.warning("skipped pass: %s", e)
            reports = None
        if reports is not None:
            print_reports(reports, as_json)
        ok = reports is not None and all(r.ok for r in reports)
        if not watch:
            exit_as(FleetError, not ok)
        time.sleep(interval)


@app.command("prune")
def prune(
    name: Annotated[str, typer.Argument(help="adapter name", callback=adapter_name_read)],
    keep: Annotated[int, typer.Option("--keep", min=1, help="newest version directories to keep")] = 2,
    force: Annotated[bool, typer.Option("--force", help="prune even if an instance is unreachable")] = False,
):
    """Delete <volume>/<NAME>-v<K> directories beyond the newest --keep (never the desired version)."""
    removed = fleet_prune(project_config(), name, keep, force)
    typer.echo("\n".join(f"removed {p}" for p in removed) if removed else "nothing to prune")
