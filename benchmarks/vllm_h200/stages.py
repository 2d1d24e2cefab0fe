"""Setting up a fleet: host, base, MTP layer, trainings, NVFP4 build, project, engines, registrations."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from pipeline.canary import prom

from . import REPO
from .engines import MOUNT, NAME, PORTS, TRAINED_REPORT, Engine, _du, _kill, gpu_engines, smoke_engines
from .measure import metrics

if TYPE_CHECKING:
    from .context import Ctx


def st_host(ctx: Ctx) -> dict:
    vol = ctx.work / "volume"
    vol.mkdir(parents=True, exist_ok=True)
    (ctx.work / "logs").mkdir(exist_ok=True)
    res: dict = {"plan": ctx.plan, "work": str(ctx.work)}
    if ctx.gpu:
        q = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True)  # fmt: skip
        res["gpu"] = q.stdout.strip()
        v = subprocess.run(["python3", "-c", "import vllm, torch, transformers; print(vllm.__version__, torch.__version__, "
                            "transformers.__version__)"], capture_output=True, text=True, env=ctx.vllm_env(Engine("x", vol, [])),
                           timeout=120)  # fmt: skip
        res["vllm_torch_transformers"] = (v.stdout.strip() or v.stderr[-800:]).split()
        if v.returncode == 0:
            ctx.facts["vllm_version"] = res["vllm_torch_transformers"][0]
        m = subprocess.run([sys.executable, "-c", "import modelopt; print(modelopt.__version__)"], capture_output=True,
                           text=True, env=ctx.pipeline_env(modelopt=True), timeout=120)  # fmt: skip
        res["modelopt"] = m.stdout.strip() or m.stderr[-400:]
        res["mount"] = bind_ro(vol, Path(MOUNT))
    else:
        res["vllm"] = "cpu build (.fleet-venv)"
        res["mount"] = {
            "held": False,
            "why": "smoke: no bind mount on the development machine",
            "mount": str(vol),
        }
    ctx.facts["mount"] = res["mount"]["mount"]
    return res


def bind_ro(src: Path, dst: Path) -> dict:
    """`mount --bind SRC DST` + `mount -o remount,bind,ro DST`; whether a write below DST then fails."""
    out = {"source": str(src)}
    try:
        dst.mkdir(parents=True, exist_ok=True)
        if subprocess.run(["mountpoint", "-q", str(dst)]).returncode == 0:  # an earlier call on this machine
            subprocess.run(["umount", str(dst)], capture_output=True)
        for cmd in (["mount", "--bind", str(src), str(dst)], ["mount", "-o", "remount,bind,ro", str(dst)]):
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
            if p.returncode:
                raise OSError(f"{' '.join(cmd)}: {p.stderr.strip() or p.returncode}")
        try:
            (dst / ".probe").write_text("x")
            (dst / ".probe").unlink()
            return out | {
                "held": False,
                "why": "a write below the read-only bind succeeded",
                "mount": str(dst),
            }
        except OSError as e:
            return out | {"held": True, "write_error": f"{type(e).__name__}: {e}", "mount": str(dst)}
    except OSError as e:  # no mount: the instances read the volume where the pipeline writes it
        return out | {"held": False, "why": str(e), "mount": str(src)}


def st_base(ctx: Ctx) -> dict:
    """The bf16 base: `--base DIR` as given, the attached instances' own, or WORK/real8 built here
    (`pipeline dev real-base --layers 8`; CPU: `tiny-base`). Also the token ids prompts are drawn from
    (`prompt_ids`: the base's own tokenizer, special tokens left out)."""
    base = ctx.bf16
    if ctx.base_given is not None:
        res = {"base": str(base), "given": True, **given_base(base)}
    elif ctx.attach:  # the attached instances serve their own base: use it
        root = _attached_root(ctx)
        if base.is_symlink() or base.exists():
            base.unlink() if base.is_symlink() else shutil.rmtree(base)
        base.symlink_to(root)
        res = {"base": root, "attached": True}
    elif (base / ".done").exists():
        res = {"base": str(base), "reused": True}
    else:
        if ctx.gpu:
            r = ctx.cli("dev", "real-base", base, "--layers", "8", "--device", "cuda", timeout=240)
        else:
            r = ctx.cli(
                "dev", "tiny-base", base, timeout=120
            )  # the CPU test fleet's base (text layout, no MTP)
        (base / ".done").touch()
        res = {"base": str(base), "wall_s": r["wall_s"], "size_gb": round(_du(base) / 1e9, 2)}
    ids = prompt_ids(base)
    ctx.facts["prompt_ids"] = ids
    return res | {"prompt_ids": {"count": len(ids), "min": min(ids), "max": max(ids)}}


def given_base(base: Path) -> dict:
    """Check a `--base DIR` (a bf16 HF checkpoint with its own tokenizer) and summarise it: its
    architecture, whether it carries `mtp.*` tensors, and its `trained_base.json` if any.

    Raises RuntimeError naming what is missing (config.json, tokenizer.json, the weights)."""
    missing = [f for f in ("config.json", "tokenizer.json") if not (base / f).is_file()]
    if not list(base.glob("*.safetensors")):
        missing.append("*.safetensors")
    if missing:
        raise RuntimeError(
            f"--base {base}: no {', '.join(missing)} there; name a checkpoint written by "
            "`pipeline dev trained-base` or `pipeline dev real-base`"
        )
    cfg = json.loads((base / "config.json").read_text())
    index = base / "model.safetensors.index.json"
    keys = json.loads(index.read_text())["weight_map"] if index.is_file() else {}
    rep = base / TRAINED_REPORT
    trained = json.loads(rep.read_text()) if rep.is_file() else None
    return {
        "architectures": cfg.get("architectures"),
        "mtp_tensors": sum(1 for k in keys if k.startswith("mtp.")),
        "size_gb": round(_du(base) / 1e9, 2),
        "trained_base": None
        if trained is None
        else {k: trained.get(k) for k in ("heldout_ppl", "mtp_greedy", "model", "training", "corpus")},
    }


def prompt_ids(base: Path) -> list[int]:
    """The token ids random prompts are drawn from: every id of the base's `tokenizer.json` vocabulary
    that is not an added (special) token. The bases differ (the tiny and real-geometry bases: 1,024 ids,
    a trained base: its own BPE); without a tokenizer.json, ids 16..1023 (the tiny tokenizer's
    ordinary ids: its specials are the first ones)."""
    p = base / "tokenizer.json"
    if not p.is_file():
        return list(range(16, 1024))
    tj = json.loads(p.read_text())
    special = {t["id"] for t in tj.get("added_tokens") or []}
    vocab = (tj.get("model") or {}).get("vocab") or {}
    ids = sorted(set(vocab.values()) - special)
    if not ids:
        raise RuntimeError(f"{p}: no ordinary token ids in its vocabulary")
    return ids


def _attached_root(ctx: Ctx) -> str:
    url = ctx.attach["fleet-a"]
    data = httpx.get(f"{url}/v1/models", timeout=30).json()["data"]
    return next(c for c in data if c.get("parent") is None)["root"]


def st_mtp(ctx: Ctx) -> dict:
    """The MTP layer distilled ~1 min on the base's own greedy output (benchmarks/mtp_distill.py, written
    into the base in place); skipped for a base whose `trained_base.json` says its MTP layer is trained."""
    base = ctx.bf16
    done = ctx.mtp_json
    if ctx.trained is not None:
        return {"skipped": f"the base's MTP layer is trained ({base / TRAINED_REPORT})", "trained": True}
    if ctx.attach or not (base / "model.safetensors.index.json").exists():
        return {"skipped": "no MTP layer to train (attached instances or a text-layout base)"}
    if done.exists():
        return json.loads(done.read_text()) | {"reused": True}
    args = ["--budget-s", "60"] if ctx.gpu else ["--device", "cpu", "--budget-s", "8", "--prompts", "8",
                                                   "--prompt-len", "16", "--new-tokens", "12"]  # fmt: skip
    ctx.start_bg("mtp", [sys.executable, REPO / "benchmarks" / "mtp_distill.py", base, "--json", done, *args])
    ctx.wait_bg("mtp", 200)
    return json.loads(done.read_text())


def _train_cmd(ctx: Ctx, version: int) -> list:
    """`pipeline train` of the shipped Qwen3.6-27B config on the 8-layer base: short, seeds and rates per version."""
    data = REPO / "datasets" / "agent_chat_train.jsonl"
    ds = json.dumps([{"path": str(data), "ds_type": "json", "type": "chat_template", "field_messages": "messages",
                      "roles_to_train": ["assistant"]}])  # fmt: skip
    lr, seed = {1: (3e-4, 1), 2: (2e-4, 2)}[version]
    if ctx.gpu:
        cfg, sets = "axolotl_configs/qwen3.6-27b-lora.yml", [
            f"base_model={ctx.bf16}", "base_model_revision=null", "sequence_len=2048",
            "max_steps=40", "micro_batch_size=2", "gradient_accumulation_steps=1", f"learning_rate={lr}",
            "sample_packing=false",  # the shipped config packs; packing needs fla, which nofla() hides here
            f"seed={seed}", "warmup_ratio=0.0", "lora_mlp_kernel=false", "lora_qkv_kernel=false",
            "lora_o_kernel=false", "eval_strategy='no'", "save_strategy='no'", "test_datasets=null",
            "eval_steps=null", "save_steps=null", f"dataset_prepared_path={ctx.work / f'prepared{version}'}",
            f"datasets={ds}",
        ]  # fmt: skip
    else:
        cfg, sets = "axolotl_configs/tiny-cpu.yml", [
            f"base_model={ctx.bf16}", "max_steps=2", f"seed={seed}",
            f"dataset_prepared_path={ctx.work / f'prepared{version}'}",
        ]  # fmt: skip
    cmd = [*ctx.pipeline_cmd(), "train", cfg, "--name", NAME, "--no-progress", "--json"]
    for s in sets:
        cmd += ["--set", s]
    return cmd


def write_project(ctx: Ctx) -> Path:
    """pipeline.yaml naming the two fleet instances, the NVFP4 checkpoint they serve and the bf16 base."""
    import yaml

    p = ctx.project
    p.mkdir(parents=True, exist_ok=True)
    eng = ctx.engines
    # the exact `vllm serve` model string (attached instances: the root their /v1/models card shows)
    bf16 = ctx.bf16.resolve() if ctx.attach else ctx.bf16
    served = ctx.nvfp4 if ctx.gpu else bf16
    a, b = (eng.get(n) for n in ("fleet-a", "fleet-b"))
    cfg = {
        "state_dir": str(p / "state"),
        "base": {"model": str(bf16), "path": str(bf16)},
        "served": {
            "checkpoint": ctx.nvfp4.name if ctx.gpu else "tiny-qwen3.5",
            "revision": "vllm_h200",
            "model": str(served),
            "path": str(served),
            **({"served_model_name": ctx.nvfp4.name} if ctx.gpu else {}),
        },
        "fleet": {
            "vllm_version": ctx.facts.get("vllm_version", "0.25.1" if ctx.gpu else "0.32.0"),
            "max_lora_rank": 16,
            # the GPU plans start every instance with SPEC_MTP; the CPU smoke instances draft nothing
            "speculative_mtp": bool(ctx.gpu),
            "volume_mount": ctx.facts["mount"],
            "keep_versions": 2,
            "timeout_s": 120,
            "load_timeout_s": 300,
            "instances": [{"name": x.name, "url": x.url} for x in (a, b) if x is not None],
        },
        "volume": {"path": str(ctx.work / "volume")},
        "train": {"runs_dir": str(ctx.work / "runs")},
        "canary": {
            "staging_dir": str(ctx.work / "canary"),
            "timeout_s": 300,
            **({} if ctx.gpu else {"prompts": 2, "max_tokens": 6}),
        },  # fmt: skip
    }
    (p / "pipeline.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    return p / "pipeline.yaml"


def st_launch(ctx: Ctx) -> dict:
    """Start what takes long, in parallel: two trainings, the NVFP4 build, the parity staging engine."""
    if ctx.attach:
        for n, url in ctx.attach.items():
            e = Engine(n, Path(_attached_root(ctx)), [], port=int(url.rsplit(":", 1)[1]))
            e.ready_s = 0.0
            ctx.engines[n] = e
        ctx.facts["vllm_version"] = httpx.get(f"{ctx.attach['fleet-a']}/version", timeout=30).json()[
            "version"
        ]
    else:
        engines = gpu_engines(ctx) if ctx.gpu else smoke_engines(ctx)
        for n in ("fleet-a", "fleet-b"):  # ports known now: pipeline.yaml names them before they run
            ctx.engines[n] = engines[n]
            ctx.engines[n].port = PORTS[n]
    write_project(ctx)
    res = {
        "project": str(ctx.project / "pipeline.yaml"),
        "engines": {n: e.url for n, e in ctx.engines.items()},
    }
    if not ctx.adapters_given and not _reusable(ctx.work / "adapters.json"):
        for v in (1, 2):
            ctx.start_bg(f"train{v}", _train_cmd(ctx, v))
    if ctx.gpu:
        if not nvfp4_current(ctx):
            ctx.start_bg("served-base", served_base_cmd(ctx), env=ctx.pipeline_env(modelopt=True))
        if ctx.plan == "main2":
            ctx.start_engine(gpu_engines(ctx)["staging"], PORTS["staging"])
    return res


def _reusable(p: Path):
    """What an earlier call on this machine left in WORK (adapters.json, versions.json), if still valid."""
    if not p.exists():
        return None
    d = {int(k): v for k, v in json.loads(p.read_text()).items()}
    if p.name == "adapters.json" and not all(Path(v).is_dir() for v in d.values()):
        return None
    return d


def st_served(ctx: Ctx) -> dict:
    """The NVFP4 checkpoint, then the two fleet engines on it (smoke: the tiny base, CPU engines)."""
    res = {}
    if ctx.gpu:
        if "served-base" in ctx.bg:
            res["build"] = ctx.wait_bg("served-base", 300)
            mark_built(ctx)
        nv = ctx.nvfp4
        q = json.loads((nv / "hf_quant_config.json").read_text())
        res["quantization"] = q.get("quantization", q)
        res["size_gb"] = round(_du(nv) / 1e9, 2)
    if not ctx.attach:
        for n in ("fleet-a", "fleet-b"):
            ctx.start_engine(ctx.engines[n], PORTS[n])
    return res


def st_train(ctx: Ctx) -> dict:
    if ctx.adapters_given:
        ctx.facts["adapters"] = {1: ctx.adapters_given[0], 2: ctx.adapters_given[1]}
        return {"adapters": [str(a) for a in ctx.adapters_given]}
    res, ads = {}, {}
    if (again := _reusable(ctx.work / "adapters.json")) is not None:
        ctx.facts["adapters"] = {k: Path(v) for k, v in again.items()}
        _after_train(ctx)
        return {"adapters": again, "reused": True}
    for v in (1, 2):
        r = ctx.wait_bg(f"train{v}", 400)
        out = ctx.bg_json(f"train{v}")
        if not out.get("adapter"):
            raise RuntimeError(f"`pipeline train --json` printed no adapter path: {out}")
        ads[v] = Path(out["adapter"])
        res[f"v{v}"] = {"adapter": out["adapter"], "wall_s": r["wall_s"], "metrics": out.get("metrics")}
    ctx.facts["adapters"] = ads
    (ctx.work / "adapters.json").write_text(json.dumps({k: str(v) for k, v in ads.items()}))
    _after_train(ctx)
    return res


def _after_train(ctx: Ctx) -> None:
    """Start what needs the adapters, while the rest runs: the merged NVFP4 model of v1 (issue 29.3, plans
    main and prep; reused when an earlier call on this machine built it) and the bf16 engine (main)."""
    if not ctx.gpu or ctx.plan not in ("main", "main2", "prep"):
        return
    ads = ctx.facts["adapters"]
    if not (ctx.work / "merged-v1" / "hf_quant_config.json").exists() and "merge" not in ctx.bg:
        ctx.start_bg("merge", [*ctx.pipeline_cmd(), "merge", ads[1], "--base", ctx.bf16, "--out",
                               ctx.work / "merged-v1", "--quantize", "nvfp4", "--device", "cuda", "--parity", "off",
                               "--no-progress", "--json"], env=ctx.pipeline_env(modelopt=True))  # fmt: skip
    if ctx.plan == "main2":
        ctx.start_engine(gpu_engines(ctx)["staging-bf16"], PORTS["staging-bf16"])


def st_prep_wait(ctx: Ctx) -> dict:
    """Plan prep: wait for the NVFP4 checkpoint and the merged model, so that plan main reuses both."""
    res = {}
    for name in ("served-base", "merge"):
        if name in ctx.bg:
            res[name] = {k: v for k, v in ctx.wait_bg(name, 400).items() if k != "log_tail"}
    for d in (ctx.nvfp4, ctx.work / "merged-v1"):
        res[d.name] = (d / "hf_quant_config.json").exists()
    return res


def st_register(ctx: Ctx) -> dict:
    res = {}
    ads = ctx.facts["adapters"]
    if (again := _reusable(ctx.work / "versions.json")) is not None and not ctx.attach:
        ctx.facts["versions"] = again
        return {"versions": again, "reused": True}
    served = ctx.nvfp4 if ctx.gpu else ctx.bf16
    v = ctx.cli("validate", ads[1], "--base", ctx.bf16, "--served", served, "--json", check=False)
    res["validate_served"] = {"rc": v["rc"], "wall_s": v["wall_s"], "report": _short_report(v.get("json"))}
    versions = {}
    for k in (1, 2):
        r = ctx.cli("register", ads[k], "--name", NAME, "--base", ctx.bf16, "--json")
        versions[k] = int((r["json"] or {}).get("version", k))
    ctx.facts["versions"] = versions
    (ctx.work / "versions.json").write_text(json.dumps(versions))
    res["versions"] = versions
    return res


def _short_report(rep: dict | None) -> dict | None:
    if not rep:
        return None
    keep = ("verdict", "passed", "errors", "warnings", "served", "vllm_version")
    out = {k: rep[k] for k in keep if k in rep}
    out["findings"] = [
        {k: f.get(k) for k in ("id", "severity", "message")}
        for f in (rep.get("findings") or [])
        if f.get("severity") in ("error", "warning")
    ][:20]
    return out


def st_engines(ctx: Ctx) -> dict:
    res = {}
    if "staging" in ctx.engines:
        try:
            ctx.wait_engine("staging", 420)
        except RuntimeError as e:  # the engine died starting: once more, recorded (bfloat16 is the default)
            res["staging_first_start_failed"] = str(e)[-2000:]
            s = ctx.engines.pop("staging")
            if s.proc is not None and s.proc.poll() is None:
                _kill(s.proc)
            args = s.args[:]
            args[args.index("--dtype") + 1] = "bfloat16"
            ctx.start_engine(Engine("staging", s.model, args), PORTS["staging"] + 10)
    for n in ("staging", "fleet-a", "fleet-b"):
        if n in ctx.engines:
            e = ctx.wait_engine(n, 420)
            res[n] = {"ready_s": e.ready_s, "model": e.model_id, "block_size": _block_size(e.url)}
    res["vllm_version"] = sorted(
        {
            httpx.get(f"{ctx.engines[n].url}/version", timeout=10).json().get("version")
            for n in ("fleet-a", "fleet-b")
        }
    )
    return res


def _block_size(url: str) -> int | None:
    v = prom.info_label(metrics(url), "vllm:cache_config_info", "block_size")
    return int(v) if v else None


def served_base_cmd(ctx: Ctx) -> list:
    """`pipeline dev served-base BF16 NVFP4 --device cuda`: the fleet's NVFP4 + MTP checkpoint of the base."""
    return [*ctx.pipeline_cmd(), "dev", "served-base", ctx.bf16, ctx.nvfp4, "--device", "cuda"]


def _built_from(ctx: Ctx) -> dict:
    """What identifies the bf16 base an NVFP4 build was made from (its path and config/report mtimes)."""
    return {
        "base": str(ctx.bf16.resolve()),
        "mtimes": {
            f: (ctx.bf16 / f).stat().st_mtime
            for f in ("config.json", TRAINED_REPORT)
            if (ctx.bf16 / f).exists()
        },
    }


def nvfp4_current(ctx: Ctx) -> bool:
    """Whether WORK/<base>-nvfp4 is a finished build of this very base (a marker written after the build;
    an older build without one counts for the default real8 only, as before)."""
    if not (ctx.nvfp4 / "hf_quant_config.json").exists():
        return False
    marker = ctx.work / f"{ctx.nvfp4.name}.from.json"
    if not marker.exists():
        return ctx.base_given is None and ctx.plan != "fleet64"
    got = json.loads(marker.read_text())
    if not ctx.bf16.exists():  # plan fleet64 deletes the bf16 base after its build
        return got.get("base") == str(ctx.bf16.resolve())
    return got == _built_from(ctx)


def mark_built(ctx: Ctx) -> None:
    (ctx.work / f"{ctx.nvfp4.name}.from.json").write_text(json.dumps(_built_from(ctx)))
