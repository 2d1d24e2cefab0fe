"""`pipeline draft`: distil an MTP drafter for a model version (pipeline.draft)."""

from __future__ import annotations

from enum import StrEnum
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
from pipeline.draft import draft_plan, draft_version

app = typer.Typer()


class DraftDevice(StrEnum):
    cpu = "cpu"
    cuda = "cuda"


@app.command("draft")
def draft(
    name: Annotated[str, typer.Argument(help="registered model name", callback=adapter_name)],
    version: Annotated[int, typer.Option(min=1, help="the model version to distil a drafter for")],
    base: Annotated[
        Path | None,
        typer.Option(help="bf16 base with its mtp.* tensors (default: base.path, the manifest's)"),
    ] = None,
    budget_s: Annotated[
        float,
        typer.Option(
            min=0.0, callback=finite, help="seconds of the training loop (data and estimates on top)"
        ),
    ] = 60.0,
    max_steps: Annotated[
        int | None, typer.Option(min=1, help="also stop after this many optimizer steps")
    ] = None,
    lr: Annotated[
        float, typer.Option(min=0.0, callback=finite, help="AdamW learning rate of the MTP layer")
    ] = 1e-4,
    device: Annotated[
        DraftDevice, typer.Option(help="where to distil (cuda for real bases)")
    ] = DraftDevice.cpu,
    seed: Annotated[int, typer.Option(min=0, help="random seed")] = 0,
    out: Annotated[Path | None, typer.Option(help="also keep the drafter directory here (replaced)")] = None,
    dry_run: DryRunOption = False,
    as_json: JsonOption = False,
):
    """Distil an MTP drafter for a model version: the base's MTP layer trained on the adapter's own outputs.

    Self-distils `mtp.*` on the adapted target's greedy continuations of the adapter's training prompts (base
    and LoRA frozen), checks it (only mtp.* tensors, the served checkpoint's shapes and dtypes, finite, a better
    acceptance estimate than the base's MTP layer) and records it: an MLflow run linked to the version with the
    drafter as its `drafter` artifact, `drafter.*` tags on the version. Exit 1 when the drafter is refused,
    2 for an unknown version or missing data. docs/drafter.md."""
    if dry_run:
        plan = draft_plan(
            project_config(store="existing"), name, version, base_dir=base, budget_s=budget_s, max_steps=max_steps,
            lr=lr, device=device.value, seed=seed, out=str(out) if out else None,
        )  # fmt: skip
        lines = [
            f"would distil the MTP layer of {plan['base']} ({plan['mtp_tensors']} mtp.* tensors) for {name} "
            f"v{version} on {device.value}, {budget_s:g} s"
            + (f" or {max_steps} steps" if max_steps else "")
            + f", on {len(plan['train_files'])} training file(s) and {len(plan['validation_files'])} validation "
            f"file(s); checked against {plan['reference']}; recorded as an MLflow run and drafter.* tags on the version",
        ] + ([f"would replace {plan['replaces']} with the drafter"] if plan["replaces"] else [])
        return print_plan({"dry_run": True, "action": "draft", **plan}, as_json, lines)
    res = draft_version(
        project_config(store="existing"), name, version, base_dir=base, budget_s=budget_s, max_steps=max_steps, lr=lr,
        device=device.value, seed=seed, out=out,
    )  # fmt: skip
    data = {
        "name": res.name,
        "version": res.version,
        "run_id": res.run_id,
        "artifact_uri": res.artifact_uri,
        "sha256": res.sha256,
        "acceptance_length_before": res.before,
        "acceptance_length_after": res.after,
        "seconds": res.seconds,
        "out": str(res.out) if res.out else None,
    }
    if as_json:
        emit_json(data)
    else:
        typer.echo(
            f"drafter for {res.name} v{res.version}: acceptance length {res.before} -> {res.after} (estimate), "
            f"sha256 {res.sha256[:12]}, run {res.run_id}, artifact {res.artifact_uri}"
        )
