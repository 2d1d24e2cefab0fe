"""Jobs a scheduler or a sidecar runs: `pipeline run` and `pipeline follow-alias`."""

from __future__ import annotations

import contextlib
import json
import os
import threading
from pathlib import Path
from typing import Annotated

import typer

from pipeline.cli._common import (
    DryRunOption,
    JsonOption,
    adapter_name,
    emit_json,
    finite,
    log,
    print_plan,
    project_config,
    resolve_error,
)
from pipeline.cli._training import (
    CONTEXT,
    DashDashCommand,
    GpusOption,
    LauncherOption,
    Strategy,
    StrategyOption,
    launcher_args,
)
from pipeline.errors import LockedError, UsageError
from pipeline.interrupt import Interrupted
from pipeline.train.schema import refuse_unknown_keys

app = typer.Typer()


@app.command("run", cls=DashDashCommand, context_settings=CONTEXT)
def run_cmd(
    ctx: typer.Context,
    config: Annotated[Path, typer.Argument(help="axolotl YAML")],
    name: Annotated[
        str | None, typer.Option(help="adapter name (default: config stem)", callback=adapter_name)
    ] = None,
    force: Annotated[bool, typer.Option(help="train even if the inputs are unchanged")] = False,
    set_: Annotated[list[str], typer.Option("--set", help="override a config key: key=value")] = [],
    overlay: Annotated[
        list[Path], typer.Option(help="YAML merged over CONFIG, e.g. axolotl_configs/fsdp2.yml")
    ] = [],
    allow: Annotated[list[str], typer.Option(help="accept a setting the fleet refuses (check id)")] = [],
    gpus: GpusOption = 1,
    launcher: LauncherOption = None,
    strategy: StrategyOption = Strategy.auto,
    locked_ok: Annotated[
        bool,
        typer.Option(
            "--locked-ok",
            help="exit 0 when another run of this adapter holds the lock (for Kubernetes Jobs, which "
            "fail on any other code; the last line still says `locked`)",
        ),
    ] = False,
    dry_run: DryRunOption = False,
    as_json: JsonOption = False,
):
    """The scheduled job: retrain if inputs changed, validate, register, publish.

    Retrain if inputs changed, validate, register, gate, publish. Last line: one JSON object.

    Exit codes: 0 published or skipped, 1 check failed, 2 usage, 3 locked, 4 fleet, 5 gated,
    143/130 stopped by SIGTERM/SIGINT (status `killed`; a publish in progress is completed first).
    --dry-run says whether it would skip, ship a registered version or train, and changes nothing
    (--json: as one JSON object; the run itself always prints JSON last).
    """
    if as_json and not dry_run:
        raise UsageError("--json goes with --dry-run: `pipeline run` ends with one JSON line anyway")
    if dry_run:
        refuse_unknown_keys(config, set_, overlay, cached_only=True)
        from pipeline.jobs.run import run_plan  # lazy: as `run` below

        plan = run_plan(
            project_config(),
            config,
            name=name,
            force=force,
            overrides=set_,
            overlays=overlay,
            allow=set(allow),
            gpus=gpus,
            launcher=launcher.value if launcher else None,
            launcher_args=launcher_args(ctx),
            strategy=strategy.value,
        )
        return print_plan(plan, as_json, [f"{plan['name']}: would {plan['plan']}: {plan['reason']}"])
    try:
        after = launcher_args(ctx)
        # usage and key errors first, from axolotl's cached keys only (a skipped run must stay fast): < 1 s
        refuse_unknown_keys(config, set_, overlay, cached_only=True)
        from pipeline.jobs.run import run  # lazy: registry, training and release cost ~2 s of imports

        out = run(
            project_config(),
            config,
            name=name,
            force=force,
            overrides=set_,
            overlays=overlay,
            allow=set(allow),
            gpus=gpus,
            launcher=launcher.value if launcher else None,
            launcher_args=after,
            strategy=strategy.value,
            show_progress=True,  # a bar on a terminal, a progress line every 30 s otherwise
        )
    except (Exception, Interrupted) as e:
        # The last line is the job's JSON outcome whatever happened; the error itself, its message
        # and its exit code are `PipelineGroup`'s (the one mapping), after this.
        if locked_ok and isinstance(e, LockedError):
            log.warning("%s (--locked-ok: exit 0)", e)
            typer.echo(json.dumps({"status": "locked", "reason": str(e).splitlines()[0], "exit_code": 0}))
            return
        resolved = resolve_error(e)
        if resolved is not None:
            typer.echo(final_line(*resolved))
        raise
    typer.echo(out.to_json())


def final_line(e: BaseException, code: int) -> str:
    """The JSON outcome `pipeline run` prints last when it did not finish: gated, locked, killed, failed."""
    outcome = getattr(e, "outcome", None)
    if isinstance(e, Interrupted) and outcome is not None:
        outcome.reason = f"{e} during {outcome.stage}" + (f": {outcome.reason}" if outcome.reason else "")
    if outcome is not None:
        return outcome.to_json(exit_code=code)
    status = {3: "locked"}.get(code, "killed" if isinstance(e, Interrupted) else "failed")
    return json.dumps({"status": status, "reason": str(e).splitlines()[0], "exit_code": code})


@app.command("follow-alias")
def follow_alias_cmd(
    alias: Annotated[str, typer.Argument(help="alias to follow")] = "production",
    interval: Annotated[
        float, typer.Option(min=0.1, callback=finite, help="seconds between registry polls")
    ] = 30.0,
    once: Annotated[bool, typer.Option(help="poll once and exit")] = False,
    name: Annotated[
        list[str] | None,
        typer.Option("--name", help="models to follow (default: all)", callback=adapter_name),
    ] = None,
    webhook_port: Annotated[
        int | None, typer.Option(min=0, max=65535, help="also take MLflow webhooks on 127.0.0.1:PORT")
    ] = None,
    webhook_host: Annotated[str, typer.Option(help="webhook listen address")] = "127.0.0.1",
    webhook_secret_env: Annotated[
        str, typer.Option(help="env var holding the webhook's HMAC secret")
    ] = "PIPELINE_WEBHOOK_SECRET",
    dry_run: DryRunOption = False,
    as_json: JsonOption = False,
):
    """Publish a model's ALIAS version whenever the alias moves.

    Publish a model's ALIAS version whenever the alias moves (e.g. in the MLflow UI). `--dry-run`: what one
    pass would publish now."""
    from pipeline.jobs.follow import follow_alias, follow_plan  # lazy: `pipeline run` must not pay for these
    from pipeline.jobs.webhook import WebhookReceiver  # lazy: as above

    cfg = project_config(store="read")  # a sidecar may start before the first registration
    secret = os.environ.get(webhook_secret_env, "")
    if webhook_port is not None and not secret:
        raise UsageError(f"--webhook-port needs the HMAC secret in ${webhook_secret_env}")
    if dry_run:
        # no store yet: nothing registered, and reading through MLflow's client would create it
        rows = follow_plan(cfg, alias, name or None) if cfg.store_exists() else []
        lines = [
            f"{r['name']}: {alias} -> v{r['alias_version']}: "
            + ("would publish" if r["action"] == "publish" else "already shipped, nothing to do")
            if r["alias_version"] is not None
            else f"{r['name']}: no {alias} alias, nothing to do"
            for r in rows
        ] or ["no registered model: nothing to publish"]
        return print_plan(
            {"dry_run": True, "action": "follow-alias", "alias": alias, "models": rows}, as_json, lines
        )
    wake = threading.Event()
    ctx = contextlib.nullcontext()
    if webhook_port is not None:
        ctx = WebhookReceiver(webhook_host, webhook_port, secret, wake, alias=alias)
        if as_json:  # stdout holds the one JSON document
            log.info("webhook receiver: %s", ctx.url)
        else:
            typer.echo(f"webhook receiver: {ctx.url}")
    with ctx:
        try:
            done = follow_alias(cfg, alias, interval, once, names=name or None, wake=wake)
        except Interrupted as e:  # a sidecar's normal stop (a publish in flight was completed first)
            log.info("follow-alias: %s", e)
            return
    if once and as_json:
        emit_json({"published": [{"name": p.name, "version": p.version, "path": str(p.path)} for p in done]})
    elif once:
        typer.echo(f"published {len(done)} version(s)")
