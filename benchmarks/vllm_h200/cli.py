"""`python benchmarks/vllm_h200.py run|argv|record ...`: the command line."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from . import REPO
from .context import Ctx
from .plans import PLANS, check_argvs, engine_argvs, run
from .record import markdown, record_into


def main() -> None:
    ap = argparse.ArgumentParser(
        description=sys.modules[__package__].__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("plan", choices=sorted(PLANS))
    r.add_argument("--work", type=Path, required=True)
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--deadline-s", type=float, default=500.0, help="start no stage that would end after this")
    r.add_argument(
        "--attach", nargs="*", default=[], help="NAME=URL: running instances instead of new engines (smoke)"
    )
    r.add_argument(
        "--adapters", nargs=2, type=Path, help="two adapter directories instead of training (smoke)"
    )
    r.add_argument("--base", type=Path, help="a prebuilt bf16 base (e.g. `pipeline dev trained-base`) instead of "
                   "building the random real8; required by plan trained")  # fmt: skip
    r.add_argument("--task-adapters", type=Path, help="adapters.json of benchmarks/trained_adapters.py: task "
                   "adapters loaded in plan trained's engines (and a drafter engine when one has a drafter)")  # fmt: skip
    g = sub.add_parser("argv")
    g.add_argument("--plan", choices=sorted(PLANS), default="main")
    g.add_argument("--work", type=Path, default=Path("/tmp/vw"))
    g.add_argument("--check", metavar="PYTHON", help="parse each with the vLLM of this interpreter")
    g.add_argument("--base", type=Path, help="as `run --base`")
    rc = sub.add_parser("record")
    rc.add_argument("out", type=Path)
    rc.add_argument("--into", type=Path, default=REPO / "benchmarks" / "results" / "vllm_h200.json")
    a = ap.parse_args()
    if a.cmd == "argv":
        argvs = engine_argvs(a.plan, a.work, a.base)
        print(json.dumps(check_argvs(a.check, argvs) if a.check else argvs, indent=1))
        return
    if a.cmd == "record":
        print(json.dumps(record_into(a.out, a.into), indent=1))
        print(markdown(json.loads((a.out / "vllm_h200.json").read_text())))
        return
    if a.plan == "trained" and a.base is None:
        ap.error("plan trained needs --base DIR (a base written by `pipeline dev trained-base`)")
    if a.base is not None and not (a.base / "config.json").is_file():
        ap.error(f"--base {a.base}: no config.json there; name a checkpoint directory")
    if a.base is not None and a.attach:
        ap.error("--base and --attach exclude each other: attached instances serve their own base")
    a.work.mkdir(parents=True, exist_ok=True)
    a.out.mkdir(parents=True, exist_ok=True)
    ctx = Ctx(a.plan, a.work.resolve(), a.out.resolve(), a.deadline_s, gpu=a.plan != "smoke")
    ctx.base_given = a.base.resolve() if a.base is not None else None
    if a.adapters:
        ctx.adapters_given = [p.resolve() for p in a.adapters]
    ctx.attach = dict(x.split("=", 1) for x in a.attach) or None
    if a.task_adapters is not None:  # may still be in the making: the stages wait for its `.done` marker
        if not a.task_adapters.parent.is_dir():
            ap.error(
                f"--task-adapters {a.task_adapters}: no such directory (benchmarks/trained_adapters.py WORK)"
            )
        ctx.facts["task_adapters_path"] = a.task_adapters.resolve()
    try:
        rec = run(ctx)
    finally:
        ctx.stop_all()
    print(json.dumps(rec["done_when"], indent=1))
    print(json.dumps({"failed": rec["failed"], "seconds": rec["seconds"]}))
