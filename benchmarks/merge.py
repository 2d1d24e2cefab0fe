"""Benchmark `pipeline merge` against a plain copy of the same shards on the same disk.

Builds a synthetic Qwen3.6-27B-shaped checkpoint in the VL layout (real per-layer shapes from
docs/qwen3.6-27b.md: hidden 5120, DeltaNet in_proj_qkv [10240, 5120], gated q_proj
[12288, 5120], MLP 17408; `--layers 8` = [linear x3, full] x 2, ~6.1 GB bf16 in ~2 GB shards,
plus `mtp.*`), and an r=16 adapter on every text linear module. Then, in subprocesses (peak RSS
from `os.wait4`, i.e. the child's ru_maxrss):

- `copy`: shutil.copyfile of every file (the floor: what moving the bytes costs);
- `copy+fsync`: the same, fsynced (merge fsyncs its output before the atomic rename);
- `merge`: `pipeline merge --parity off` (fsync + sha256 of every file for the manifest);
- `merge --no-hash`: without the sha256.

The base is read once first so every variant starts with it in the page cache; variants run
in alternating order (ABCD, DCBA, ...) with `sync` between runs, and the best of `--repeats`
is reported. Targets: peak RSS <= largest shard + 1 GB (issue 7); time <= 1.25 x copy+fsync (issue 29).

    .venv/bin/python benchmarks/merge.py [--layers 8] [--shard-gb 2] [--repeats 2] [--workdir /tmp]
    .venv/bin/python benchmarks/merge.py --smoke     # toy geometry, seconds: the harness works
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from qwen36_27b import QWEN36_27B, TINY, Geometry, layer_types  # noqa: E402 (sibling module)

from pipeline.artifacts.manifest import MANIFEST, read_manifest  # noqa: E402


def build(
    root: Path, layers: int, shard_bytes: int, rank: int, embeddings: bool, geo: Geometry = QWEN36_27B
) -> tuple[Path, Path]:
    """Write base/ (VL layout, sharded, index, config) and adapter/ under root."""
    import torch
    from safetensors.torch import save_file

    H = geo.hidden
    g = torch.Generator().manual_seed(0)
    pool = (torch.randn(geo.intermediate * H + 1024, generator=g) * 0.02).to(torch.bfloat16)
    shapes: dict[str, tuple] = {}
    targets: dict[str, tuple] = {}
    for i, lt in enumerate(layer_types(layers)):
        p = f"model.language_model.layers.{i}."
        lin = geo.linear if lt == "linear_attention" else geo.full
        for m, s in {**lin, **geo.mlp}.items():
            shapes[p + m + ".weight"] = s
            targets[f"base_model.model.model.language_model.layers.{i}.{m}"] = s
        for m, s in (geo.linear_other if lt == "linear_attention" else geo.full_other).items():
            shapes[p + m] = s
        shapes[p + "input_layernorm.weight"] = (H,)
        shapes[p + "post_attention_layernorm.weight"] = (H,)
    shapes["model.language_model.norm.weight"] = (H,)
    shapes["mtp.fc.weight"] = (H, 2 * H)
    shapes["mtp.norm.weight"] = (H,)
    if embeddings:
        shapes["model.language_model.embed_tokens.weight"] = (geo.vocab, H)
        shapes["lm_head.weight"] = (geo.vocab, H)

    base = root / "base"
    base.mkdir()
    groups, cur, size = [], [], 0
    for name, s in shapes.items():
        nbytes = 2 * _numel(s)
        if cur and size + nbytes > shard_bytes:
            groups.append(cur)
            cur, size = [], 0
        cur.append(name)
        size += nbytes
    groups.append(cur)
    weight_map, total = {}, 0
    for k, names in enumerate(groups):
        fname = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {}
        for j, n in enumerate(names):  # distinct slices of one random pool (values do not matter for speed)
            off = (j * 7919) % 1024
            tensors[n] = pool[off : off + _numel(shapes[n])].view(shapes[n]).clone()
        save_file(tensors, str(base / fname), metadata={"format": "pt"})
        for n in names:
            weight_map[n] = fname
            total += 2 * _numel(shapes[n])
        del tensors
    (base / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )
    text_cfg = geo.text_config(layers)
    (base / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["Qwen3_5ForConditionalGeneration"],
                "model_type": "qwen3_5",
                "text_config": text_cfg,
            },
            indent=2,
        )
    )
    (base / "generation_config.json").write_text("{}")

    adapter = root / "adapter"
    adapter.mkdir()
    lora = {}
    for k, (out_f, in_f) in targets.items():
        lora[f"{k}.lora_A.weight"] = (torch.randn(rank, in_f, generator=g) * 0.01).to(torch.bfloat16)
        lora[f"{k}.lora_B.weight"] = (torch.randn(out_f, rank, generator=g) * 0.01).to(torch.bfloat16)
    save_file(lora, str(adapter / "adapter_model.safetensors"), metadata={"format": "pt"})
    mods = sorted({k.rsplit(".", 1)[-1] for k in targets})
    (adapter / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "r": rank,
                "lora_alpha": 2 * rank,
                "target_modules": mods,
                "bias": "none",
                "base_model_name_or_path": str(base),
                "task_type": "CAUSAL_LM",
            },
            indent=2,
        )
    )
    return base, adapter


def _numel(s) -> int:
    n = 1
    for d in s:
        n *= d
    return n


COPY = """
import os, shutil, sys
src, dst, sync = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
os.mkdir(dst)
for n in sorted(os.listdir(src)):
    shutil.copyfile(os.path.join(src, n), os.path.join(dst, n))
    if sync:
        fd = os.open(os.path.join(dst, n), os.O_RDONLY); os.fsync(fd); os.close(fd)
"""


def run(cmd: list[str]) -> tuple[float, float, float, str]:
    """(wall seconds, peak RSS MiB, CPU seconds user+sys, output) of one child process.

    The parent never imports torch, so the RSS a forked child inherits before exec stays ~30 MiB.
    """
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out = proc.stdout.read().decode(errors="replace")
    _, status, ru = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{out[-3000:]}")
    return wall, ru.ru_maxrss / 1024, ru.ru_utime + ru.ru_stime, out


def main() -> None:
    if sys.argv[1:2] == ["--build"]:
        r, layers, shard_bytes, rank, emb, geo = sys.argv[2:8]
        build(
            Path(r),
            int(layers),
            int(shard_bytes),
            int(rank),
            emb == "True",
            TINY if geo == "tiny" else QWEN36_27B,
        )
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--shard-gb", type=float, default=2.0)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument(
        "--embeddings", action="store_true", help="add embed_tokens and lm_head (2 x 2.5 GB, copied)"
    )
    ap.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()))
    ap.add_argument("--keep", action="store_true")
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="toy geometry (qwen36_27b.TINY), 4 layers in 3 shards, 1 repeat: seconds",
    )
    args = ap.parse_args()
    if args.smoke:
        args.layers, args.shard_gb, args.repeats, args.rank = 4, 40_000 / 2**30, 1, 4

    root = Path(tempfile.mkdtemp(prefix="merge-bench-", dir=args.workdir))
    try:
        t0 = time.perf_counter()
        # Build in a child so that this process stays small (see `run`).
        build_args = [
            str(root),
            str(args.layers),
            str(int(args.shard_gb * 2**30)),
            str(args.rank),
            str(args.embeddings),
            "tiny" if args.smoke else "qwen36_27b",
        ]
        run([sys.executable, __file__, "--build", *build_args])
        base, adapter = root / "base", root / "adapter"
        shards = sorted(base.glob("*.safetensors"))
        total = sum(p.stat().st_size for p in shards)
        largest = max(p.stat().st_size for p in shards)
        free = shutil.disk_usage(root).free
        print(
            f"built {len(shards)} shards, {total / 1e9:.2f} GB (largest {largest / 1e9:.2f} GB), adapter "
            f"{(adapter / 'adapter_model.safetensors').stat().st_size / 1e6:.1f} MB in "
            f"{time.perf_counter() - t0:.0f} s; {free / 1e9:.0f} GB free on {root}"
        )
        if free < 2.2 * total:
            raise SystemExit("not enough free disk for two outputs")
        for p in shards:  # same starting point for every variant: base in the page cache
            with open(p, "rb") as f:
                while f.read(64 << 20):
                    pass
        py = sys.executable
        pipeline = [
            py,
            "-m",
            "pipeline",
            "merge",
            str(adapter),
            "--base",
            str(base),
            "--parity",
            "off",
            "--no-progress",
        ]
        variants = {
            "copy": lambda o: [py, "-c", COPY, str(base), str(o), "0"],
            "copy+fsync": lambda o: [py, "-c", COPY, str(base), str(o), "1"],
            "merge": lambda o: [*pipeline, "--out", str(o)],
            "merge --no-hash": lambda o: [*pipeline, "--out", str(o), "--no-hash"],
        }
        results: dict[str, list[tuple[float, float, float, float | None]]] = {k: [] for k in variants}
        order = list(variants)
        for rep in range(args.repeats):
            for name in order if rep % 2 == 0 else order[::-1]:
                out = root / "out"
                os.sync()
                wall, rss, cpu, _ = run(variants[name](out))
                inner = None
                if (out / MANIFEST).exists():
                    man = read_manifest(out)  # pydantic only: this process still imports no torch
                    inner = man.merge.seconds
                    assert man.merge.merged_modules == man.merge.lora_pairs
                results[name].append((wall, rss, cpu, inner))
                print(
                    f"  {name:16s} rep {rep}: {wall:6.1f} s  {rss:7.0f} MiB  cpu {cpu:5.1f} s"
                    + (f"  (in-process {inner} s)" if inner else "")
                )
                shutil.rmtree(out)
        best = {k: min(rs) for k, rs in results.items()}  # by wall time
        copy_w, sync_w = best["copy"][0], best["copy+fsync"][0]
        print(
            f"\n{args.layers} layers, {len(shards)} shards, {total / 1e9:.2f} GB, r={args.rank} on all text linears; "
            f"best of {args.repeats} by wall time, base in page cache; load average {os.getloadavg()[0]:.1f}"
        )
        print(
            f"{'variant':16s} {'wall s':>7s} {'MB/s':>6s} {'CPU s':>6s} {'peak RSS MiB':>12s} {'x copy':>7s} "
            f"{'x copy+fsync':>12s} {'in-process s':>12s}"
        )
        for name, (wall, _, cpu, inner) in best.items():
            rss = max(r[1] for r in results[name])
            print(
                f"{name:16s} {wall:7.1f} {total / 1e6 / wall:6.0f} {cpu:6.1f} {rss:12.0f} {wall / copy_w:7.2f} "
                f"{wall / sync_w:12.2f} {inner if inner else '':>12}"
            )
        merge_rss = max(r[1] for r in results["merge"])
        merge_w = best["merge"][0]
        print(
            f"\npeak RSS {merge_rss:.0f} MiB vs target largest shard + 1 GiB = {(largest + 2**30) / 2**20:.0f} MiB: "
            f"{'OK' if merge_rss * 2**20 <= largest + 2**30 else 'MISSED'}"
        )
        print(
            f"time {merge_w / copy_w:.2f}x copy, {merge_w / sync_w:.2f}x copy+fsync (target 1.25x copy+fsync): "
            f"{'OK' if merge_w <= 1.25 * sync_w else 'MISSED'}"
        )
        # On a shared 2-core machine the wall time follows the CPU seconds each process gets; this ratio
        # is what the merge costs whatever the other jobs do.
        print(f"CPU seconds {best['merge'][2] / best['copy+fsync'][2]:.2f}x copy+fsync's")
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
