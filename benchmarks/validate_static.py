"""Static validation of a full-size Qwen3.6-27B adapter (r=16, all text linear modules, ~233 MB).

Builds, in a temporary directory:
- a 27B-shaped bf16 base: config.json + model.safetensors.index.json + 15 shards whose headers
  are real and whose data are sparse (written with `truncate`): only headers are ever read;
- a 27B-shaped NVFP4 ModelOpt served checkpoint (same trick: U8 [out, in/2] weights, F8 scales);
- a full-size PEFT adapter (VL key layout, bf16, random values) on q/k/v/o (16 full-attention
  layers), in_proj_qkv/z/b/a + out_proj (48 DeltaNet layers) and gate/up/down (64 layers).

Shapes from docs/qwen3.6-27b.md. Then times `validate_adapter` (adapter header +
every tensor's values, base and served headers) against baselines measured in the same run:
reading the adapter file once, and its sha256 (which validation also computes).

Run: .venv/bin/python benchmarks/validate_static.py [--repeat 3] [--keep DIR]
     .venv/bin/python benchmarks/validate_static.py --smoke   # toy geometry: the harness works (exit 1 unless pass)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import struct
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from qwen36_27b import QWEN36_27B, TINY, Geometry, layer_types  # noqa: E402

BYTES = {"BF16": 2, "F32": 4, "U8": 1, "F8_E4M3": 1}


# The served checkpoint below is a text-only export (`Qwen3_5ForCausalLM`), which vLLM registers from 0.32 on
# (docs/vllm.md): validate against that range.
VLLM = "0.33.0"


def base_tensors(
    prefix: str, quantized: bool = False, geo: Geometry = QWEN36_27B
) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{name: (dtype, shape)} of the checkpoint; quantized: decoder linears as NVFP4 (U8 + scales)."""
    H, VOCAB, MLP, FULL, LINEAR = geo.hidden, geo.vocab, geo.mlp, geo.full, geo.linear
    t: dict[str, tuple[str, tuple[int, ...]]] = {
        f"{prefix}embed_tokens.weight": ("BF16", (VOCAB, H)),
        f"{prefix}norm.weight": ("BF16", (H,)),
        "lm_head.weight": ("BF16", (VOCAB, H)),
        "mtp.fc.weight": ("BF16", (H, 2 * H)),
        "mtp.norm.weight": ("BF16", (H,)),
    }
    # the MTP layer: one full-attention decoder layer, bf16 in both checkpoints (hf_quant_config excludes mtp*)
    for m, (o, n) in (dict(MLP) | FULL).items():
        t[f"mtp.layers.0.{m}.weight"] = ("BF16", (o, n))
    for i, lt in enumerate(layer_types(geo.layers)):
        p = f"{prefix}layers.{i}."
        t[p + "input_layernorm.weight"] = ("BF16", (H,))
        t[p + "post_attention_layernorm.weight"] = ("BF16", (H,))
        mods = dict(MLP) | (FULL if lt == "full_attention" else LINEAR)
        if lt == "linear_attention":
            other = geo.linear_other
            t[p + "linear_attn.conv1d.weight"] = ("BF16", other["linear_attn.conv1d.weight"])
            t[p + "linear_attn.A_log"] = ("F32", other["linear_attn.A_log"])
            t[p + "linear_attn.dt_bias"] = ("BF16", other["linear_attn.dt_bias"])
        for m, (o, n) in mods.items():
            if quantized:
                t[p + m + ".weight"] = ("U8", (o, n // 2))
                t[p + m + ".weight_scale"] = ("F8_E4M3", (o, n // 16))
                t[p + m + ".weight_scale_2"] = ("F32", ())
                t[p + m + ".input_scale"] = ("F32", ())
            else:
                t[p + m + ".weight"] = ("BF16", (o, n))
    return t


def write_sparse_checkpoint(
    out: Path, tensors: dict, config: dict, shards: int, extra: dict | None = None
) -> int:
    """Real safetensors headers, sparse data (`truncate`); returns total logical bytes."""
    out.mkdir(parents=True)
    names = sorted(tensors)
    weight_map, total = {}, 0
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        header, off = {"__metadata__": {"format": "pt"}}, 0
        for n in names[s::shards]:
            dtype, shape = tensors[n]
            size = BYTES[dtype]
            for d in shape:
                size *= d
            header[n] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + size]}
            off += size
            weight_map[n] = fname
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        with open(out / fname, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            f.truncate(8 + len(raw) + off)  # sparse: no data blocks are written
        total += off
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    (out / "config.json").write_text(json.dumps(config))
    for k, v in (extra or {}).items():
        (out / k).write_text(json.dumps(v))
    return total


def write_adapter(out: Path, r: int = 16, geo: Geometry = QWEN36_27B) -> int:
    """Full-size PEFT adapter in the VL key layout; returns the parameter count."""
    import torch
    from safetensors.torch import save_file

    MLP, FULL, LINEAR = geo.mlp, geo.full, geo.linear
    g = torch.Generator().manual_seed(0)
    tensors, n = {}, 0
    for i, lt in enumerate(layer_types(geo.layers)):
        for m, (o, k) in (dict(MLP) | (FULL if lt == "full_attention" else LINEAR)).items():
            p = f"base_model.model.model.language_model.layers.{i}.{m}"
            tensors[p + ".lora_A.weight"] = (torch.randn(r, k, generator=g) * 0.01).to(torch.bfloat16)
            tensors[p + ".lora_B.weight"] = (torch.randn(o, r, generator=g) * 0.001).to(torch.bfloat16)
            n += r * (o + k)
    out.mkdir(parents=True)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    targets = sorted({m.split(".")[-1] for m in {**FULL, **LINEAR, **MLP}})
    (out / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "r": r,
                "lora_alpha": 2 * r,
                "target_modules": targets,
                "bias": "none",
                "base_model_name_or_path": "Qwen/Qwen3.6-27B",
                "task_type": "CAUSAL_LM",
                "use_rslora": False,
            }
        )
    )
    return n


def timed(fn, repeat: int) -> tuple[list[float], list[float]]:
    """(wall seconds, process CPU seconds) per run; CPU time is less sensitive to other load."""
    wall, cpu = [], []
    for _ in range(repeat):
        t, c = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    return wall, cpu


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--keep", type=Path, help="build here and keep (default: a temp dir, removed)")
    ap.add_argument(
        "--smoke", action="store_true", help="toy geometry (qwen36_27b.TINY), 1 repeat: the harness works"
    )
    args = ap.parse_args()
    geo, shards = (TINY, 3) if args.smoke else (QWEN36_27B, 15)
    if args.smoke:
        args.repeat = 1

    t = time.perf_counter()
    import torch  # noqa: F401 - imported once here so its import time is not in the figures

    import_s = time.perf_counter() - t
    from pipeline.validate import FleetRules, validate_adapter

    with tempfile.TemporaryDirectory() as td:
        root = args.keep or Path(td)
        t = time.perf_counter()
        vl = {
            "architectures": ["Qwen3_5ForConditionalGeneration"],
            "model_type": "qwen3_5",
            "text_config": geo.text_config(),
        }
        base_bytes = write_sparse_checkpoint(
            root / "base", base_tensors("model.language_model.", geo=geo), vl, shards
        )
        quant = {
            "producer": {"name": "modelopt"},
            "quantization": {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head", "mtp*"]},
        }
        write_sparse_checkpoint(
            root / "served",
            base_tensors("model.", quantized=True, geo=geo),
            geo.text_config() | {"architectures": ["Qwen3_5ForCausalLM"]},
            4,
            {"hf_quant_config.json": quant},
        )
        params = write_adapter(root / "adapter", geo=geo)
        build_s = time.perf_counter() - t
        wfile = root / "adapter" / "adapter_model.safetensors"
        size = wfile.stat().st_size

        def read_file():
            with open(wfile, "rb") as f:
                while f.read(1 << 24):
                    pass

        def sha():
            h = hashlib.sha256()
            with open(wfile, "rb") as f:
                while b := f.read(1 << 24):
                    h.update(b)

        reports = []

        def validate():
            reports.append(
                validate_adapter(
                    root / "adapter",
                    root / "base",
                    FleetRules(max_lora_rank=16, served_path=root / "served", vllm_version=VLLM),
                )
            )

        def validate_no_served():
            reports.append(
                validate_adapter(
                    root / "adapter", root / "base", FleetRules(max_lora_rank=16, vllm_version=VLLM)
                )
            )

        rows = [
            ("baseline: read adapter file", timed(read_file, args.repeat)),
            ("baseline: sha256 of adapter file", timed(sha, args.repeat)),
            ("validate: base headers + values", timed(validate_no_served, args.repeat)),
            ("validate: + served NVFP4 headers", timed(validate, args.repeat)),
        ]
        rep = reports[-1]
        print(
            f"{'toy' if args.smoke else '27B'}-shaped base: {base_bytes / 1e9:.1f} GB logical in {shards} sparse "
            f"shards; adapter: {params / 1e6:.1f} M "
            f"params, {size / 1e6:.0f} MB bf16, {rep.stats['lora_modules']} modules; build {build_s:.1f} s; "
            f"`import torch` {import_s:.1f} s (not in the figures)"
        )
        print(f"verdict {rep.verdict}; findings {[(c.id, c.severity) for c in rep.checks]}")
        load = os.getloadavg()[0]
        print(
            f"\n{os.cpu_count()} CPUs, load average {load:.1f} (other jobs inflate wall time; CPU time less so)"
        )
        print(f"| step (repeat {args.repeat}) | wall min s | wall median s | CPU min s | x read (wall) |")
        print("|---|---|---|---|---|")
        ref = min(rows[0][1][0])
        for name, (wall, cpu) in rows:
            print(
                f"| {name} | {min(wall):.3f} | {statistics.median(wall):.3f} | {min(cpu):.3f} | "
                f"{min(wall) / ref:.1f} |"
            )
        return 0 if rep.verdict == "pass" else 1


if __name__ == "__main__":
    sys.exit(main())
