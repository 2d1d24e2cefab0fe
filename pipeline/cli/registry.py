"""Registry commands: `pipeline register`, `pipeline status`, `pipeline ui`."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Annotated

import typer

from pipeline import registry
from pipeline.artifacts.manifest import read_adapter_manifest
from pipeline.cli._common import (
    DryRunOption,
    JsonOption,
    adapter_name,
    adapter_name_read,
    emit_json,
    err,
    exit_as,
    log,
    print_plan,
    project_config,
)
from pipeline.cli.render import NoHeadersOption, OutputOption, output_format, print_status
from pipeline.errors import CheckFailed, UsageError
from pipeline.registry.read import read_models
from pipeline.registry.ui import model_url, start
from pipeline.release.status import collect
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
    allow_duplicate: Annotated[
        bool,
        typer.Option(
            "--allow-duplicate",
            help="register weights an existing version of NAME already holds, as a new version",
        ),
    ] = False,
    dry_run: DryRunOption = False,
    behaviour: Annotated[
        bool,
        typer.Option(
            "--behaviour", help="also run validate's --behaviour checks; records the predicted MTP acceptance"
        ),
    ] = False,
    as_json: JsonOption = False,
):
    """Validate, then record the adapter in MLflow as a model version.

    Validate, then record the adapter in MLflow as a model version with alias `candidate`.
    Exit 1 when validation failed (the version is registered for lineage; publish refuses it).
    Weights that a version of NAME already holds (same sha256) are refused (exit 2, naming the
    version) unless --allow-duplicate."""
    cfg = project_config()
    if not adapter.is_dir():  # also a symlink loop or a path through a file: before validation reads it
        raise UsageError(
            f"{adapter}: not an adapter directory (give the `adapter/` directory `pipeline train` wrote)"
        )
    same = _same_weights(cfg, adapter, name)  # before validation: a duplicate is refused at once
    if same is not None and not allow_duplicate:
        raise UsageError(
            f"{name}: these weights (sha256 {same.tags['weights_sha256'][:16]}) are already version "
            f"{same.version}{_aliases_of(cfg, name, int(same.version))}; nothing registered. Publish v{same.version} "
            f"(`pipeline publish {name} --version {same.version}`), or register them again as a new version with "
            "--allow-duplicate"
        )
    rep = validate_with_config(cfg, adapter, base, behaviour=behaviour)
    failed = sorted({c.id for c in rep.checks if c.severity == "error"})
    if dry_run:
        plan = {
            "dry_run": True,
            "action": "register",
            "adapter": str(adapter),
            "name": name,
            "version": _next_version(cfg, name),
            "alias": registry.ALIAS_CANDIDATE,
            "verdict": rep.verdict,
            "failed_checks": failed,
            "duplicate_of": int(same.version) if same is not None else None,
        }
        return print_plan(
            plan,
            as_json,
            [
                f"would register {adapter} as {name} version {plan['version']} (alias candidate), "
                f"validation {rep.verdict}"
                + (f" ({', '.join(failed)})" if failed else "")
                + (f"; same weights as v{same.version} (--allow-duplicate)" if same is not None else "")
            ],
        )
    reg = registry.register_adapter(cfg, adapter, name, rep.to_dict())
    if as_json:
        emit_json(
            {
                "name": reg.name,
                "version": reg.version,
                "alias": registry.ALIAS_CANDIDATE,
                "verdict": rep.verdict,
                "failed_checks": failed,
                "model_id": reg.model_id,
                "run_id": reg.run_id,
                "source": reg.source,
            }
        )
    else:
        typer.echo(
            f"registered {reg.name} version {reg.version} (alias candidate), validation {rep.verdict}, "
            f"model {reg.model_id}, run {reg.run_id}"
        )
    if not rep.passed:  # recorded for lineage, but it must not look like a success
        err(
            f"validation failed ({', '.join(failed)}): version {reg.version} is registered but `publish` will "
            f"refuse it; see `pipeline validate {adapter}`"
        )
        exit_as(CheckFailed)


def _same_weights(cfg, adapter: Path, name: str):
    """The version of `name` holding the adapter's weights already, or None (no store yet, no manifest:
    `register_adapter` says what is wrong with the directory)."""
    if not cfg.store_exists():
        return None
    try:
        sha = read_adapter_manifest(adapter).weights_sha256
    except (OSError, ValueError):
        return None
    return registry.same_weights(cfg, name, sha)


def _aliases_of(cfg, name: str, version: int) -> str:
    held = sorted(a for a, v in registry.aliases(cfg, name).items() if v == version)
    return f" (alias {', '.join(held)})" if held else ""


def _next_version(cfg, name: str) -> int:
    """The version number the next registration of `name` gets (MLflow: the highest + 1)."""
    if not cfg.store_exists() or not registry.model_exists(cfg, name):
        return 1
    return max((int(v.version) for v in registry.versions(cfg, name)), default=0) + 1


@app.command()
def status(
    name: Annotated[
        str | None, typer.Argument(help="registered model (default: all)", callback=adapter_name_read)
    ] = None,
    as_json: JsonOption = False,
    output: OutputOption = None,
    no_headers: NoHeadersOption = False,
    fleet: Annotated[bool, typer.Option(help="ask the fleet's instances what they serve")] = True,
):
    """Versions, aliases, verdicts, published paths and what instances serve.

    Versions, aliases, validation verdict, gate outcome, published path and what each instance
    serves. Reads the registry without starting MLflow (docs/registry.md, "Speed") and never
    creates a store: outside a project it says so (exit 2). One line per version
    (`-o table|wide|json|tsv|name`, `--no-headers`); drift and fleet problems on stderr."""
    fmt = output_format(output, as_json)
    print_status(collect(project_config(store="read"), name, fleet=fleet), fmt, no_headers)


def _end_on_signals() -> None:
    """SIGTERM/SIGHUP end `pipeline ui` like Ctrl-C does (so `finally` stops the server)."""

    def handler(signum, _frame):
        raise SystemExit(128 + signum)

    for s in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, handler)


@app.command()
def ui(
    port: Annotated[int, typer.Option(min=0, max=65535, help="port on 127.0.0.1 (0: any free port)")] = 5000,
    name: Annotated[str | None, typer.Option(help="model whose page URL to print")] = None,
):
    """Start the MLflow UI on 127.0.0.1 against the project's store.

    Start the MLflow UI on 127.0.0.1 against the project's store; Ctrl-C (or SIGTERM, SIGHUP)
    stops it, and the server ends with this command even when it is killed."""
    cfg = project_config(store="existing")
    registry.check_store(cfg)  # a store that cannot be used fails now, not after the server's start-up
    if registry.is_server_uri(cfg.tracking_uri):
        typer.echo(f"the registry is a server: {model_url(cfg.tracking_uri, name)}")
        return
    _end_on_signals()
    log.info("starting mlflow server (log: %s) ...", cfg.state_dir / "mlflow-ui.log")
    server = start(cfg, port=port)
    try:
        names = [name] if name else [m.name for m in read_models(cfg)]
        typer.echo(f"MLflow UI: {model_url(server.url)}")
        c = server.credentials
        typer.echo(f"  log in as {c.username!r}, password: {c.source} (the UI lets no one in without it)")
        for n in names:
            typer.echo(f"  {n}: {model_url(server.url, n)}")
        log.info("Ctrl-C to stop")
        server.proc.wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
