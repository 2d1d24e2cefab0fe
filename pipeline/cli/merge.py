"""`pipeline merge`: fold a LoRA into the bf16 base (streamed) and gate it on parity with peft."""

from __future__ import annotations

import sys
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

from pipeline.artifacts.manifest import MergeParity, read_adapter_manifest
from pipeline.cli._common import DryRunOption, JsonOption, adapter_name, emit_json, print_plan, project_config
from pipeline.errors import UsageError
from pipeline.merge import merge_adapter, merge_and_quantize, merge_preview
from pipeline.merge.parity import ParityFailed, parity_gate, parity_tags
from pipeline.merge.quantize import load_calibration, modelopt_version

app = typer.Typer()


class Dtype(StrEnum):
    bfloat16 = "bfloat16"
    float16 = "float16"
    float32 = "float32"


class Quantize(StrEnum):
    none = "none"  # the bf16 merge only
    nvfp4 = (
        "nvfp4"  # then ModelOpt NVFP4 + MTP, as the fleet's served checkpoint (pipeline/merge/quantize.py)
    )


class Device(StrEnum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class ParityMode(StrEnum):
    auto = "auto"  # small text-layout bases only
    on = "on"
    off = "off"


@app.command()
def merge(
    adapter: Annotated[
        Path, typer.Argument(help="PEFT adapter directory (adapter_config.json + adapter_model.safetensors)")
    ],
    base: Annotated[Path, typer.Option(help="bf16 base checkpoint directory (safetensors shards)")],
    out: Annotated[Path, typer.Option(help="new directory for the merged checkpoint (must not exist)")],
    dtype: Annotated[Dtype, typer.Option(help="dtype of the merged weights")] = Dtype.bfloat16,
    parity: Annotated[
        ParityMode, typer.Option(help="parity gate vs peft: auto (small text-layout bases), on, off")
    ] = ParityMode.auto,
    name: Annotated[
        str | None, typer.Option(help="registered model name to tag with the verdict", callback=adapter_name)
    ] = None,
    version: Annotated[
        int | None, typer.Option(min=1, help="registered model version to tag with the verdict")
    ] = None,
    hash_files: Annotated[
        bool, typer.Option("--hash/--no-hash", help="sha256 of every output file in manifest.json")
    ] = True,
    progress: Annotated[bool, typer.Option(help="progress bar per shard (on a terminal)")] = True,
    threads: Annotated[
        int, typer.Option(min=0, max=1024, help="torch threads for the merge arithmetic (0: torch default)")
    ] = 1,
    quantize: Annotated[
        Quantize, typer.Option(help="after the bf16 merge, quantize as the fleet's served checkpoint")
    ] = Quantize.none,
    device: Annotated[
        Device, typer.Option(help="--quantize: where modelopt calibrates and packs")
    ] = Device.auto,
    calib_data: Annotated[
        Path | None, typer.Option(help="--quantize: chat JSONL for calibration (default: built-in prompts)")
    ] = None,
    dry_run: DryRunOption = False,
    as_json: JsonOption = False,
):
    """Merge an adapter into the bf16 base, streamed, gated on parity.

    Merge ADAPTER into --base, writing --out atomically. Exit 0 ok, 1 mismatch/parity failed, 2 bad input."""
    if (name is None) != (version is None):
        raise UsageError("give both --name and --version (or neither)")
    target = {"name": name, "version": version} if name else None
    if target is None:
        try:
            ref = read_adapter_manifest(adapter).registered_version()
        except (FileNotFoundError, ValueError):
            ref = None
        target = {"name": ref.name, "version": ref.version} if ref else None
    if name is not None:  # an explicit version to tag must exist before hours of merging, not after
        from pipeline import registry  # lazy: only a tagged merge pays for the registry

        registry.resolve_version(project_config(store="existing"), name, version=version)
    if dry_run:
        if quantize is not Quantize.none:
            if dtype is not Dtype.bfloat16:
                raise UsageError(
                    f"--quantize {quantize.value} quantizes the bf16 merge: drop --dtype {dtype.value}"
                )
            modelopt_version()  # installed
            load_calibration(calib_data)  # readable
        plan = merge_preview(adapter, base, out, dtype.value, device.value) | {
            "parity": parity.value, "quantize": quantize.value, "tag": target}  # fmt: skip
        lines = [
            f"would merge {plan['lora_pairs']} LoRA pairs of {adapter} into {base} ({plan['layout']} layout) as "
            f"{dtype.value} on {plan['device']}, writing {out} ({plan['shards']} shard(s), "
            f"{plan['bytes'] / 1e6:,.1f} MB; {plan['free_bytes'] / 1e9:,.1f} GB free there)",
            f"parity gate: {parity.value}; quantize: {quantize.value}; "
            + (
                f"verdict tagged on {target['name']} v{target['version']}"
                if target
                else "no model version to tag"
            ),
        ]
        return print_plan({"dry_run": True, "action": "merge", **plan}, as_json, lines)
    gate = parity_gate(base, adapter, dtype.value, parity.value)
    show = progress and sys.stderr.isatty() and not as_json
    try:
        if quantize is Quantize.none:
            res = merge_adapter(
                adapter,
                base,
                out,
                dtype=dtype.value,
                progress=show,
                hash_files=hash_files,
                finalize=gate,
                threads=threads or None,
                device=device.value,
            )
        else:
            if dtype is not Dtype.bfloat16:
                raise UsageError(
                    f"--quantize {quantize.value} quantizes the bf16 merge: drop --dtype {dtype.value}"
                )
            items, source = load_calibration(calib_data)
            res = merge_and_quantize(
                adapter,
                base,
                out,
                quantize.value,
                device=device.value,
                calibration=items,
                calibration_source=source,
                progress=show,
                finalize=gate,
                threads=threads or None,
            )
    except ParityFailed as e:
        if target:
            _tag(target, parity_tags(out, MergeParity.model_validate(e.verdict)), name is not None)
        raise
    if target:
        _tag(target, parity_tags(out, res.manifest.parity, res.manifest), name is not None)
    m, p, q = res.manifest.merge, res.manifest.parity, res.manifest.quantization
    if as_json:
        return emit_json(
            {
                "out": str(res.out),
                "merge": m.model_dump(exclude_none=True),
                "parity": p.model_dump(exclude_none=True),
                "quantization": q.model_dump(exclude_none=True) if q else None,
                "bytes_written": res.bytes_written,
                "seconds": round(res.seconds, 3),
                "tagged": target,
            }
        )
    detail = (
        f"max |diff| {p.max_abs_diff:.3g} <= {p.tolerance:.3g}, greedy equal {p.greedy_equal}, {p.seconds} s"
        if p.verdict != "skipped"
        else p.reason
    )
    typer.echo(
        f"merged {m.merged_modules}/{m.lora_pairs} LoRA modules into {res.out} "
        f"({res.bytes_written / 1e9:.2f} GB, {res.seconds:.1f} s, "
        f"{res.bytes_written / 1e6 / max(res.seconds, 1e-9):.0f} MB/s); parity {p.verdict}: {detail}"
    )
    if q:
        typer.echo(
            f"quantized to {q.quant_algo} with nvidia-modelopt {q.version} on {q.device} "
            f"({len(q.exclude_modules)} exclusions, {q.mtp_tensors} mtp.* tensors kept, {q.seconds} s); "
            f"engine-side parity pending: serve {res.out} with --quantization modelopt --language-model-only, "
            "then `pipeline merge-parity`"
        )


def _tag(target: dict, tags: dict[str, str], explicit: bool) -> None:
    """Put the verdict on the MLflow version; a version named only by the adapter's manifest is best effort."""
    from pipeline import registry  # lazy: only a tagged merge pays for the registry (~0.2 s of imports)

    try:
        registry.set_version_tags(
            project_config(store="existing"),
            target["name"],
            int(target["version"]),
            tags,
        )
    except Exception as e:
        if explicit:
            raise
        typer.echo(f"warning: could not tag {target['name']} v{target['version']} in MLflow: {e}", err=True)
