"""`pipeline canary ADAPTER --staging URL`: parity with PEFT and speculative-decoding speed on a staging engine.

Exit codes: 0 pass, 1 canary failed (or could not run on the instance), 2 usage, 4 staging unreachable.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from pipeline import canary as cn
from pipeline.cli._common import JsonOption, adapter_name, exit_as, project_config
from pipeline.errors import CheckFailed, FleetError, UsageError
from pipeline.fleet.client import InstanceError, Unreachable
from pipeline.validate import default_base

app = typer.Typer()


def _fmt(x, spec: str = ".3f", unit: str = "") -> str:
    return "n/a" if x is None else f"{x:{spec}}{unit}"


def render(res) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console()
    t = Table(title=f"canary: {res.adapter} on {res.staging} ({res.served.get('engine_model')})")
    for col in (
        "",
        "token agreement",
        "first divergence",
        "max logprob diff",
        "acceptance rate",
        "acceptance length",
        "time/token",
    ):
        t.add_column(col)
    for k in ("base", "adapter"):
        p, s = res.parity[k], res.speed[k]
        t.add_row(
            k,
            f"{p.agreement:.3f} ({p.exact}+{p.tied}/{p.positions})",
            "none" if p.first_divergence is None else f"{p.first_divergence} ({p.first_divergence_prompt})",
            f"{p.max_logprob_diff:.4f}",
            _fmt(s.acceptance_rate),
            _fmt(s.mean_acceptance_length, ".2f"),
            "n/a" if s.tpot_s is None else f"{s.tpot_s * 1000:.1f} ms",
        )
    con.print(t)
    con.print(
        f"speed ratio (adapter/base) {_fmt(res.speed_ratio, '.2f')}  acceptance ratio "
        f"{_fmt(res.acceptance_ratio, '.2f')}  tolerance {res.tolerance}  prompts {len(res.prompts)}  "
        f"served {res.served.get('checkpoint')}@{res.served.get('revision') or '-'} "
        f"(vLLM {res.served.get('vllm_version')})",
        highlight=False,
    )
    for n in res.notes:
        con.print(f"[cyan]note:[/] {n}", highlight=False)
    for p in res.problems:
        con.print(f"[red]problem:[/] {p}", highlight=False)
    con.print(f"verdict: [bold {'green' if res.verdict == 'pass' else 'red'}]{res.verdict}[/]")


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
    as_json: JsonOption = False,
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
    files = list(validation) or None
    try:
        if Path(adapter).is_dir():
            if version is not None or alias is not None:
                raise UsageError(f"{adapter} is a directory: --version/--alias are for registered models")
            base_dir = base or default_base(cfg, Path(adapter))
            if base_dir is None:
                raise UsageError(
                    "no base checkpoint for the PEFT reference: pass --base DIR or set base.path"
                )
            res = cn.run_canary(cfg, Path(adapter), base_dir, staging, instance_path, files)
        else:
            if instance_path:
                raise UsageError(
                    "--instance-path is for directory adapters (registered versions are "
                    "unpacked under canary.staging_dir, seen at canary.staging_mount)"
                )
            _, res = cn.canary_version(cfg, adapter, version, alias, staging, base, files, save=record)
    except Unreachable as e:
        raise FleetError(f"staging instance unreachable: {e}") from e
    except InstanceError as e:
        raise cn.CanaryError(f"staging instance error: {e}") from e
    if as_json:
        typer.echo(json.dumps(res.to_dict(), indent=2, default=str))
    else:
        render(res)
    exit_as(CheckFailed, res.verdict != "pass")
