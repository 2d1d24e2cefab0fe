"""`pipeline merge-parity`: the merged NVFP4 model vs its adapter hot-loaded, on two vLLM instances.

Its own module so that `pipeline merge` does not import the canary, the fleet client and httpx.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pipeline.cli._common import (
    DryRunOption,
    JsonOption,
    adapter_name,
    emit_json,
    finite,
    print_plan,
    project_config,
)
from pipeline.errors import UsageError
from pipeline.merge.served import (
    MAX_LOGPROB_DIFF,
    MIN_AGREEMENT,
    ServedParityFailed,
    run_served_parity,
    served_parity_plan,
)
from pipeline.merge.served import record as record_served

app = typer.Typer()


@app.command("merge-parity")
def merge_parity(
    merged: Annotated[Path, typer.Argument(help="the `pipeline merge --quantize nvfp4` output directory")],
    merged_url: Annotated[str, typer.Option("--merged", help="vLLM instance serving MERGED")],
    hot_url: Annotated[
        str | None,
        typer.Option("--hot", help="NVFP4 base instance with runtime LoRA (default canary.staging_url)"),
    ] = None,
    instance_path: Annotated[
        str | None,
        typer.Option(help="the adapter's path as the hot instance sees it (default: the manifest's)"),
    ] = None,
    min_agreement: Annotated[
        float, typer.Option(min=0.0, max=1.0, callback=finite, help="token agreement floor")
    ] = MIN_AGREEMENT,
    max_logprob_diff: Annotated[
        float, typer.Option(min=0.0, callback=finite, help="largest logprob difference, nats")
    ] = MAX_LOGPROB_DIFF,
    name: Annotated[
        str | None, typer.Option(help="registered model name to record on", callback=adapter_name)
    ] = None,
    version: Annotated[int | None, typer.Option(min=1, help="registered model version to record on")] = None,
    dry_run: DryRunOption = False,
    as_json: JsonOption = False,
):
    """Merged NVFP4 model vs its adapter hot-loaded on the NVFP4 base, on vLLM: parity gate, tok/s, MTP acceptance.

    Exit 0 within the tolerance, 1 beyond it; recorded on the model version and the merged manifest."""
    if (name is None) != (version is None):
        raise UsageError("give both --name and --version (or neither)")
    cfg = project_config(store="existing") if name else None
    if name is not None:  # the version to record on exists, before the engines are driven
        from pipeline import registry  # lazy: only a recorded comparison pays for the registry

        registry.resolve_version(cfg, name, version=version)
    if dry_run:
        plan = served_parity_plan(cfg or project_config(), merged, hot_url, merged_url)
        target = {"name": name, "version": version} if name else plan["registered"]
        lines = [
            f"would load {plan['adapter']} on {plan['hot']} under a temporary name and compare it with {merged} "
            f"served at {plan['merged']} ({plan['prompts']} prompts x {plan['max_tokens']} tokens); "
            + (f"record on {target['name']} v{target['version']} and on" if target else "record on")
            + " the merged manifest"
        ]
        return print_plan(
            {"dry_run": True, "action": "merge-parity", **plan, "record_on": target}, as_json, lines
        )
    rec = run_served_parity(
        cfg or project_config(),
        merged,
        hot_url,
        merged_url,
        instance_path=instance_path,
        min_agreement=min_agreement,
        max_logprob_diff=max_logprob_diff,
    )
    target = {"name": name, "version": version} if name else rec.get("registered")
    if target and cfg is None:
        try:
            cfg = project_config(store="existing")
        except Exception as e:  # the manifest's version is best effort, as in `pipeline merge`
            typer.echo(f"warning: cannot record on {target['name']} v{target['version']}: {e}", err=True)
            target = None
    record_served(cfg, rec, target)
    p = rec["parity"]
    if as_json:
        emit_json(rec)
    else:
        for side in ("base", "hot", "merged"):
            s = rec[side]
            tok_s = f"{s['decode_tok_s']:.1f}" if s["decode_tok_s"] else "-"
            acc = f"{s['acceptance_length']:.2f}" if s["acceptance_length"] else "-"
            typer.echo(f"{side:7s} {s['engine_model']}: {tok_s} tok/s decode, MTP acceptance length {acc}")
        typer.echo(
            f"parity {p['verdict']}: agreement {p['agreement']:.3f} (>= {min_agreement}), max logprob diff "
            f"{p['max_logprob_diff']:.3f} nats (<= {max_logprob_diff}), {p['identical_prompts']}/{p['prompts']} "
            "prompts identical"
        )
    if p["verdict"] != "pass":
        raise ServedParityFailed(
            "merged model differs from the hot-loaded adapter: " + "; ".join(p["reasons"])
        )
