"""`pipeline fleet status|sync|resolve|prune`: what each vLLM instance serves, reconcile, prune old versions.

Exit codes: 0 converged, 2 usage, 3 another fleet operation holds the lock, 4 not converged.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict
from typing import Annotated

import typer

from pipeline.cli._common import (
    DryRunOption,
    JsonOption,
    adapter_name,
    adapter_name_read,
    emit_json,
    exit_as,
    finite,
    log,
    print_plan,
    project_config,
)
from pipeline.cli.render import NoHeadersOption, Output, OutputOption, output_format, print_fleet
from pipeline.errors import FleetError, LockedError, PipelineError
from pipeline.fleet.modes import loading_mode, resolve_served_name
from pipeline.fleet.reconcile import CONVERGED
from pipeline.fleet.reconcile import status as fleet_status
from pipeline.fleet.reconcile import sync as fleet_sync
from pipeline.interrupt import Interrupted
from pipeline.jobs.follow import follow_alias as follow
from pipeline.release.desired import volume_rows
from pipeline.release.prune import prune as fleet_prune
from pipeline.release.prune import prune_plan
from pipeline.release.transaction import recover_pending

app = typer.Typer(help="The vLLM fleet: what it serves, reconcile, prune old versions.", no_args_is_help=True)


def print_reports(reports, as_json: bool = False) -> None:
    """Per-instance reports of a fleet operation, as text lines or one JSON list."""
    if as_json:
        typer.echo(json.dumps([r.to_dict() for r in reports], indent=2))
    else:
        for r in reports:
            typer.echo(r.line())


@app.command("status")
def status(
    name: Annotated[
        str | None,
        typer.Argument(
            help="only this adapter (and the instances' own rows); default: all", callback=adapter_name
        ),
    ] = None,
    as_json: JsonOption = False,
    output: OutputOption = None,
    no_headers: NoHeadersOption = False,
):
    """Per instance: what it serves against the desired state (ok, missing, stale, unknown, hung...).

    States: ok, missing, stale, extra (loaded, not desired), unknown (marked: a change got no
    answer; `fleet sync` verifies and clears it), hung (accepts connections, no answer), unreachable,
    mismatch (vLLM version or model differs from the config), error. Also (instance `-`): `drift`
    between the `production` alias and fleet-state.json or an unfinished transaction, `corrupt` or
    `absent` desired version directories. Exit 0 when every instance serves every desired version
    and nothing drifts, else 4. One line per row (`-o table|wide|json|tsv|name`, `--no-headers`).
    """
    cfg = project_config()
    rows = (fleet_status(cfg) if cfg.fleet.instances else []) + volume_rows(cfg, [name] if name else None)
    if name:  # an instance's own rows (unreachable, mismatch: adapter None) concern every adapter
        rows = [r for r in rows if r.adapter in (None, name)]
    fmt = output_format(output, as_json)
    if fmt is not Output.json:
        mode = loading_mode(cfg)
        swap = f", {mode.plan.strategy} swap" if hasattr(mode, "plan") else ""
        log.info("fleet: %s mode%s, state %s/fleet-state.json", mode.name, swap, cfg.volume.path)
        if not cfg.fleet.instances:
            log.info("no fleet instances configured (fleet.instances): volume and registry checks only")
        if name and not rows:
            log.info("%s: no instance serves it and nothing is wrong with it on the volume", name)
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
    dry_run: DryRunOption = False,
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
    --dry-run prints what each instance would be asked to load or unload (`fleet status`'s rows that are
    not ok), and changes nothing.
    """
    if dry_run:
        return _sync_plan(as_json)
    try:
        _sync(watch, interval, as_json, follow_alias)
    except Interrupted as e:
        if not watch:
            raise
        log.info("fleet sync --watch: %s", e)  # a daemon's normal stop: a pass in flight was completed


SYNC_ACTIONS = {
    "missing": "load the desired version",
    "stale": "switch to the desired version",
    "extra": "unload (not desired)",
    "unknown": "verify, and load the desired version if it differs",
}


def _sync_plan(as_json: bool) -> None:
    """`fleet sync --dry-run`: the rows sync would act on, and the ones it cannot fix."""
    cfg = project_config()
    rows = fleet_status(cfg) if cfg.fleet.instances else []
    acts = [
        {**asdict(r), "action": SYNC_ACTIONS.get(r.state, f"none: {r.state} (sync cannot fix it)")}
        for r in rows
        if r.state not in CONVERGED
    ]
    lines = [
        f"{a['instance']}: {a['adapter'] or '-'}: {a['action']}"
        + (f" (v{a['desired']})" if a.get("desired") else "")
        for a in acts
    ] or ["every instance serves the desired versions: nothing to do"]
    print_plan({"dry_run": True, "action": "sync", "changes": acts}, as_json, lines)


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
        cfg = project_config()
        # what a killed publish/rollback left: completed or undone first, or said why not (never passed over)
        notes, stuck = recover_pending(cfg)
        for n in notes + [str(e) for e in stuck]:
            log.warning("%s", n)
        try:
            reports = fleet_sync(cfg)
        except LockedError as e:
            if not watch:
                raise
            log.warning("skipped pass: %s", e)
            reports = None
        except PipelineError:
            if stuck and not watch:  # the unfinished transaction is the more urgent news
                raise stuck[0] from None
            raise
        if reports is not None:
            print_reports(reports, as_json)
        ok = reports is not None and all(r.ok for r in reports)
        if not watch:
            if stuck:
                raise stuck[0]
            exit_as(FleetError, not ok)
        time.sleep(interval)


def interactive() -> bool:
    """Whether a person can answer a question: stdin and stderr are terminals (not cron, systemd, a pipe, CI)."""
    return sys.stdin.isatty() and sys.stderr.isatty()


@app.command("prune")
def prune(
    name: Annotated[str, typer.Argument(help="adapter name", callback=adapter_name_read)],
    keep: Annotated[int, typer.Option("--keep", min=1, help="newest version directories to keep")] = 2,
    force: Annotated[bool, typer.Option("--force", help="prune even if an instance is unreachable")] = False,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="do not ask on a terminal")] = False,
    dry_run: DryRunOption = False,
    as_json: JsonOption = False,
):
    """Delete <volume>/<NAME>-v<K> directories beyond the newest --keep (never the desired version).

    On a terminal it lists the directories and asks first (--yes does not ask); a run without a
    terminal (cron, a pipe, CI) never asks and prints what it removed. --dry-run lists them and
    deletes nothing. Answering no deletes nothing and exits 0.
    """
    cfg = project_config()
    doomed = prune_plan(cfg, name, keep)
    paths = [str(cfg.volume.path / f"{name}-v{v}") for v in doomed]
    if dry_run:
        plan = {
            "dry_run": True,
            "action": "prune",
            "name": name,
            "keep": keep,
            "versions": doomed,
            "paths": paths,
        }
        lines = [f"would remove {p}" for p in paths] or ["nothing to prune"]
        return print_plan(plan, as_json, lines)
    declined = False
    if doomed and not yes and interactive():  # the list and the question on stderr: stdout stays the result
        typer.echo("\n".join(f"would remove {p}" for p in paths), err=True)
        what = f"{len(paths)} version director{'y' if len(paths) == 1 else 'ies'} of {name}"
        declined = not typer.confirm(f"delete {what}?", err=True)
    removed = fleet_prune(cfg, name, keep, force, only=set(doomed)) if doomed and not declined else []
    if declined and not as_json:
        return typer.echo("nothing deleted")
    if as_json:
        return emit_json({"name": name, "keep": keep, "removed": [str(p) for p in removed]})
    typer.echo("\n".join(f"removed {p}" for p in removed) if removed else "nothing to prune")
