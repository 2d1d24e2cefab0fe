"""`pipeline train`: axolotl through its own CLI and launchers."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pipeline.cli._common import DryRunOption, JsonOption, adapter_name, emit_json, print_plan, project_config
from pipeline.cli._training import (
    CONTEXT,
    DashDashCommand,
    GpusOption,
    LauncherOption,
    Strategy,
    StrategyOption,
    launcher_args,
)
from pipeline.figures import figure
from pipeline.train.schema import refuse_unknown_keys

app = typer.Typer()


@app.command(cls=DashDashCommand, context_settings=CONTEXT)
def train(
    ctx: typer.Context,
    config: Annotated[Path, typer.Argument(help="axolotl YAML (axolotl_configs/...)")],
    set_: Annotated[
        list[str], typer.Option("--set", help="override a config key: key=value (YAML value)")
    ] = [],
    overlay: Annotated[
        list[Path], typer.Option(help="YAML merged over CONFIG, e.g. axolotl_configs/fsdp2.yml")
    ] = [],
    allow: Annotated[list[str], typer.Option(help="accept a setting the fleet refuses (check id)")] = [],
    name: Annotated[
        str | None, typer.Option(help="adapter name (default: config file stem)", callback=adapter_name)
    ] = None,
    gpus: GpusOption = 1,
    launcher: LauncherOption = None,
    strategy: StrategyOption = Strategy.auto,
    progress: Annotated[
        bool,
        typer.Option(
            help="progress on stderr: a bar on a terminal, else a line every $PIPELINE_PROGRESS_INTERVAL s"
        ),
    ] = True,
    dry_run: DryRunOption = False,
    as_json: JsonOption = False,
):
    """Train a LoRA with axolotl; leaves <run>/adapter/ with manifest.json. Args after `--` go to the launcher.

    After `--`: launcher options (accelerate/torchrun, e.g. multi-node rendezvous) and axolotl config
    keys as `--key value` (checked like --set); nothing else. Progress and messages go to stderr; the
    result (adapter path, run id, losses, tokens/s) to stdout, as one JSON object with `--json`.
    --dry-run checks the options and the config, prints the resolved config and the launcher command,
    and trains nothing (the datasets are not read).
    """
    after = launcher_args(ctx)
    refuse_unknown_keys(config, set_, overlay)  # usage and key errors first: < 1 s (issue 41 item 4)
    if dry_run:
        from pipeline.train.dry_run import training_plan  # lazy: as run_train below

        plan = training_plan(
            project_config(),
            config,
            overrides=set_,
            overlays=overlay,
            allow=set(allow),
            name=name,
            gpus=gpus,
            launcher=launcher.value if launcher else None,
            launcher_args=after,
            strategy=strategy.value,
        )
        return print_plan(plan, as_json, _plan_lines(plan))
    # the trainer's side (registry, validate, datasets) costs ~1.5 s of imports: refusals come first
    from pipeline.train.launch import train as run_train  # lazy: see above

    res = run_train(
        project_config(),
        config,
        overrides=set_,
        overlays=overlay,
        allow=set(allow),
        name=name,
        gpus=gpus,
        launcher=launcher.value if launcher else None,
        launcher_args=after,
        strategy=strategy.value,
        show_progress=progress,
    )
    m = res.manifest.metrics
    if res.adapter_dir is None:  # a worker node of a multi-node run
        if as_json:
            emit_json(
                {
                    "adapter": None,
                    "run_dir": str(res.run_dir),
                    "metrics": m.figures(),
                    "seconds": round(res.seconds, 3),
                }
            )
        else:
            typer.echo(f"worker node: trained ({res.seconds:.1f} s); node 0 writes the adapter")
        return
    if as_json:
        emit_json(
            {
                "adapter": str(res.adapter_dir),
                "run_dir": str(res.run_dir),
                "run_id": res.run_id,
                "fingerprint": res.manifest.inputs.fingerprint,
                "metrics": m.figures(),
                "seconds": round(res.seconds, 3),
            }
        )
        return
    typer.echo(
        f"adapter: {res.adapter_dir}\ntrain_loss {figure(m.train_loss)}  eval_loss {figure(m.eval_loss)}  "
        f"tokens/s {m.tokens_per_s or 0:.0f}  mfu {figure(m.mfu)}  ({res.seconds:.1f} s)"
    )


def _plan_lines(plan: dict) -> list[str]:
    """`train --dry-run` for people: the run directory, the command, then the resolved config as YAML."""
    import shlex

    import yaml

    how = f"{plan['processes']} process(es), launcher {plan['launcher']}"
    if plan["strategy"]:
        how += f", {plan['strategy']['strategy']} ({plan['strategy']['reason']})"
    return [
        f"run dir: {plan['run_dir']}",
        f"{how}",
        f"would launch: {shlex.join(plan['command'])}",
        "resolved.yml:",
        yaml.safe_dump(plan["resolved_config"], sort_keys=False).rstrip(),
    ]
