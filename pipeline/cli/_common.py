"""What every command module shares: shared options, output helpers, and errors -> exit codes.

The exit-code map lives here and only here (README "Exit codes"); commands raise the
exceptions of `pipeline.errors` and never pick codes themselves. `PipelineGroup` (the click
group class of the main app) catches them for every command, so a command needs no decorator.
"""

from __future__ import annotations

import json
from typing import Annotated

import click
import typer
from typer.core import TyperGroup

from pipeline.errors import (
    CheckFailed,
    FleetError,
    GateFailed,
    LockedError,
    PipelineError,
    UsageError,
)

# Exit codes by exception class; a subclass takes its nearest listed ancestor's code.
EXIT_CODES: dict[type[BaseException], int] = {
    CheckFailed: 1,
    UsageError: 2,
    LockedError: 3,
    FleetError: 4,
    GateFailed: 5,
    PipelineError: 2,
    FileNotFoundError: 2,
}


def exit_code_for(exc: BaseException) -> int | None:
    """The documented exit code for `exc`, or None when it is not a pipeline error (a bug: let it raise)."""
    for cls in type(exc).__mro__:
        if cls in EXIT_CODES:
            return EXIT_CODES[cls]
    return None


def as_pipeline_error(exc: BaseException) -> PipelineError | None:
    """A library or OS failure that escaped the stage code, as the pipeline error it is, else None.

    MLflow / SQLAlchemy / HTTP-stack exceptions become `StoreError` naming the store
    (`pipeline.registry.store.as_store_error`); any other `OSError` (read-only or full filesystem,
    permissions) a `VolumeError` saying what and where.
    """
    if isinstance(exc, PipelineError):
        return exc
    from pipeline.registry.store import as_store_error  # lazy: pydantic-settings, only on a failure

    err = as_store_error(exc)
    if err is None and isinstance(exc, OSError) and not isinstance(exc, FileNotFoundError):
        from pipeline.artifacts.volume import os_failure  # lazy: only on a failure

        err = os_failure(exc, "filesystem error", exc.filename or "")
    return err


def adapter_name(value):
    """Typer callback: the adapter name(s) given follow the grammar (`pipeline.artifacts.names`), else exit 2."""
    if value is None:
        return value
    from pipeline.artifacts.names import check_name  # lazy: `pipeline --help` imports only pipeline.errors

    for v in value if isinstance(value, list | tuple) else [value]:
        check_name(v)
    return value


def err(msg: str) -> None:
    """Print `error: msg` on stderr (rich markup off: messages hold paths and brackets)."""
    from rich.console import Console
    from rich.markup import escape

    # Only the prefix is markup: `[fleet.hung]`, `[vLLM 0.32.0]` in a message are text, not style tags.
    Console(stderr=True).print(
        f"[bold red]error:[/] {escape(msg)}", highlight=False, markup=True, soft_wrap=True
    )


def json_requested() -> bool:
    """Whether the running command was given `--json` (errors are then printed as JSON too)."""
    ctx = click.get_current_context(silent=True)
    return bool(ctx and ctx.meta.get("pipeline.json"))


def _remember_json(ctx: click.Context, value: bool) -> bool:
    if value:
        ctx.meta["pipeline.json"] = True
    return value


# The one `--json` option of every command that has machine-readable output.
JsonOption = Annotated[
    bool, typer.Option("--json", help="machine-readable output (errors too)", callback=_remember_json)
]


def report_error(exc: BaseException, code: int) -> None:
    """An error as one line on stderr, or as a JSON object on stdout under `--json`."""
    if json_requested():
        typer.echo(json.dumps({"error": str(exc), "type": type(exc).__name__, "exit_code": code}))
    else:
        err(str(exc))


class PipelineGroup(TyperGroup):
    """The main app's click group: maps `pipeline.errors` exceptions to exit codes for every command."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.exceptions.Abort, click.ClickException):
            raise
        except Exception as e:
            code = exit_code_for(e)
            if code is None:
                e = as_pipeline_error(e)
                if e is None:
                    raise
                code = exit_code_for(e)
            report_error(e, code)
            raise typer.Exit(code) from None


CONFIG_META = "pipeline.config_file"


def project_config():
    """The project config in effect (`--config`, `$PIPELINE_CONFIG`, or ./pipeline.yaml).

    `pipeline.config` (pydantic-settings, ~0.4 s to import) loads here, when a command first
    needs the config, not when `pipeline --help` starts.
    """
    from pipeline.config import load_config  # lazy: pydantic-settings, ~0.4 s

    ctx = click.get_current_context(silent=True)
    return load_config(ctx.meta.get(CONFIG_META) if ctx else None)


def exit_as(cls: type[PipelineError], failed: bool = True) -> None:
    """End a command that already printed its report: exit with `cls`'s code when `failed`, else 0."""
    raise typer.Exit(EXIT_CODES[cls] if failed else 0)
