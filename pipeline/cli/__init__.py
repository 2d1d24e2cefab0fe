"""The `pipeline` command line: one module per command group, each a thin layer over a library module.

Nothing imports this package but the console script and `python -m pipeline`. Errors map to
exit codes in `pipeline.cli._common` (README "Exit codes").

Commands load lazily (click's "lazily loading subcommands" pattern): `pipeline --help` lists
`COMMANDS` without importing any command module, and `pipeline X` imports only X's module
and the library it calls. A command module imports the pipeline's own modules at its top;
pydantic-settings and httpx alone cost ~0.4 s, which `--help` and a cheap command need not pay.
`tests/cli/test_cli.py` checks that the summaries below equal the commands' docstrings.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Annotated

import click
import typer
from typer.core import TyperCommand, TyperGroup

from pipeline import __version__
from pipeline.cli._common import CONFIG_META, PipelineGroup, setup_logging
from pipeline.cli.examples import epilog, polish

# name -> (module under pipeline.cli, is a command group, one-line summary), in stage order:
# train -> validate -> register -> publish, then the fleet and the jobs around them.
COMMANDS: dict[str, tuple[str, bool, str]] = {
    "train": ("train", False, "Train a LoRA with axolotl; leaves <run>/adapter/ with manifest.json."),
    "validate": (
        "validate",
        False,
        "Check an adapter against the base, the served checkpoint and the fleet.",
    ),
    "register": ("registry", False, "Validate, then record the adapter in MLflow as a model version."),
    "publish": ("release", False, "Publish a validated version to the adapter volume and the fleet."),
    "promote": ("release", False, "Move alias `production` to VERSION and publish it."),
    "rollback": (
        "release",
        False,
        "Make an earlier version desired, move `production` back, sync the fleet.",
    ),
    "status": ("registry", False, "Versions, aliases, verdicts, published paths and what instances serve."),
    "ui": ("registry", False, "Start the MLflow UI on 127.0.0.1 against the project's store."),
    "canary": ("canary", False, "Parity with PEFT and spec-decode speed of an adapter on a staging vLLM."),
    "merge": ("merge", False, "Merge an adapter into the bf16 base, streamed, gated on parity."),
    "draft": (
        "draft",
        False,
        "Distil an MTP drafter for a model version: the base's MTP layer trained on the adapter's own outputs.",
    ),
    "merge-parity": (
        "merge_parity",
        False,
        "Merged NVFP4 model vs its adapter hot-loaded on the NVFP4 base, on vLLM: parity gate, tok/s, MTP acceptance.",
    ),
    "run": ("jobs", False, "The scheduled job: retrain if inputs changed, validate, register, publish."),
    "follow-alias": ("jobs", False, "Publish a model's ALIAS version whenever the alias moves."),
    "fleet": ("fleet", True, "The vLLM fleet: what it serves, reconcile, prune old versions."),
    "schedule": ("schedule", True, "Scheduler manifests that call `pipeline run`."),
    "dataset": ("dataset", True, "Dataset checks."),
    "config": ("config", True, "The project config file (pipeline.yaml)."),
    "demo": ("dev", False, "Run the main job on the embedded default: tiny base to published adapter."),
    "dev": ("dev", True, "Developer tools: tiny models for demos and tests."),
}


def load_command(name: str) -> click.Command:
    """Import the module of command `name` and return its click command (a group for command groups)."""
    module, is_group, _ = COMMANDS[name]
    mod = importlib.import_module(f"pipeline.cli.{module}")
    if is_group:
        group = typer.main.get_group(mod.app)
        group.name = name
        return polish(group, name)
    commands = {**typer.main.get_group(mod.app).commands}
    if hasattr(mod, "demo_app"):
        commands.update(typer.main.get_group(mod.demo_app).commands)
    return polish(commands[name], name)


class LazyGroup(PipelineGroup):
    """The main group: lists `COMMANDS` from the table, loads a command's module only to run it."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        """A light stand-in carrying the summary (for help listings and completion)."""
        if name not in COMMANDS:
            return None
        _, is_group, summary = COMMANDS[name]
        cls = TyperGroup if is_group else TyperCommand
        return cls(name=name, help=summary, short_help=summary)

    def resolve_command(self, ctx: click.Context, args: list[str]):
        """The real command, imported now because it is about to run (or print its own help)."""
        name = click.utils.make_str(args[0]) if args else ""
        if name in COMMANDS:
            return name, load_command(name), args[1:]
        return super().resolve_command(ctx, args)


app = typer.Typer(
    cls=LazyGroup,
    help="Train, validate, register and publish LoRA adapters for a vLLM fleet.",
    epilog=epilog("pipeline"),
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"lora-pipeline {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    ctx: typer.Context,
    config_file: Annotated[
        Path | None,
        typer.Option("--config", "-c", help="pipeline.yaml (default: $PIPELINE_CONFIG or ./pipeline.yaml)"),
    ] = None,
    version: Annotated[
        bool,
        typer.Option("--version", help="print the version and exit", callback=_print_version, is_eager=True),
    ] = False,
    verbose: Annotated[
        bool, typer.Option("--verbose", "-v", help="debug messages and third-party warnings on stderr")
    ] = False,
    quiet: Annotated[
        bool, typer.Option("--quiet", "-q", help="only warnings and errors on stderr (no progress)")
    ] = False,
):
    """Train, validate, register and publish LoRA adapters for a vLLM fleet.

    Results go to stdout (`--json` on a command: one JSON document, errors too); progress and
    messages go to stderr through logging (`-v` more, `-q` less).
    """
    ctx.meta[CONFIG_META] = config_file
    setup_logging(verbose=verbose, quiet=quiet)
