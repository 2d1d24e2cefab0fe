"""Task adapters on a trained stand-in base, their reference answers, acceptance estimates and drafters.

Run on the GPU after `pipeline dev trained-base` (scripts/gpu/trained_call.sh adapters), before the engines
of plan `trained` (benchmarks/vllm_h200/trained.py), which read what this writes:

  python benchmarks/trained_adapters.py BASE WORK [--served NVFP4] [--device cuda] [--steps 150]
         [--draft-budget-s 60] [--tasks toolcall,snake] [--prompts 32]
  python benchmarks/trained_adapters.py --smoke   # CPU, seconds: the tiny VL base, a random LoRA (no training),
                                                  # 2 prompts, a 30-step drafter and its served checkpoint

For each task of `pipeline.dev.tasks` (issue 36 item 2, issue 38 items 1-2):
1. `pipeline dev task-data TASK` then `pipeline train` (axolotl) of an r16 LoRA on BASE, the shipped config's
   target modules (`axolotl_configs/qwen3.6-27b-lora.yml`; `tiny-cpu.yml` with `--device cpu`);
2. the PEFT reference: greedy answers (EOS stops) to the held-out prompts in bf16 and float32, the task metric
   of each (`pipeline.canary.task`) and their token agreement (the precision floor of bf16 itself);
3. the offline MTP acceptance estimate, base vs base + adapter (`pipeline.validate.acceptance.estimate`);
4. a drafter for the adapter (`pipeline.draft.distillation.distil`, checked by `check_drafter`) and, with
   `--served`, the served checkpoint with that drafter in place (`pipeline.draft.checkpoint`).
Writes WORK/adapters.json: per task the adapter path, training figures, prompts (token ids), expected
answers, reference tokens/texts/metrics, estimate, drafter figures and drafter checkpoint path.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pipeline.canary.task import expected_text, score, summarise  # noqa: E402
from pipeline.dev.tasks import TASKS, write_task_data  # noqa: E402


def _project(work: Path, base: Path) -> Path:
    p = work / "project"
    p.mkdir(parents=True, exist_ok=True)
    cfg = {"state_dir": str(p / "state"), "base": {"model": str(base), "path": str(base)},
           "train": {"runs_dir": str(work / "runs")}}  # fmt: skip
    (p / "pipeline.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    return p


def train_cmd(task: str, data: dict, base: Path, work: Path, device: str, steps: int) -> list[str]:
    """`pipeline train` of the task's LoRA: the shipped config (target modules, r, alpha) made short on GPU."""
    ds, test = (
        json.dumps([{"path": data[k], "ds_type": "json", "type": "chat_template", "field_messages": "messages",
                     "roles_to_train": ["assistant"], **({"split": "train"} if k == "validation" else {})}])
        for k in ("train", "validation")
    )  # fmt: skip
    if device == "cuda":
        cfg = "axolotl_configs/qwen3.6-27b-lora.yml"
        sets = [
            f"base_model={base}", "base_model_revision=null", "sequence_len=512", f"max_steps={steps}",
            "micro_batch_size=16", "gradient_accumulation_steps=1", "learning_rate=0.001", "sample_packing=false",
            "warmup_ratio=0.05", "lora_dropout=0.0", "lora_mlp_kernel=false", "lora_qkv_kernel=false",
            "lora_o_kernel=false", "eval_strategy='no'", "save_strategy='no'",
            "eval_steps=null", "save_steps=null", "gradient_checkpointing=false",
        ]  # fmt: skip
    else:
        cfg, sets = "axolotl_configs/tiny-cpu.yml", [f"base_model={base}", f"max_steps={steps}"]
    sets += [f"dataset_prepared_path={work / f'prepared-{task}'}", f"datasets={ds}", f"test_datasets={test}"]
    cmd = [sys.executable, "-m", "pipeline", "train", str(REPO / cfg), "--name", f"task-{task}", "--no-progress",
           "--json"]  # fmt: skip
    for s in sets:
        cmd += ["--set", s]
    return cmd


def _convs(path: str) -> list[dict]:
    return [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]


def reference_answers(model, tok, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """Greedy token ids after each prompt, stopped at the first EOS (kept), one prompt at a time."""
    import torch

    from pipeline.validate.acceptance import eos_ids

    eos = sorted(eos_ids(model, tok))
    dev = next(model.parameters()).device
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p], device=dev)
            g = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                               do_sample=False, eos_token_id=eos, pad_token_id=tok.pad_token_id or 0)  # fmt: skip
            out.append([int(t) for t in g[0, len(p) :]])
    return out


def task_metric(kind: str, tok, expected: list[str], answers: list[list[int]]) -> dict:
    texts = [tok.decode(a, skip_special_tokens=True) for a in answers]
    return summarise(kind, [score(kind, e, t) for e, t in zip(expected, texts, strict=True)]) | {
        "examples": texts[:3]
    }


def one_task(task: str, args, base: Path, work: Path, project: Path) -> dict:
    import torch
    from transformers import AutoTokenizer

    from pipeline.artifacts.peft_model import load_peft
    from pipeline.validate.acceptance import estimate, mtp_tensors, prompts_of

    res: dict = {"task": task, "metric": TASKS[task]}
    data = write_task_data(task, work / "tasks", n_train=args.train_rows)
    res["data"] = data
    t = time.time()
    given = dict(x.split("=", 1) for x in args.adapter)
    if task in given:  # an adapter trained elsewhere (the CPU smoke: axolotl's VL path needs torchvision)
        adapter = Path(given[task])
        res["train"] = {"given": str(adapter)}
    else:
        env = os.environ | {"PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        p = subprocess.run(train_cmd(task, data, base, work, args.device, args.steps), cwd=project, env=env,
                           capture_output=True, text=True, timeout=args.train_timeout_s)  # fmt: skip
        (work / f"train-{task}.log").write_text(p.stdout[-20000:] + "\n--- stderr\n" + p.stderr[-40000:])
        if p.returncode:
            raise RuntimeError(f"pipeline train {task} exit {p.returncode}: {p.stderr[-1500:]}")
        out = json.loads(p.stdout[p.stdout.index("{") :])
        adapter = Path(out["adapter"])
        res["train"] = {"wall_s": round(time.time() - t, 1), "metrics": out.get("metrics")}
    res["adapter"] = str(adapter)

    tok = AutoTokenizer.from_pretrained(str(base))
    val = _convs(data["validation"])[: args.prompts]
    prompts = prompts_of(tok, val, len(val))
    expected = [expected_text(c["messages"][-1]) for c in val]
    res["prompts"], res["expected"] = prompts, expected
    refs = {}
    for dtype in ("bfloat16", "float32"):
        model = load_peft(base, adapter, dtype, args.device)
        t = time.time()
        ans = reference_answers(model, tok, prompts, args.max_new)
        refs[dtype] = {"tokens": ans, "metric": task_metric(TASKS[task], tok, expected, ans),
                       "wall_s": round(time.time() - t, 1)}  # fmt: skip
        if dtype == "float32":
            with model.disable_adapter():
                base_ans = reference_answers(model, tok, prompts, args.max_new)
            res["base_metric_fp32"] = task_metric(TASKS[task], tok, expected, base_ans)
        else:
            bf16_model = model
        if dtype == "float32":
            del model
    sys.path.insert(0, str(REPO / "benchmarks"))
    from vllm_h200.measure import agreement

    res["reference"] = refs
    res["reference"]["bf16_vs_fp32"] = agreement(refs["float32"]["tokens"], refs["bfloat16"]["tokens"])
    state = mtp_tensors(base)
    t = time.time()
    res["estimate"] = estimate(bf16_model, tok, val, state) | {"wall_s": round(time.time() - t, 1)}
    if args.draft_budget_s > 0:
        res["drafter"] = drafter(task, bf16_model, tok, data, val, state, adapter, args, work)
    del bf16_model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return res


def drafter(task, model, tok, data, val, state, adapter: Path, args, work: Path) -> dict:
    """Distil the MTP layer on the adapted target, check it, and (with --served) build its served checkpoint."""
    from pipeline.draft.artifact import DrafterRecord, check_drafter, write_drafter
    from pipeline.draft.checkpoint import drafter_checkpoint
    from pipeline.draft.distillation import distil

    st, rep = distil(model, tok, _convs(data["train"]), val, state, budget_s=args.draft_budget_s,
                     max_steps=args.draft_max_steps, max_prompts=args.draft_prompts, lr=args.draft_lr)  # fmt: skip
    rec = DrafterRecord(
        name=f"task-{task}", version=1, base=str(args.base), reference=str(args.served or args.base), sha256="",
        acceptance_before=rep["before"], acceptance_after=rep["after"], data_sha256=rep["data_sha256"],
        eval_data_sha256=rep["eval_data_sha256"], train={k: rep[k] for k in ("steps", "kept", "train_s", "seconds")},
    )  # fmt: skip
    d = write_drafter(work / f"drafter-{task}", st, rec)
    out = {"dir": str(d), "before": rep["before"], "after": rep["after"], "steps": rep["steps"],
           "kept": rep["kept"], "train_s": rep["train_s"], "seconds": rep["seconds"], "val_curve": rep["val_curve"]}  # fmt: skip
    ref = Path(args.served or args.base)
    try:
        check_drafter(d, ref)
        out["checked"] = True
    except Exception as e:  # a drafter without gain is a result here, not a crash
        out["checked"], out["refused"] = False, str(e)[:600]
        return out
    if args.served:
        t = time.time()
        ck = drafter_checkpoint(Path(args.served), d, work / f"served-drafter-{task}")
        out["checkpoint"] = ck["out"]
        out["checkpoint_build"] = ck | {"wall_s": round(time.time() - t, 2)}
    return out


def smoke_args(tmp: Path) -> list[str]:
    """The CPU smoke's arguments: the tiny VL base (`pipeline dev tiny-base --layout vl`, MTP layer included),
    its NVFP4 build, and a random r8 LoRA on its language model's q/v (axolotl's VL path needs torchvision,
    which the CPU suite does not install: `--adapter` stands in for the training step)."""
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    from pipeline.dev.tinybase import build_tiny_base, build_tiny_served

    base = build_tiny_base(tmp / "base", layout="vl")
    served = build_tiny_served(base, tmp / "served")
    torch.manual_seed(0)
    model = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(str(base), dtype=torch.float32)
    cfg = LoraConfig(r=8, lora_alpha=16, target_modules=r".*language_model.*\.(q_proj|v_proj)")
    pm = get_peft_model(model, cfg)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)
    pm.save_pretrained(str(tmp / "adapter"))
    return [str(base), str(tmp / "work"), "--served", str(served), "--device", "cpu", "--tasks", "toolcall",
            "--adapter", f"toolcall={tmp / 'adapter'}", "--train-rows", "8", "--prompts", "2", "--max-new", "6",
            "--draft-budget-s", "60", "--draft-max-steps", "30", "--draft-lr", "1e-2", "--draft-prompts", "8"]  # fmt: skip


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--smoke"]:
        import tempfile

        tmp = Path(tempfile.mkdtemp(prefix="trained-adapters-smoke-"))
        try:
            rc = main(smoke_args(tmp) + argv[1:])
            got = json.loads((tmp / "work" / "adapters.json").read_text())["toolcall"]
            assert "error" not in got, got["error"]
            print(f"smoke: toolcall reference {got['reference']['bfloat16']['metric']['n']} answers, estimate "
                  f"ratio {got['estimate'].get('acceptance_ratio')}, drafter checked {got['drafter']['checked']}"
                  f", checkpoint {'checkpoint' in got['drafter'] or got['drafter'].get('refused', '')[:80]}")  # fmt: skip
            return rc
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("base", type=Path)
    ap.add_argument("work", type=Path)
    ap.add_argument(
        "--served", type=Path, help="the served (NVFP4) checkpoint: build each drafter's checkpoint"
    )
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--tasks", default="toolcall,snake")
    ap.add_argument("--steps", type=int, default=150, help="LoRA optimizer steps")
    ap.add_argument("--train-rows", type=int, default=1200)
    ap.add_argument("--train-timeout-s", type=float, default=400)
    ap.add_argument(
        "--prompts", type=int, default=32, help="held-out prompts for the reference and the estimate"
    )
    ap.add_argument("--max-new", type=int, default=64, help="greedy tokens at most per reference answer")
    ap.add_argument("--draft-budget-s", type=float, default=60.0, help="seconds of drafter training; 0: none")
    ap.add_argument("--draft-max-steps", type=int, default=None)
    ap.add_argument("--draft-lr", type=float, default=1e-4, help="the drafter's AdamW learning rate")
    ap.add_argument("--draft-prompts", type=int, default=256, help="training prompts of the drafter at most")
    ap.add_argument(
        "--adapter", action="append", default=[], metavar="TASK=DIR", help="use this adapter, no training"
    )
    args = ap.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    project = _project(args.work, args.base)
    out = args.work / "adapters.json"
    out.with_name(out.name + ".done").unlink(missing_ok=True)
    done = json.loads(out.read_text()) if out.exists() else {}
    for task in args.tasks.split(","):
        if task in done and "error" not in done[task]:
            continue
        t = time.time()
        try:
            done[task] = one_task(task, args, args.base, args.work, project) | {
                "wall_s": round(time.time() - t, 1)
            }
        except Exception as e:  # the next task still runs; the record says what failed
            done[task] = {"error": f"{type(e).__name__}: {e}"[:3000], "wall_s": round(time.time() - t, 1)}
        out.write_text(json.dumps(done))
        d = done[task]
        print(json.dumps({task: {k: d.get(k) for k in ("error", "adapter", "wall_s")}
                          | {"metric_bf16": (d.get("reference") or {}).get("bfloat16", {}).get("metric"),
                             "estimate_ratio": (d.get("estimate") or {}).get("acceptance_ratio"),
                             "drafter": {k: (d.get("drafter") or {}).get(k) for k in ("checked", "refused", "steps")}}}),
              flush=True)  # fmt: skip
    out.with_name(out.name + ".done").write_text(json.dumps({"tasks": sorted(done)}))
    return 0 if all("error" not in d for d in done.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
