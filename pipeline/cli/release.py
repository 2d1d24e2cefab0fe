"""Release commands: `pipeline publish`, `pipeline promote`, `pipeline rollback`."""

from __future__ import annotations

import dataclasses
from typing import Annotated

import typer

from pipeline.cli._common import (
    DryRunOption,
    JsonOption,
    adapter_name,
    emit_json,
    exit_as,
    print_plan,
    project_config,
)
from pipeline.cli.fleet import print_reports
from pipeline.errors import FleetError
from pipeline.release.plan import publish_plan, rollback_plan
from pipeline.release.publish import publish as do_publish
from pipeline.release.rollback import rollback as fleet_rollback

app = typer.Typer()


@app.command()
def publish(
    name: Annotated[str, typer.Argument(help="registered model name", callback=adapter_name)],
    version: Annotated[int | None, typer.Option(min=1, help="model version")] = None,
    alias: Annotated[str | None, typer.Option(help="model alias, e.g. candidate")] = None,
    force: Annotated[
        bool, typer.Option("--force", help="ship a version `pipeline run` gated (recorded on the version)")
    ] = False,
    dry_run: DryRunOption = False,
    as_json: JsonOption = False,
):
    """Publish a validated version to the adapter volume and the fleet.

    Publish a validated version to <volume>/<NAME>-v<N>/ atomically; alias `production` follows.
    --dry-run prints what would be written and moved, and changes nothing."""
    cfg = project_config(store="existing", what=f"registered model {name!r}")
    if dry_run:
        return _print_publish_plan(publish_plan(cfg, name, version, alias, force=force), as_json)
    res = do_publish(cfg, name, version, alias, force=force)
    if as_json:
        return emit_json(dataclasses.asdict(res))
    what = "published" if res.created else "already on the volume (not rewritten)"
    typer.echo(f"{what}: {res.name} v{res.version} -> {res.path}")
    if res.previous_production not in (None, res.version):
        typer.echo(
            f"alias production: v{res.previous_production} -> v{res.version} (previous = "
            f"v{res.previous_production})"
        )
    if res.instances:
        typer.echo(f"serving on: {', '.join(res.instances)}")
    for w in res.warnings:
        typer.echo(f"warning: {w}", err=True)


@app.command()
def promote(
    name: Annotated[str, typer.Argument(help="registered model name", callback=adapter_name)],
    version: Annotated[int, typer.Argument(min=1, help="model version to ship")],
    force: Annotated[
        bool, typer.Option("--force", help="ship a version `pipeline run` gated (recorded on the version)")
    ] = False,
    dry_run: DryRunOption = False,
    as_json: JsonOption = False,
):
    """Move alias `production` to VERSION and publish it.

    Move alias `production` to VERSION and publish it (volume, then the fleet if configured). A version
    `pipeline run` gated is refused unless --force (the override is recorded on the version).
    --dry-run prints what would move, and changes nothing."""
    cfg = project_config(store="existing", what=f"registered model {name!r}")
    if dry_run:
        plan = publish_plan(cfg, name, version=version, force=force, action="promote")
        return _print_publish_plan(plan, as_json)
    res = do_publish(cfg, name, version=version, force=force)
    if as_json:
        return emit_json(dataclasses.asdict(res))
    prev = (
        f" (previous: v{res.previous_production})"
        if res.previous_production not in (None, res.version)
        else ""
    )
    typer.echo(f"promoted {res.name} v{res.version} to production{prev}: {res.path}")
    for w in res.warnings:
        typer.echo(f"warning: {w}", err=True)


@app.command()
def rollback(
    name: Annotated[str, typer.Argument(help="adapter (registered model) name", callback=adapter_name)],
    to: Annotated[
        int | None, typer.Option("--to", min=1, help="version (default: the previously desired one)")
    ] = None,
    dry_run: DryRunOption = False,
    as_json: JsonOption = False,
):
    """Make an earlier version desired, move `production` back, sync the fleet.

    Make an earlier version desired, move alias `production` back, and sync the fleet. Exit 4: not
    converged. --dry-run prints the version it would go to and what would move, and changes nothing."""
    cfg = project_config(store="existing", what=f"registered model {name!r}")
    if dry_run:
        plan = rollback_plan(cfg, name, to)
        lines = [
            f"would roll back {name}: desired version v{plan['desired']['from']} -> v{plan['to_version']}; "
            f"alias production v{plan['production']['from']} -> v{plan['to_version']}, previous -> "
            f"v{plan['previous']['to']}"
            if plan["changes"]
            else f"{name} v{plan['to_version']} is already production and desired: nothing would change"
        ]
        return print_plan(plan, as_json, lines + _plan_notes(plan))
    res = fleet_rollback(cfg, name, to)
    cur, target, reports = res
    if as_json:
        emit_json(
            {
                "name": name,
                "from_version": cur,
                "to_version": target,
                "notes": list(res.notes),
                "instances": [r.to_dict() for r in reports],
            }
        )
        exit_as(FleetError, not all(r.ok for r in reports))
        return
    typer.echo(f"{name}: desired version v{cur} -> v{target}; alias production -> {target}")
    for n in res.notes:
        typer.echo(f"note: {n}", err=True)
    if cfg.fleet.instances:
        print_reports(reports)
    exit_as(FleetError, not all(r.ok for r in reports))


def _v(v) -> str:
    return "none" if v is None else f"v{v}"


def _plan_notes(plan: dict) -> list[str]:
    notes = []
    if plan["instances"]:
        notes.append(f"instances to switch: {', '.join(plan['instances'])}")
    if plan.get("pending"):
        notes.append(f"first: {plan['pending']}")
    return notes + [f"warning: {w}" for w in plan.get("warnings", [])]


def _print_publish_plan(plan: dict, as_json: bool) -> None:
    """`publish`/`promote --dry-run`: what would be written and moved."""
    what = (
        f"would write {plan['path']}"
        if plan["write"]
        else f"{plan['path']} is already on the volume (verified; not rewritten)"
    )
    prod, prev = plan["production"], plan["previous"]
    lines = [
        f"{plan['action']} {plan['name']} v{plan['version']}: {what}",
        f"alias production {_v(prod['from'])} -> {_v(prod['to'])}, previous {_v(prev['from'])} -> {_v(prev['to'])}; "
        f"desired {_v(plan['desired']['from'])} -> {_v(plan['desired']['to'])}",
    ]
    print_plan(plan, as_json, lines + _plan_notes(plan))
