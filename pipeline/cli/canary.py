"""`pipeline canary ADAPTER --staging URL`: parity with PEFT and speculative-decoding speed on a staging engine.

Exit codes: 0 pass, 1 canary failed (or could not run on the instance), 2 usage, 4 staging unreachable.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pipeline import canary as cn
from pipeline.cli._common import (
    DryRunOption,
    JsonOption,
    adapter_name,
    emit_json,
    exit_as,
    print_plan,
    project_config,
)
from pipeline.cli.render import Column, NoHeadersOption, Output, OutputOption, output_format, print_rows
from pipeline.errors import CheckFailed, FleetError, UsageError
from pipeline.fleet.client import InstanceError, Unreachable
from pipeline.validate import default_base

app = typer.Typer()


def _fmt(x, spec: str = ".3f", unit: str = "") -> str:
    return "n/a" if x is None else f"{x:{spec}}{unit}"


CANARY_COLUMNS = (
    Column("RUN", lambda r: r["run"]),
    Column("TOKEN_AGREEMENT", lambda r: r["agreement"]),
    Column("FIRST_DIVERGENCE", lambda r: r["divergence"]),
    Column("MAX_LOGPROB_DIFF", lambda r: r["logprob"]),
    Column("ACCEPTANCE_RATE", lambda r: r["rate"]),
    Column("ACCEPTANCE_LENGTH", lambda r: r["length"]),
    Column("TIME_PER_TOKEN", lambda r: r["tpot"]),
)


def render(res, fmt: Output = Output.table, no_headers: bool = False) -> None:
    """One line for the base and one for the adapter, then (for people) ratios, notes, problems, verdict."""
    if fmt is Output.json:
        return emit_json(res.to_dict())
    rows = []
    for k in ("base", "adapter"):
        p, s = res.parity[k], res.speed[k]
        rows.append(
            {
                "run": k,
                "agreement": f"{p.agreement:.3f}({p.exact}+{p.tied}/{p.positions})",
                "divergence": "none"
                if p.first_divergence is None
                else f"{p.first_divergence}@{p.first_divergence_prompt}",
                "logprob": f"{p.max_logprob_diff:.4f}",
                "rate": _fmt(s.acceptance_rate),
                "length": _fmt(s.mean_acceptance_length, ".2f"),
                "tpot": "n/a" if s.tpot_s is None else f"{s.tpot_s * 1000:.1f}ms",
            }
        )
    print_rows(rows, CANARY_COLUMNS, fmt, no_headers=no_headers)
    if fmt in (Output.tsv, Output.name):
        return
    typer.echo(
        f"canary: {res.adapter} on {res.staging} ({res.served.get('engine_model')}): speed ratio "
        f"(adapter/base) {_fmt(res.speed_ratio, '.2f')}  acceptance ratio {_fmt(res.acceptance_ratio, '.2f')}  "
        f"tolerance {res.tolerance}  prompts {len(res.prompts)}  served "
        f"{res.served.get('checkpoint')}@{res.served.get('revision') or '-'} (vLLM {res.served.get('vllm_version')})"
    )
    if res.effect is not None:
        e = res.effect
        typer.echo(
            f"adapter effect (teacher-forced, nats/token): engine {e.engine_nats:.3f}, PEFT reference "
            f"{e.reference_nats:.3f}, retention {_fmt(e.retention, '.2f')}, correlation {_fmt(e.correlation, '.2f')}, "
            f"base gap {e.base_gap_nats:.3f} ({e.positions} tokens)"
        )
    for n in res.notes:
        typer.echo(f"note: {n}")
    for p in res.problems:
        typer.echo(f"problem: {p}")
    color = "green" if res.verdict == "pass" else "red"
    typer.echo(f"verdict: {typer.style(res.verdict, fg=color, bold=True)}")


@app.command()
def canary(
    adapter: Annotated[str, typer.Argument(help="registered model name, or an adapter directory")],
    staging: Annotated[
        str | None, typer.Option(help="staging vLLM base URL (default: canary.staging_url)")
    ] = None,
    version: Annotated[int | None, typer.Option(min=1, help="model version (registered adapter)")] = None,
    alias: Annotated[str | None, typer.Option(help="model alias (default: candidate)")] = None,
    base: Annotated[
        Path | None,
        typer.Option(help="bf16 base for the PEFT reference (default: base.path or the manifest's base)"),
    ] = None,
    validation: Annotated[
        list[Path], typer.Option(help="validation chat JSONL (default: from manifest.json)")
    ] = [],
    instance_path: Annotated[
        str | None,
        typer.Option(
            help="directory adapter: its path as the staging instance sees it (default: absolute local path)"
        ),
    ] = None,
    record: Annotated[bool, typer.Option(help="record the result on the model version")] = True,
    dry_run: DryRunOption = False,
    as_json: JsonOption = False,
    output: OutputOption = None,
    no_headers: NoHeadersOption = False,
):
    """Parity with PEFT and spec-decode speed of an adapter on a staging vLLM.

    Load ADAPTER on a staging vLLM under a temporary name, compare it with PEFT, measure its speed.

    Parity (greedy tokens, top logprobs) against PEFT + transformers, for the base and the
    adapter; speculative-decoding acceptance and time per output token from /metrics, adapter
    vs base. A registered version gets the result as `canary.*` tags (see `pipeline status`).
    Exit 0 pass, 1 fail, 2 usage, 4 staging unreachable.
    """
    if not Path(adapter).is_dir():
        adapter_name(adapter)  # a registered model's name: the grammar, before any work
    # a registered name needs the registry to exist already (never create an empty store here)
    cfg = project_config(
        store="any" if Path(adapter).is_dir() else "existing", what=f"registered model {adapter!r}"
    )
    fmt = output_format(output, as_json)
    files = list(validation) or None
    # the options' refusals, before anything runs (the dry run's too)
    if Path(adapter).is_dir() and (version is not None or alias is not None):
        raise UsageError(f"{adapter} is a directory: --version/--alias are for registered models")
    if instance_path and not Path(adapter).is_dir():
        raise UsageError(
            "--instance-path is for directory adapters (registered versions are "
            "unpacked under canary.staging_dir, seen at canary.staging_mount)"
        )
    for f in files or []:
        if not f.is_file():
            raise UsageError(f"--validation {f}: not a file (a chat JSONL)")
    if dry_run:
        plan = cn.canary_plan(cfg, adapter, version, alias, staging, base, record)
        as_json = fmt is Output.json
        lines = [
            f"would load {plan['adapter']} on the staging instance {plan['staging']} under a temporary name, "
            f"compare {plan['prompts']} prompts x {plan['max_tokens']} tokens with PEFT on {plan['base']}, "
            + ("record the result on the model version" if plan["record"] else "record nothing")
        ]
        return print_plan({"dry_run": True, "action": "canary", **plan}, as_json, lines)
    try:
        if Path(adapter).is_dir():
            base_dir = base or default_base(cfg, Path(adapter))
            if base_dir is None:
                raise UsageError(
                    "no base checkpoint for the PEFT reference: pass --base DIR or set base.path"
                )
            res = cn.run_canary(cfg, Path(adapter), base_dir, staging, instance_path, files)
        else:
            _, res = cn.canary_version(cfg, adapter, version, alias, staging, base, files, save=record)
    except Unreachable as e:
        raise FleetError(f"staging instance unreachable: {e}") from e
    except InstanceError as e:
        raise cn.CanaryError(f"staging instance error: {e}") from e
    render(res, fmt, no_headers)
    exit_as(CheckFailed, res.verdict != "pass")
