"""`pipeline merge`: fold a LoRA into the bf16 base (streamed) and gate it on parity with peft.

Keep this module light: import heavy libraries inside the command functions.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer


def register(app: typer.Typer) -> None:
    """Add `pipeline merge` to the main app."""
    app.command("merge")(merge)


def merge(
    adapter: Annotated[
        Path, typer.Argument(help="PEFT adapter directory (adapter_config.json + adapter_model.safetensors)")
    ],
    base: Annotated[Path, typer.Option(help="bf16 base checkpoint directory (safetensors shards)")],
    out: Annotated[Path, typer.Option(help="new directory for the merged checkpoint (must not exist)")],
    dtype: Annotated[
        str, typer.Option(help="dtype of the merged weights: bfloat16, float16, float32")
    ] = "bfloat16",
    parity: Annotated[
        str, typer.Option(help="parity gate vs peft: auto (small text-layout bases), on, off")
    ] = "auto",
    name: Annotated[str | None, typer.Option(help="registered model name to tag with the verdict")] = None,
    version: Annotated[
        int | None, typer.Option(help="registered model version to tag with the verdict")
    ] = None,
    hash_files: Annotated[
        bool, typer.Option("--hash/--no-hash", help="sha256 of every output file in manifest.json")
    ] = True,
    progress: Annotated[bool, typer.Option(help="progress bar per shard (on a terminal)")] = True,
    threads: Annotated[
        int, typer.Option(help="torch threads for the merge arithmetic (0: torch default)")
    ] = 1,
):
    """Merge ADAPTER into --base, writing --out atomically. Exit 0 ok, 1 mismatch/parity failed, 2 bad input."""
    from pipeline.cli import handle_errors

    handle_errors(_merge)(adapter, base, out, dtype, parity, name, version, hash_files, progress, threads)


def _merge(adapter, base, out, dtype, parity, name, version, hash_files, progress, threads) -> None:
    from pipeline.errors import UsageError
    from pipeline.manifest import read_manifest
    from pipeline.merge import merge_adapter, registered_version
    from pipeline.merge_parity import ParityFailed, parity_gate

    if (name is None) != (version is None):
        raise UsageError("give both --name and --version (or neither)")
    target = {"name": name, "version": version} if name else None
    if target is None:
        try:
            target = registered_version(read_manifest(adapter))
        except (FileNotFoundError, ValueError):
            target = None
    gate = parity_gate(base, adapter, dtype, parity)
    try:
        res = merge_adapter(
            adapter,
            base,
            out,
            dtype=dtype,
            progress=progress and sys.stderr.isatty(),
            hash_files=hash_files,
            finalize=gate,
            threads=threads or None,
        )
    except ParityFailed as e:
        if target:
            _tag(target, {"parity": e.verdict}, out, explicit=name is not None)
        raise
    if target:
        _tag(target, res.manifest, out, explicit=name is not None)
    m, p = res.manifest["merge"], res.manifest["parity"]
    detail = (
        f"max |diff| {p['max_abs_diff']:.3g} <= {p['tolerance']:.3g}, greedy equal {p['greedy_equal']}, {p['seconds']} s"
        if p["verdict"] != "skipped"
        else p["reason"]
    )
    typer.echo(
        f"merged {m['merged_modules']}/{m['lora_pairs']} LoRA modules into {res.out} "
        f"({res.bytes_written / 1e9:.2f} GB, {res.seconds:.1f} s, "
        f"{res.bytes_written / 1e6 / max(res.seconds, 1e-9):.0f} MB/s); parity {p['verdict']}: {detail}"
    )


def _tag(target: dict, manifest: dict, out: Path, explicit: bool) -> None:
    """Put the verdict on the MLflow version; a version named only by the adapter's manifest is best effort."""
    from pipeline import registry
    from pipeline.cli import project_config
    from pipeline.merge_parity import parity_tags

    try:
        registry.set_version_tags(
            project_config(), target["name"], int(target["version"]), parity_tags(manifest, out)
        )
    except Exception as e:
        if explicit:
            raise
        typer.echo(f"warning: could not tag {target['name']} v{target['version']} in MLflow: {e}", err=True)
