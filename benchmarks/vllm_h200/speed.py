"""Speed with the GPU the engine's alone: the settings sweep, publish latency, and the 64-layer plan fleet64."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

from . import REPO
from .engines import BATCHES64, FLEET64_PORT, NAME, SWEEP_PORTS, _du, fleet64_engine, gpu_apps, sweep_engines
from .fleet import _instances_serving
from .measure import REPEATS, _median, decode_table, lora
from .stages import mark_built, nvfp4_current, served_base_cmd

if TYPE_CHECKING:
    from .context import Ctx


# plan sweep -------------------------------------------------------------------------------------------------------
def adapter_rank(adapter: Path) -> int:
    """The LoRA rank `r` of a PEFT adapter directory (adapter_config.json)."""
    return int(json.loads((Path(adapter) / "adapter_config.json").read_text())["r"])


def st_sweep(ctx: Ctx) -> dict:
    """The settings that change speed, one engine at a time, alone on the GPU (the fleet engines stopped
    first): each setting's engine starts, loads adapter v1, gives its decode rows (warm-up + REPEATS),
    and stops before the next starts. A setting measured by an earlier call on this machine is reused
    (WORK/sweep-<name>.json), so the sweep can span calls; one that had no time says so, with no number."""
    ads = ctx.facts["adapters"]
    rank = adapter_rank(ads[1])
    excl = ctx.exclusive(None)
    res: dict = {"adapter_rank": rank, "exclusive": excl, "settings": {}}
    for n, eng in sweep_engines(ctx, rank).items():
        saved = ctx.work / f"sweep-{n}.json"
        if saved.exists():
            res["settings"][n] = json.loads(saved.read_text()) | {"reused": True}
            continue
        if ctx.left() < 150:
            res["settings"][n] = {"not_measured": f"deadline: {ctx.left():.0f} s left; run plan sweep again"}
            continue
        try:
            e = ctx.start_engine(eng, SWEEP_PORTS[n])
            ctx.wait_engine(n, min(400, ctx.left() - 60))
            lora(e.url, "load", lora_name="sweep", lora_path=str(ads[1]))
            row = {
                "flags": eng.args,
                "ready_s": e.ready_s,
                **decode_table(e.url, e.model_id, "sweep", (1, 8), 256, ids=ctx.ids),
            }
            saved.write_text(json.dumps(row))
            res["settings"][n] = row
        except Exception as ex:  # noqa: BLE001 - one setting failing is a result
            res["settings"][n] = {"not_measured": f"{type(ex).__name__}: {ex}"[:2000]}
        finally:
            ctx.stop_engine(n)
    res["ratio_adapter_over_base"] = sweep_ratios(res["settings"])
    return res


def sweep_ratios(settings: dict) -> dict:
    """adapter/base (median tok/s) per setting and batch, side by side per question (None: not measured)."""

    def r(n):
        x = settings.get(n) or {}
        return x.get("ratio_adapter_over_base")

    return {
        "max_lora_rank": {"adapter": r("rank-adapter"), "64": r("rank64")},
        "cuda_graphs": {"on": r("rank-adapter"), "off": r("graphs-off")},
        "max_loras": {"1": r("loras1"), "2": r("rank-adapter"), "4": r("loras4")},
    }


def st_publish_latency(ctx: Ctx) -> dict:
    """publish -> serving on the GPU fleet (its two instances the GPU's only users: no sweep engine runs
    yet): `pipeline publish` v2, v1, then `pipeline rollback` alternating, each until both instances list
    the version; the first is a warm-up, the other REPEATS+2 are timed (median and min-max), beside a
    direct `load_lora_adapter` on instance a."""
    a = ctx.engines["fleet-a"]
    mount = ctx.facts["mount"].rstrip("/")
    v1, v2 = ctx.facts["versions"][1], ctx.facts["versions"][2]
    running = sorted(n for n, e in ctx.engines.items() if e.proc is None or e.proc.poll() is None)
    if set(running) - {"fleet-a", "fleet-b"}:
        raise RuntimeError(f"engines {running} run: publish latency is timed with the two instances alone")
    excl = {"engines": running, "jobs": sorted(n for n, (p, _, _) in ctx.bg.items() if p.poll() is None),
            "gpu_apps": gpu_apps()}  # fmt: skip
    t = time.perf_counter()
    lora(a.url, "load", lora_name="latency-probe", lora_path=f"{mount}/{NAME}-v{v1}")
    direct = time.perf_counter() - t
    lora(a.url, "unload", lora_name="latency-probe")
    runs = []
    for i in range(REPEATS + 3):
        v = (v2, v1)[i % 2]
        t = time.perf_counter()
        r = (
            ctx.cli("publish", NAME, "--version", v, "--json", timeout=300)
            if i < 2
            else ctx.cli("rollback", NAME, "--to", v, "--json", timeout=300)
        )
        ok = all(_instances_serving(ctx, v).values())
        runs.append({"version": v, "command": "publish" if i < 2 else "rollback", "wall_s": round(time.perf_counter() - t, 3),
                     "cli_wall_s": r["wall_s"], "both_serving": ok, "warm_up": i == 0})  # fmt: skip
    timed = [x["wall_s"] for x in runs if not x["warm_up"] and x["both_serving"]]
    return {
        "direct_load_s": round(direct, 3),
        "runs": runs,
        "repeats": len(timed),
        "median_s": round(_median(timed), 3) if timed else None,
        "min_max_s": [min(timed), max(timed)] if timed else None,
        "not_measured": None if len(timed) >= REPEATS else f"{len(timed)} timed runs reached both instances",
        "gpu": excl,
    }


SHIPPED_CONFIG = REPO / "axolotl_configs" / "qwen3.6-27b-lora.yml"


def _free_gb(p: Path) -> float:
    p.mkdir(parents=True, exist_ok=True)
    return shutil.disk_usage(p).free / 1e9


def st_base64(ctx: Ctx) -> dict:
    """The 64-layer bf16 base in /dev/shm (`pipeline dev real-base --layers 64 --device cuda`), unless WORK
    already holds its NVFP4 build or /dev/shm the finished base. Raises RuntimeError when /dev/shm or WORK
    has too little room (52 GB and ~17 GB), saying how much is free."""
    if nvfp4_current(ctx):
        return {"skipped": f"{ctx.nvfp4} is built", "nvfp4": str(ctx.nvfp4)}
    base = ctx.bf16
    if (base / ".done").exists():
        return {"base": str(base), "reused": True}
    shm, disk = _free_gb(base.parent), _free_gb(ctx.work)
    if shm < 55 or disk < 20:
        raise RuntimeError(f"{base.parent}: {shm:.0f} GB free (the bf16 base needs 52), {ctx.work}: {disk:.0f} GB free "
                           "(its NVFP4 build needs ~17): free them (an earlier base? SHM_DIR, WORK)")  # fmt: skip
    r = ctx.cli("dev", "real-base", base, "--layers", "64", "--device", "cuda", timeout=900)
    (base / ".done").touch()
    return {
        "base": str(base),
        "wall_s": r["wall_s"],
        "size_gb": round(_du(base) / 1e9, 2),
        "shm_free_gb": round(shm),
    }


def st_build64(ctx: Ctx) -> dict:
    """`pipeline dev served-base` of the 64-layer base to WORK (disk), then the bf16 copy deleted from
    /dev/shm (RAM back for the engine); reused when WORK holds this build."""
    if nvfp4_current(ctx):
        return {"nvfp4": str(ctx.nvfp4), "reused": True, "size_gb": round(_du(ctx.nvfp4) / 1e9, 2)}
    ctx.start_bg("served-base", served_base_cmd(ctx), env=ctx.pipeline_env(modelopt=True))
    res = ctx.wait_bg("served-base", 1200)
    mark_built(ctx)
    shutil.rmtree(ctx.bf16)
    q = json.loads((ctx.nvfp4 / "hf_quant_config.json").read_text())
    return {"nvfp4": str(ctx.nvfp4), "wall_s": res["wall_s"], "quantization": q.get("quantization", q),
            "size_gb": round(_du(ctx.nvfp4) / 1e9, 2), "bf16_deleted": not ctx.bf16.exists()}  # fmt: skip


def random_adapter(out: Path, layers: int, config: Path = SHIPPED_CONFIG, seed: int = 0) -> dict:
    """A PEFT LoRA of the shipped config (`lora_r`, `lora_alpha`, `lora_target_modules`, language model
    only) for the `layers`-layer real-geometry base, with random A and B (std 0.02: not zero, so the
    kernels do the full work). Built on the meta device from `real_config` (no weights read). Returns
    {path, r, alpha, targets, tensors, parameters}."""
    import torch
    import yaml
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from safetensors.torch import save_file
    from transformers import Qwen3_5ForConditionalGeneration

    from pipeline.dev.realbase import real_config

    y = yaml.safe_load(Path(config).read_text())
    targets = list(y["lora_target_modules"])
    with torch.device("meta"):
        model = Qwen3_5ForConditionalGeneration._from_config(real_config(layers), dtype=torch.bfloat16)
    lc = LoraConfig(r=int(y["lora_r"]), lora_alpha=int(y["lora_alpha"]), lora_dropout=0.0, bias="none",
                    target_modules=rf".*language_model\.layers\.\d+\..*\.({'|'.join(targets)})")  # fmt: skip
    sd = get_peft_model_state_dict(get_peft_model(model, lc))
    g = torch.Generator().manual_seed(seed)
    tensors = {k: (torch.randn(tuple(v.shape), generator=g) * 0.02).to(torch.bfloat16) for k, v in sd.items()}
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    lc.save_pretrained(str(out))
    return {"path": str(out), "r": lc.r, "alpha": lc.lora_alpha, "targets": targets, "tensors": len(tensors),
            "parameters": sum(t.numel() for t in tensors.values())}  # fmt: skip


def st_adapter64(ctx: Ctx) -> dict:
    out = ctx.work / "adapter64"
    if (out / "adapter_model.safetensors").exists():
        return {"path": str(out), "reused": True}
    return random_adapter(out, 64)


def st_decode64(ctx: Ctx) -> dict:
    """Decode rows of the 64-layer NVFP4 engine, alone on the GPU: base vs adapter at batch 1, 8, 32."""
    excl = ctx.exclusive(None)
    e = ctx.start_engine(fleet64_engine(ctx), FLEET64_PORT)
    try:
        ctx.wait_engine(e.name, min(900, ctx.left() - 60))
        lora(e.url, "load", lora_name="adapter64", lora_path=str(ctx.work / "adapter64"))
        table = decode_table(e.url, e.model_id, "adapter64", BATCHES64, 256, ids=ctx.ids)
    finally:
        ctx.stop_engine(e.name)
    return {"ready_s": e.ready_s, "flags": e.args, "exclusive": excl, **table}
