"""Merge a PEFT LoRA into a safetensors base, shard by shard, without instantiating a model.

For every LoRA pair the base weight W [out, in] becomes `W + scale * (B @ A)` computed in fp32
and cast once to the output dtype (B [out, r], A [r, in]; embeddings: `(B @ A).T`, as peft's
`get_delta_weight`). Scale: `alpha / r` or `alpha / sqrt(r)` (rsLoRA) with `rank_pattern` /
`alpha_pattern` resolved by `AdapterConfig.scale_for` against the module's PEFT path, exactly as
peft matches them. Every other tensor (`mtp.*`, `model.visual.*`, norms, embeddings, lm_head) is
copied byte for byte (`preadv` into the writer's staging buffers: no Python-level copy).

Memory: each output shard is written as it goes (header first, then tensors in order), merged
weights in row chunks of ~`CHUNK_BYTES` fp32, so peak RSS is the adapter plus a few chunks,
independent of the shard size. `safetensors.torch.save_file` would need a whole shard in memory,
hence the small streaming writer below (format: 8-byte little-endian header length, JSON header
padded with spaces to 8 bytes, raw little-endian data; https://github.com/huggingface/safetensors).

Atomicity: everything is written into `<out>.partial.<pid>@<host>.XXXX` next to `out`, fsynced, the
manifest goes in last, then one `rename`. A crash leaves only that directory, never `out`, and the
next merge to the same `out` removes it (`write.clear_killed_work`).
"""

from __future__ import annotations

import datetime as dt
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.artifacts.adapter import WEIGHTS_FILE, load_adapter_config
from pipeline.artifacts.atomic import fsync_dir, write_json_atomic
from pipeline.artifacts.fingerprint import base_fingerprint
from pipeline.artifacts.hashing import sha256_file
from pipeline.artifacts.manifest import (
    MergedBase,
    MergedFrom,
    MergedManifest,
    MergeStats,
    Quantization,
    Requantization,
    ServedParity,
    file_hashes,
    package_versions,
    read_adapter_manifest,
    write_manifest,
)
from pipeline.artifacts.modes import writable_problem
from pipeline.merge.plan import INDEX, MergeError, MergeMismatch, MergePlan, plan_merge
from pipeline.merge.quantize import modelopt_version, quantize_checkpoint
from pipeline.merge.static import merge_refusals
from pipeline.merge.write import (
    clear_killed_work,
    copy_side_files,
    progress_bar,
    seal_output,
    work_dir,
    write_shard,
)

__all__ = [
    "INDEX",
    "MergeError",
    "MergeMismatch",
    "MergePlan",
    "MergeResult",
    "merge_adapter",
    "merge_and_quantize",
    "plan_merge",
]


@dataclass
class MergeResult:
    out: Path
    manifest: MergedManifest
    seconds: float  # merge and write, without `finalize` (parity)
    bytes_written: int
    merged: list[str] = field(default_factory=list)


def merge_adapter(
    adapter_dir: Path,
    base_dir: Path,
    out_dir: Path,
    dtype: str = "bfloat16",
    progress: bool = False,
    hash_files: bool = True,
    finalize=None,
    threads: int | None = 1,
    device: str = "auto",
) -> MergeResult:
    """Merge `adapter_dir` into `base_dir`, writing a complete checkpoint at `out_dir`.

    Args:
        dtype: output dtype of the merged weights (`bfloat16`, `float16`, `float32`); all other
            tensors keep their dtype and bytes.
        progress: show a rich progress bar per shard on stderr.
        hash_files: record the sha256 of every output file in the manifest (shards are hashed
            from the staging buffers as they are written, never read back).
        finalize: optional callable(partial_dir, manifest: MergedManifest) run before the manifest
            is written and the directory renamed (the parity gate); it may set `manifest.parity` or
            raise to abort.
        threads: torch intra-op threads while merging (None: torch's default). The merge is
            memory-bound; on 2 shared cores 1 thread ran at ~800 MB/s and 2 threads at ~160-280
            MB/s (OpenMP spinning; benchmarks/merge.py).

    Returns: MergeResult with the manifest written to `out_dir/manifest.json`.

    Raises:
        MergeError: `out_dir` exists, bad inputs (see `plan_merge`).
        MergeMismatch: LoRA pairs that match no base weight; an error finding of validate's static
            checks (`pipeline.merge.static`: conflicting layout copies, NaN/Inf, untrained...); or
            (a bug) a merged count that differs from the number of pairs.
        Whatever `finalize` raises. In every failure case `out_dir` is not created and the
        partial directory is removed.
    """
    from safetensors.torch import load_file

    t0 = time.time()
    adapter_dir, base_dir, out_dir = Path(adapter_dir), Path(base_dir), Path(out_dir)
    plan, static, device = _checked_plan(adapter_dir, base_dir, out_dir, dtype, device)
    import torch

    # The adapter is small: ~233 MB bf16 for the 27B at r=16 on all text linears.
    lora = load_file(str(adapter_dir / WEIGHTS_FILE))

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    clear_killed_work(out_dir)
    partial = work_dir(out_dir, "partial")
    merged: list[str] = []
    written = 0
    threads_before = torch.get_num_threads()
    try:
        if threads:
            torch.set_num_threads(threads)  # inside: a refused count must not leave `partial` behind
        side = copy_side_files(base_dir, partial)
        hashes: dict[str, object] = {}
        with (
            ThreadPoolExecutor(max_workers=1) as pool,
            ThreadPoolExecutor(max_workers=shard_workers(len(plan.shards))) as shards,
            progress_bar(progress) as bar,
        ):

            def one(shard):
                task = bar.add_task(shard.src.name, total=shard.nbytes)
                return write_shard(
                    shard,
                    partial / shard.src.name,
                    lora,
                    lambda n, t=task: bar.advance(t, n),
                    hash_files,
                    device,
                )

            for shard, (names, digest) in zip(plan.shards, shards.map(one, plan.shards), strict=True):
                merged += names
                written += shard.nbytes
                hashes[shard.src.name] = pool.submit(seal_output, partial / shard.src.name, digest)
            if plan.merged_count != len(plan.pairs) or len(merged) != len(plan.pairs):
                raise MergeMismatch(
                    f"merged {len(merged)} modules but the adapter has {len(plan.pairs)} LoRA pairs"
                )
            if plan.sharded:
                weight_map = {e.name: s.src.name for s in plan.shards for e in s.entries}
                index = {
                    "metadata": {"total_size": sum(s.nbytes for s in plan.shards)},
                    "weight_map": weight_map,
                }
                write_json_atomic(partial / INDEX, index)
            files = {n: f.result() for n, f in hashes.items()}
        files.update(
            {
                n: seal_output(partial / n, hash_file=hash_files)
                for n in side + ([INDEX] if plan.sharded else [])
            }
        )
        manifest = _manifest(plan, merged, files if hash_files else None, time.time() - t0, written)
        manifest.merge.device = str(device)
        manifest.merge.static_checks = static
        seconds = time.time() - t0
        torch.set_num_threads(threads_before)  # the gate picks its own
        if finalize is not None:
            finalize(partial, manifest)
        write_manifest(partial, manifest)
        fsync_dir(partial)
        os.rename(partial, out_dir)
        fsync_dir(out_dir.parent)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    finally:
        torch.set_num_threads(threads_before)
    return MergeResult(out_dir, manifest, seconds, written, merged)


def _checked_plan(
    adapter_dir: Path, base_dir: Path, out_dir: Path, dtype: str, device: str = "auto"
) -> tuple[MergePlan, dict, str]:
    """(merge plan, validate's static findings, the device resolved) after every check made before writing:
    `out_dir` new and creatable, the inputs (plan_merge), validate's refusals, the device, and free space for
    the output's tensors. One function, so that `merge --dry-run` refuses what the merge would refuse."""
    if out_dir.exists() or out_dir.is_symlink():
        raise MergeError(f"{out_dir} exists; merge writes a new directory (remove it or pick another --out)")
    if problem := writable_problem("--out", out_dir):
        raise MergeError(f"{problem}: pick another --out")
    plan = plan_merge(adapter_dir, base_dir, dtype)
    refused, static = merge_refusals(adapter_dir, base_dir)
    if refused:
        raise MergeMismatch(
            f"{adapter_dir}: `pipeline validate` refuses this adapter, so merge does too (nothing written):\n  "
            + "\n  ".join(str(f) for f in refused)
        )
    if device == "auto" or str(device).startswith("cuda"):
        import torch

        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        elif not torch.cuda.is_available():
            raise MergeError(f"--device {device}: no CUDA GPU is visible to torch here; use --device cpu")
    need, free = _space(plan, out_dir)
    if need >= free:
        raise MergeError(
            f"--out {out_dir}: the merged tensors need {need / 1e9:.2f} GB and {free / 1e9:.2f} GB are free there: "
            "free space or pick another --out"
        )
    return plan, static, device


def _space(plan: MergePlan, out_dir: Path) -> tuple[int, int]:
    """(bytes of the output's tensors, bytes free on the filesystem `out_dir` will be written to)."""
    where = next(p for p in (out_dir.absolute(), *out_dir.absolute().parents) if p.exists())
    return sum(sh.nbytes for sh in plan.shards), shutil.disk_usage(where).free


def merge_preview(
    adapter_dir: Path, base_dir: Path, out_dir: Path, dtype: str = "bfloat16", device: str = "auto"
) -> dict:
    """What `merge_adapter` would write, after the same checks, writing nothing (`pipeline merge --dry-run`).

    Returns {"adapter", "base", "out", "dtype", "device", "layout", "lora_pairs", "shards", "bytes" (the output's
    tensor bytes), "free_bytes" (free on the filesystem `out` would be written to)}.
    Raises what merge_adapter raises before it writes: MergeError (`out_dir` exists or cannot be created, bad
    inputs, no GPU for `--device cuda`, not enough space), MergeMismatch.
    """
    adapter_dir, base_dir, out_dir = Path(adapter_dir), Path(base_dir), Path(out_dir)
    plan, _, device = _checked_plan(adapter_dir, base_dir, out_dir, dtype, device)
    nbytes, free = _space(plan, out_dir)
    return {"adapter": str(adapter_dir), "base": str(base_dir), "out": str(out_dir), "dtype": dtype,
            "device": device, "layout": plan.layout, "lora_pairs": len(plan.pairs), "shards": len(plan.shards),
            "bytes": nbytes, "free_bytes": free}  # fmt: skip


def shard_workers(n_shards: int) -> int:
    """Shards merged at once: all of them, up to two per core.

    Each shard has a compute, a write and a sha256 thread that mostly wait (on the disk, or inside
    C code that releases the GIL); a single sha256 stream runs ~1.9 GB/s on one core and was the
    bound. benchmarks/merge.py, 2 shared cores, 3 shards: 5.3-11.5 s with the three at once vs
    10.9-11.8 s one by one (sha256 on). Memory per shard: three 8 MB staging buffers.
    """
    return max(1, min(n_shards, 2 * (os.cpu_count() or 1)))


def merge_and_quantize(
    adapter_dir: Path,
    base_dir: Path,
    out_dir: Path,
    fmt: str = "nvfp4",
    *,
    device: str = "auto",
    calibration: list | None = None,
    calibration_source: str = "builtin prompts",
    progress: bool = False,
    finalize=None,
    threads: int | None = 1,
) -> MergeResult:
    """Merge into bf16 (exactly `merge_adapter`, parity gate included), then quantize as the served checkpoint.

    The bf16 merge goes to a scratch directory next to `out_dir` and is removed at the end; the
    quantization is `pipeline.merge.quantize.quantize_checkpoint` (the recipe of the fleet's served
    checkpoint: same exclusions, `mtp.*` kept, text only, served layout). `out_dir/manifest.json`
    (`kind: merged-lora`, `format: nvfp4`) records the source adapter and its registered version,
    the base, the merge and its bf16 parity verdict, the quantizer's version and settings
    (`quantization`), and `served_parity: pending`: the engine-side gate (`pipeline merge-parity`)
    needs the merged model served on a GPU next to the NVFP4 base with the adapter hot-loaded.

    Raises what `merge_adapter` and `quantize_checkpoint` raise; `out_dir` is never left half written.
    """
    adapter_dir, base_dir, out_dir = Path(adapter_dir), Path(base_dir), Path(out_dir)
    if out_dir.exists():
        raise MergeError(f"{out_dir} exists; merge writes a new directory (remove it or pick another --out)")
    if problem := writable_problem("--out", out_dir):
        raise MergeError(f"{problem}: pick another --out")
    modelopt_version()  # before any byte is written
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    clear_killed_work(out_dir)
    scratch = work_dir(out_dir, "bf16")
    partial = None
    try:
        bf16 = merge_adapter(
            adapter_dir,
            base_dir,
            scratch / "merged-bf16",
            dtype="bfloat16",
            progress=progress,
            hash_files=False,
            finalize=finalize,
            threads=threads,
            device=device,
        )
        partial = work_dir(out_dir, "partial")
        record = quantize_checkpoint(
            bf16.out,
            partial,
            fmt=fmt,
            device=device,
            calibration=calibration,
            calibration_source=calibration_source,
        )
        manifest = bf16.manifest.model_copy(
            update={
                "requantization": None,
                "format": fmt,
                "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
                "files": file_hashes(partial),
                "quantization": Quantization.model_validate(record),
                "served_parity": ServedParity(
                    status="pending", how="pipeline merge-parity OUT --hot URL --merged URL"
                ),
                "versions": package_versions(
                    ("peft", "transformers", "torch", "safetensors", "nvidia-modelopt", "lora-pipeline")
                ),
            }
        )
        for name in manifest.files:
            seal_output(partial / name)
        write_manifest(partial, manifest)
        fsync_dir(partial)
        os.rename(partial, out_dir)
        fsync_dir(out_dir.parent)
    except BaseException:
        if partial is not None:
            shutil.rmtree(partial, ignore_errors=True)
        raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    written = sum((out_dir / n).stat().st_size for n in manifest.files)
    return MergeResult(out_dir, manifest, bf16.seconds, written, bf16.merged)


def _manifest(
    plan: MergePlan, merged: list[str], files: dict | None, seconds: float, written: int
) -> MergedManifest:
    try:
        amani = read_adapter_manifest(plan.adapter)
    except (FileNotFoundError, ValueError):
        amani = None
    acfg = load_adapter_config(plan.adapter).raw
    scales: dict[str, int] = {}
    for p in plan.pairs.values():
        scales[f"{p.scale:g}"] = scales.get(f"{p.scale:g}", 0) + 1
    return MergedManifest(
        created=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        files=files,
        base=MergedBase(
            path=str(plan.base.resolve()), layout=plan.layout, fingerprint=base_fingerprint(str(plan.base))
        ),
        adapter=MergedFrom(
            path=str(plan.adapter.resolve()),
            name=amani.name if amani else None,
            weights_sha256=sha256_file(plan.adapter / WEIGHTS_FILE),
            manifest_base_model=amani.base_model if amani else None,
            registered=amani.registered_version() if amani else None,
            config={
                k: acfg.get(k)
                for k in ("r", "lora_alpha", "use_rslora", "rank_pattern", "alpha_pattern", "target_modules")
            },
        ),
        merge=MergeStats(
            dtype=plan.dtype,
            lora_pairs=len(plan.pairs),
            merged_modules=len(merged),
            copied_tensors=sum(1 for s in plan.shards for e in s.entries if e.pair is None),
            scales=scales,
            bytes=written,
            seconds=round(seconds, 2),
        ),
        requantization=Requantization(
            status="pending",
            target="NVFP4 (ModelOpt format) for the MTP fleet",
            keep_bf16=["lm_head", "mtp.*", "model.visual.*"],
            recipe="docs/merge.md",
        ),
        versions=package_versions(("peft", "transformers", "torch", "safetensors", "lora-pipeline")),
    )
