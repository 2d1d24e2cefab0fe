"""What every command module shares: shared options, output helpers, and errors -> exit codes.

The exit-code map lives here and only here (README "Exit codes"); commands raise the
exceptions of `pipeline.errors` and never pick codes themselves. `PipelineGroup` (the click
group class of the main app) catches them for every command, so a command needs no decorator.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import json
import logging
import math
import sys
from typing import Annotated

import click
import typer
from typer.core import TyperGroup

from pipeline import interrupt
from pipeline.errors import (
    CheckFailed,
    FleetError,
    GateFailed,
    InstanceError,
    LockedError,
    PipelineError,
    UsageError,
)
from pipeline.interrupt import Interrupted
from pipeline.redact import RedactingStream, quiet_third_party, redact

log = logging.getLogger("pipeline")

# Exit codes by exception class; a subclass takes its nearest listed ancestor's code.
EXIT_CODES: dict[type[BaseException], int] = {
    CheckFailed: 1,
    UsageError: 2,
    LockedError: 3,
    FleetError: 4,
    InstanceError: 4,
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


def finite(value):
    """Typer callback: a float option is a finite number (click's FloatRange lets NaN and inf through)."""
    if value is not None and not math.isfinite(value):
        raise typer.BadParameter(f"{value} is not a finite number")
    return value


def adapter_name(value):
    """Typer callback of every command that writes under a name: the name(s) follow the grammar and take
    none of the names the fleet serves the base model under (`pipeline.artifacts.names.check_name`, the
    project's `served` section), else exit 2 before any work."""
    if value is None:
        return value
    from pipeline.artifacts.names import check_name  # lazy: `pipeline --help` imports only pipeline.errors

    values = value if isinstance(value, list | tuple) else [value]
    for v in values:
        check_name(v)  # the grammar first: it needs no config
    served = project_config().served_base_names
    for v in values:
        check_name(v, served=served)
    return value


def adapter_name_read(value):
    """Typer callback of a command that only reads under a name (`status NAME`, `fleet resolve NAME`): the
    grammar only, so an entry registered before a rule was added can still be looked at."""
    if value is None:
        return value
    from pipeline.artifacts.names import check_name  # lazy: `pipeline --help` imports only pipeline.errors

    check_name(value)
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
    if ctx is None:
        return False
    # `--json` is remembered when parsed; an option parsed before it (a rejected `--name`) fails
    # first, so the command line the group saw is asked too.
    return bool(ctx.meta.get("pipeline.json") or "--json" in ctx.meta.get("pipeline.argv", ()))


def _remember_json(ctx: click.Context, value: bool) -> bool:
    if value:
        ctx.meta["pipeline.json"] = True
    return value


# The one `--json` option of every command that has machine-readable output.
JsonOption = Annotated[
    bool, typer.Option("--json", help="machine-readable output (errors too)", callback=_remember_json)
]


def emit_json(data) -> None:
    """One JSON document on stdout (the only thing a `--json` command prints there)."""
    typer.echo(json.dumps(data, indent=2, default=str))


# The one `--dry-run` option of every command that changes state (kubectl's `--dry-run=client`, gh's preview):
# the command checks and resolves everything it would act on, prints the plan, changes nothing, exits 0.
DryRunOption = Annotated[
    bool,
    typer.Option("--dry-run", help="print what would be done (with --json: as JSON), change nothing, exit 0"),
]


def print_plan(plan: dict, as_json: bool, lines: list[str]) -> None:
    """A dry run's plan: `plan` as one JSON document under `--json`, else `lines` and "(dry run: nothing changed)"."""
    if as_json:
        emit_json(plan)
        return
    for line in lines:
        typer.echo(line)
    typer.echo("(dry run: nothing changed)")


# Third-party loggers that are noise for an operator (torchao's missing kernels, torch's pytree
# deprecations, Triton, transformers' advice): shown with `--verbose` only.
NOISY_LOGGERS = (
    "torch",
    "torchao",
    "triton",
    "transformers",
    "accelerate",
    "axolotl",
    "peft",
    "mlflow",
    "alembic",
    "urllib3",
    "httpx",
    "datasets",
    "bitsandbytes",
)


# Environment that quiets the libraries in this process (set only where the user did not).
QUIET_ENV = {
    "TORCH_LOGS": "-torch",
    "TORCH_CPP_LOG_LEVEL": "ERROR",
    "TRANSFORMERS_VERBOSITY": "error",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
}


def setup_logging(verbose: bool = False, quiet: bool = False) -> None:
    """The `pipeline` logger on stderr: INFO by default, DEBUG with `--verbose`, WARNING with `--quiet`.

    Progress and stage messages are log records (logger `pipeline.*`), so `--quiet` silences them
    and stdout stays for results (`--json`). Without `--verbose`, third-party warnings (Python
    `warnings` outside the pipeline, and the `NOISY_LOGGERS`) are hidden; child processes inherit
    the libraries' own quiet settings through the environment.
    """
    import os
    import sys
    import warnings

    level = logging.DEBUG if verbose else (logging.WARNING if quiet else logging.INFO)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter("%(message)s" if not verbose else "%(levelname)s %(name)s: %(message)s")
    )
    log.handlers[:] = [handler]
    log.setLevel(level)
    log.propagate = False
    if verbose:
        quiet_third_party(False)
        return
    warnings.filterwarnings("ignore")
    warnings.filterwarnings("default", module=r"pipeline(\.|$)")
    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    quieted = []
    for k, v in QUIET_ENV.items():  # torch's own log handler ignores `logging` levels: TORCH_LOGS=-torch
        if k not in os.environ:
            os.environ[k] = v
            quieted.append(k)
    # child processes (the trainer) keep their own warnings in train.log: `train_env` drops these
    os.environ["PIPELINE_QUIETED_ENV"] = ",".join(quieted)
    quiet_third_party(True)  # no other program's traceback at the default level (pipeline.redact)


def report_error(exc: BaseException, code: int) -> None:
    """An error as one line on stderr, or as a JSON object on stdout under `--json`."""
    if json_requested():
        typer.echo(json.dumps({"error": str(exc), "type": type(exc).__name__, "exit_code": code}))
    else:
        err(str(exc))


def _redacted_excepthook(exc_type, exc, tb) -> None:
    """Python's report of an uncaught exception (a bug), redacted: it is printed after the command's
    redacted streams are restored, and its message may hold a URI with its password."""
    import traceback

    sys.stderr.write(redact("".join(traceback.format_exception(exc_type, exc, tb))))


@contextlib.contextmanager
def redacted_output():
    """stdout and stderr through `pipeline.redact.RedactingStream` for the `with` block; the traceback
    of a bug, printed later by `sys.excepthook`, redacted too."""
    sys.excepthook = _redacted_excepthook
    saved = sys.stdout, sys.stderr
    if not isinstance(sys.stdout, RedactingStream):
        sys.stdout = RedactingStream(sys.stdout)
    if not isinstance(sys.stderr, RedactingStream):
        sys.stderr = RedactingStream(sys.stderr)
    try:
        yield
    finally:
        sys.stdout, sys.stderr = saved


def skip_final_collection() -> None:
    """At exit, freeze the garbage collector's objects instead of letting CPython collect them all.

    CPython's finalisation runs one last full collection over every object alive: ~1M after torch's or
    MLflow's import, 0.4-0.6 s of every such command on this 2-core machine (`python -c "import mlflow"`:
    1.95 s, 1.52 s with the freeze; merge: benchmarks/merge.py). Frozen objects are skipped (gc.freeze,
    Python 3.7+, bpo-31558). Registered as a command starts, so it runs after the atexit handlers of
    what the command imports (MLflow's) and before logging's shutdown (an explicit flush and close).
    Everything the pipeline writes is closed (and fsynced where it matters) before a command returns,
    so no data waits on a finalizer.

    Not when Triton is loaded (fla's kernels, `validate --behaviour`, canary): its nanobind bindings
    check for leaked objects at exit and print hundreds of "nanobind: leaked ..." lines on stderr.
    """
    atexit.unregister(_freeze_at_exit)
    atexit.register(_freeze_at_exit)


def _freeze_at_exit() -> None:
    if "triton" not in sys.modules:
        gc.freeze()


class PipelineGroup(TyperGroup):
    """The main app's click group: maps `pipeline.errors` exceptions to exit codes for every command."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        ctx.meta["pipeline.argv"] = list(args)  # for errors raised before `--json` itself is parsed
        return super().parse_args(ctx, args)

    def invoke(self, ctx: click.Context):
        skip_final_collection()
        from pipeline.artifacts.modes import no_writes_by_others  # lazy: `--help` imports only the three

        no_writes_by_others()  # what a command writes is never writable by others, whatever the umask
        with redacted_output():  # every byte a command prints, whoever prints it (pipeline.redact)
            return self._invoke(ctx)

    def _invoke(self, ctx: click.Context):
        try:
            with interrupt.handling():  # SIGTERM/SIGINT/SIGHUP: clean-up runs, then exit 128+N
                return super().invoke(ctx)
        except (click.exceptions.Exit, click.exceptions.Abort):
            raise
        except click.ClickException as e:
            # a parse error (bad value, missing option) before `--json` was read: JSON all the same
            if json_requested():
                typer.echo(
                    json.dumps({"error": e.format_message(), "type": "UsageError", "exit_code": e.exit_code})
                )
                raise typer.Exit(e.exit_code) from None
            raise
        except (Exception, Interrupted) as e:
            resolved = resolve_error(e)
            if resolved is None:
                raise
            e, code = resolved
            report_error(e, code)
            raise typer.Exit(code) from None


def resolve_error(exc: BaseException) -> tuple[BaseException, int] | None:
    """(the error to report, its exit code) for anything a command raised, or None for a bug (let it raise).

    The one mapping every command goes through (`PipelineGroup.invoke`; `pipeline run` asks it
    too, for its final JSON line): `EXIT_CODES`, then library and OS failures as the pipeline
    errors they are (`as_pipeline_error`), and a stop by signal as 128 + the signal's number.
    """
    if isinstance(exc, Interrupted):
        return exc, exc.exit_code
    code = exit_code_for(exc)
    if code is not None:
        return exc, code
    err = as_pipeline_error(exc)
    return None if err is None else (err, exit_code_for(err))


CONFIG_META = "pipeline.config_file"


def project_config(store: str = "any", what: str | None = None):
    """The project config in effect (`--config`, `$PIPELINE_CONFIG`, or the project found up the tree).

    `store` says what the command needs of the registry, so that no command run outside the
    project silently creates an empty store there (pipeline/config.py, "project"):
      - "any": nothing (commands that create: train, register, demo, run);
      - "read": a project must be found (a pipeline.yaml or `.state/mlflow.db` up the tree), or
        a tracking URI configured; an embedded store not created yet reads as empty;
      - "existing": the registry must already exist (publish, promote, rollback, ui).

    `pipeline.config` (pydantic-settings, ~0.4 s to import) loads here, when a command first
    needs the config, not when `pipeline --help` starts.

    `what` names what the command looks for (e.g. "registered model 'chat'") in the message.

    Raises UsageError (exit 2) naming the directory searched and the store that would be used.
    """
    from pipeline.config import load_config  # lazy: pydantic-settings, ~0.4 s

    ctx = click.get_current_context(silent=True)
    cfg = load_config(ctx.meta.get(CONFIG_META) if ctx else None)
    if store in ("read", "existing") and not cfg.found and not cfg.store_exists():
        raise UsageError(
            f"not inside a lora-pipeline project: no pipeline.yaml or .state/mlflow.db in {cfg.root} or "
            "any parent; cd into the project, pass --config FILE or set PIPELINE_CONFIG "
            "(or MLFLOW_TRACKING_URI for a registry server)"
        )
    if store == "existing" and not cfg.store_exists():
        from pipeline.registry.store import check_store  # lazy: only when no store is found

        check_store(cfg, write=False)  # a store this project created that is gone says so (issue 40)
        raise UsageError(
            (f"{what} not found: " if what else "")
            + f"no registry yet at {cfg.embedded_store} ({cfg.where()}): nothing has been registered in "
            "this project (`pipeline register` or `pipeline demo` creates it)"
        )
    log.debug("%s", cfg.where())
    return cfg


def exit_as(cls: type[PipelineError], failed: bool = True) -> None:
    """End a command that already printed its report: exit with `cls`'s code when `failed`, else 0."""
    raise typer.Exit(EXIT_CODES[cls] if failed else 0)
