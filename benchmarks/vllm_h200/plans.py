"""The plans (stage lists), what each stage needs, the runner, and every engine's command line."""

from __future__ import annotations

import json
import os
import subprocess
import time
import traceback
from pathlib import Path

from .context import Ctx
from .engines import fleet64_engine, gpu_engines, smoke_engines, sweep_engines, trained_engines
from .fleet import (
    st_canary_parity,
    st_canary_served,
    st_decode,
    st_merged,
    st_mtp_check,
    st_publish,
    st_publish2,
    st_staging_bf16,
    st_stale_kv,
)
from .record import assemble
from .speed import st_adapter64, st_base64, st_build64, st_decode64, st_publish_latency, st_sweep
from .stages import (
    st_base,
    st_engines,
    st_host,
    st_launch,
    st_mtp,
    st_prep_wait,
    st_register,
    st_served,
    st_train,
)
from .trained import st_tb_bf16, st_tb_build, st_tb_drafter, st_tb_nvfp4

# (stage, function, estimated seconds: skipped when fewer are left before the deadline)
PLANS = {
    "main": [
        ("host", st_host, 10), ("base", st_base, 60), ("mtp", st_mtp, 120), ("launch", st_launch, 10),
        ("served", st_served, 30), ("train", st_train, 30), ("register", st_register, 40),
        ("engines", st_engines, 30), ("publish", st_publish, 60), ("mtp_check", st_mtp_check, 20),
        ("publish2", st_publish2, 90), ("stale_kv", st_stale_kv, 45), ("canary_served", st_canary_served, 90),
        # timed rows last: decode stops fleet-b and waits for the merge build; merged stops fleet-a
        ("decode", st_decode, 90), ("merged", st_merged, 150),
    ],
    # a second call on the same warm machine after main (one call holds about 540 s of driver time): the
    # bf16 staging engines (started only by this plan, so that main's fleet engines compile alone), and what
    # main had no time for; base, adapters, versions and the compile cache are reused
    "main2": [
        ("host", st_host, 10), ("base", st_base, 60), ("mtp", st_mtp, 120), ("launch", st_launch, 10),
        ("served", st_served, 30), ("train", st_train, 30), ("register", st_register, 40),
        ("engines", st_engines, 30), ("publish", st_publish, 60), ("canary_parity", st_canary_parity, 90),
        ("staging_bf16", st_staging_bf16, 120),  # last: its decode rows stop every other engine
    ],
    # call 1 of a fresh machine, while the engine's bundle is still arriving: everything plan main reuses
    "prep": [
        ("host", st_host, 10), ("base", st_base, 60), ("mtp", st_mtp, 120), ("launch", st_launch, 10),
        ("train", st_train, 30), ("prep_wait", st_prep_wait, 60),
    ],
    "sweep": [
        ("host", st_host, 10), ("base", st_base, 60), ("mtp", st_mtp, 120), ("launch", st_launch, 10),
        ("served", st_served, 30), ("train", st_train, 30), ("register", st_register, 40),
        ("engines", st_engines, 30), ("publish", st_publish, 60), ("publish_latency", st_publish_latency, 120),
        ("sweep", st_sweep, 200),  # stops the fleet engines, then one setting's engine at a time
    ],
    # the fleet's size: the 64-layer real-geometry NVFP4 checkpoint, decode at batch 1/8/32, base vs adapter
    "fleet64": [
        ("host", st_host, 10), ("base64", st_base64, 400), ("build64", st_build64, 500),
        ("adapter64", st_adapter64, 60), ("decode64", st_decode64, 300),
    ],
    # on a prebuilt base (--base DIR, e.g. `pipeline dev trained-base`): one engine on the GPU at a time
    "trained": [
        ("host", st_host, 10), ("base", st_base, 10), ("mtp", st_mtp, 120), ("tb_bf16", st_tb_bf16, 240),
        ("tb_build", st_tb_build, 180), ("tb_nvfp4", st_tb_nvfp4, 240), ("tb_drafter", st_tb_drafter, 200),
    ],
    "smoke": [
        ("host", st_host, 5), ("base", st_base, 60), ("mtp", st_mtp, 120), ("launch", st_launch, 10),
        ("served", st_served, 10), ("train", st_train, 300), ("register", st_register, 120),
        ("engines", st_engines, 240), ("canary_parity", st_canary_parity, 120), ("publish", st_publish, 120),
        ("decode", st_decode, 60), ("publish2", st_publish2, 180), ("stale_kv", st_stale_kv, 120),
    ],
}  # fmt: skip


# a stage that cannot run without an earlier one
NEEDS = {
    "mtp": ["base"], "launch": ["base"], "served": ["launch"], "train": ["launch"], "register": ["train", "served"],
    "engines": ["served"], "canary_parity": ["register", "engines"], "publish": ["register", "engines"],
    "decode": ["publish"], "mtp_check": ["mtp", "engines"], "publish2": ["publish"], "stale_kv": ["publish2"], "canary_served": ["publish"],
    "merged": ["train", "publish"], "staging_bf16": ["train", "register"],
    "sweep": ["register"], "build64": ["base64"], "decode64": ["build64", "adapter64"], "publish_latency": ["publish"], "prep_wait": ["launch"],
    "tb_bf16": ["base", "mtp"], "tb_build": ["base", "mtp"], "tb_nvfp4": ["tb_build"], "tb_drafter": ["tb_build"],
}  # fmt: skip


def run(ctx: Ctx, plan: list | None = None) -> dict:
    """Run the stages of `plan` (default PLANS[ctx.plan]) in order; returns the assembled record."""
    (ctx.out / "stages").mkdir(parents=True, exist_ok=True)
    (ctx.work / "logs").mkdir(parents=True, exist_ok=True)
    done: dict[str, dict] = {}
    plan = PLANS[ctx.plan] if plan is None else plan
    for name, fn, est in plan:
        missing = [
            n for n in NEEDS.get(name, []) if n in {p[0] for p in plan} and not done.get(n, {}).get("ok")
        ]
        if missing:
            rec = {"ok": False, "skipped": f"needs {', '.join(missing)}"}
        elif ctx.left() < est:
            rec = {"ok": False, "skipped": f"deadline: {ctx.left():.0f} s left, stage needs ~{est} s"}
        else:
            t = time.time()
            ctx.log(f"== {name}")
            try:
                rec = {"ok": True, "result": fn(ctx)}
            except Exception as e:  # noqa: BLE001 - a stage's failure is a result; the next stages decide
                rec = {
                    "ok": False,
                    "error": f"{type(e).__name__}: {e}"[-4000:],
                    "traceback": traceback.format_exc()[-3000:],
                }
            rec["seconds"] = round(time.time() - t, 1)
        rec["at_s"] = round(ctx.elapsed, 1)
        done[name] = rec
        (ctx.out / "stages" / f"{name}.json").write_text(json.dumps(rec, indent=1, default=str) + "\n")
        ctx.log(f"{name}: {'ok' if rec['ok'] else rec.get('skipped') or rec.get('error', '')[:300]}")
    record = assemble(ctx, done)
    (ctx.out / "vllm_h200.json").write_text(json.dumps(record, indent=1, default=str) + "\n")
    return record


_CHECK = r"""
import json, sys
import vllm.platforms as P
from vllm.platforms.interface import Platform, PlatformEnum
class _Cuda(Platform):  # argument parsing only: vLLM's config defaults ask the platform for a device type
    _enum = PlatformEnum.CUDA
    device_name = device_type = "cuda"
    dispatch_key = "CUDA"
P._current_platform = _Cuda()
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.entrypoints.openai.cli_args import make_arg_parser, validate_parsed_serve_args
import vllm
out = {"vllm": vllm.__version__}
import contextlib, io
for name, argv in json.load(sys.stdin).items():
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):  # `vllm serve MODEL`: the CLI turns the positional into --model
            a = make_arg_parser(FlexibleArgumentParser()).parse_args(["--model", argv[0], *argv[1:]])
            validate_parsed_serve_args(a)
        out[name] = "ok"
    except SystemExit as e:
        out[name] = f"exit {e.code}: {err.getvalue().strip().splitlines()[-1:]}"
    except Exception as e:
        out[name] = f"{type(e).__name__}: {e}"
print(json.dumps(out))
"""


def engine_argvs(plan: str, work: Path, base: Path | None = None) -> dict[str, list[str]]:
    """{engine: the `vllm serve` arguments it gets} for a plan (model path first; `base`: as `run --base`)."""
    ctx = Ctx(plan, work, work, 1e9, gpu=plan != "smoke", base_given=base)
    engines = {"sweep": sweep_engines, "smoke": smoke_engines, "trained": trained_engines,
               "fleet64": lambda c: {"fleet64": fleet64_engine(c)}}.get(plan, gpu_engines)(ctx)  # fmt: skip
    out = {}
    for n, e in engines.items():
        argv = [str(e.model), "--host", "127.0.0.1", "--port", "8000", *ctx.common(), *e.args]
        out[n] = argv + (["--served-model-name", e.served_name] if e.served_name else [])
    return out


def check_argvs(python: str, argvs: dict[str, list[str]]) -> dict:
    """Parse each command line with the vLLM installed for `python` (e.g. a Python 3.12 env with vllm 0.25.1)."""
    p = subprocess.run([python, "-c", _CHECK], input=json.dumps(argvs), capture_output=True, text=True, timeout=300,
                       env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})  # fmt: skip
    if p.returncode:
        raise RuntimeError(f"{python}: {p.stderr[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])
