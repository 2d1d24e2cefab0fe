"""Training options shared by `pipeline train` and `pipeline run` (the scheduled job trains the same way).

Only arguments after an explicit `--` reach the launcher: `DashDashCommand` records where `--`
was, and `launcher_args` refuses anything else click left over (a stray positional argument);
an unknown option before `--` is click's own usage error (exit 2).
"""

from __future__ import annotations

import difflib
from enum import StrEnum
from typing import Annotated

import click
import typer
from typer.core import TyperCommand

from pipeline.errors import UsageError


class Launcher(StrEnum):
    python = "python"  # one device, in-process trainer
    accelerate = "accelerate"
    torchrun = "torchrun"


class Strategy(StrEnum):
    auto = "auto"  # DDP when the base fits each GPU (pipeline.train.strategy), else FSDP2
    ddp = "ddp"
    fsdp2 = "fsdp2"


GpusOption = Annotated[
    int,
    typer.Option(
        min=1, help="GPUs on this machine: >1 uses axolotl's accelerate launcher (one process per GPU)"
    ),
]
LauncherOption = Annotated[
    Launcher | None,
    typer.Option(help="axolotl's launcher (default: python for 1 GPU, else accelerate)"),
]
StrategyOption = Annotated[
    Strategy,
    typer.Option(
        help="with several GPUs: ddp (frozen base replicated) or fsdp2 (sharded); auto picks DDP when the "
        "per-GPU memory estimate fits, else FSDP2, and says why"
    ),
]
CONTEXT = {"allow_extra_args": True}


class DashDashCommand(TyperCommand):
    """A command that remembers the arguments given after `--`."""

    def parse_args(self, ctx, args):
        ctx.meta["after_dashdash"] = list(args[args.index("--") + 1 :]) if "--" in args else []
        try:
            return super().parse_args(ctx, args)
        except click.NoSuchOption as e:  # say where an axolotl setting goes
            e.message = f"No such option: {e.option_name}{_config_hint(e.option_name)}"
            raise


def _config_hint(option: str) -> str:
    # a usage error must not pay for the training side's imports; the keys come from a cache (< 1 s)
    from pipeline.train.passthrough import config_keys  # lazy: see above

    key = option.lstrip("-").replace("-", "_")
    keys = config_keys()
    if key in keys:
        return f" (axolotl config keys go through --set {key}=VALUE)"
    near = difflib.get_close_matches(key, sorted(keys), n=1, cutoff=0.75)
    return f"; did you mean --set {near[0]}=VALUE (an axolotl config key)?" if near else ""


def launcher_args(ctx: typer.Context) -> list[str]:
    """The arguments after `--`; UsageError for any other argument click did not consume."""
    after = ctx.meta.get("after_dashdash", [])
    extra = list(ctx.args)
    stray = extra[: len(extra) - len(after)]
    if stray or extra[len(stray) :] != after:
        raise UsageError(
            f"unexpected argument(s) {' '.join(stray or extra)}: give config overrides as --set key=value; "
            "only arguments after `--` go to the launcher"
        )
    return after
