"""Real `pipeline train` (axolotl's own CLI) runs of the shipped Qwen3.6-27B config on H200s.

Every run is `python -m pipeline train axolotl_configs/qwen3.6-27b-lora.yml` with the shipped
settings and only these overrides: `base_model` (a random-weight real-geometry base from
`pipeline dev real-base`, 8 or 64 layers), `sequence_len`, the synthetic datasets below,
`max_steps`, `gradient_accumulation_steps` (1, so that every optimizer step is a log record),
no evaluation/checkpoints (training throughput only), and per experiment the lever it measures.
Throughput, MFU and peak memory are what `pipeline train` itself computes from the trainer's
metrics (pipeline.train.metrics.summarise), with `train.peak_tflops` set to the bf16 matmul rate
measured on the same GPU in the same call.

    python benchmarks/axolotl_h200.py data DIR --tokenizer BASE_DIR    # synthetic datasets (CPU ok)
    python benchmarks/axolotl_h200.py run PLAN --work DIR --out DIR    # on the GPU host
    python benchmarks/axolotl_h200.py summary OUT_DIR...               # table + merged JSON (CPU)

Data: fixed-length chat rows (a user turn of ~25% of the tokens, an assistant turn of the rest,
random words), so tokens per step are constant; and a "mix" set whose lengths follow a lognormal
(median ~900 tokens, 64..4000) for the packing comparison.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CONFIG = "axolotl_configs/qwen3.6-27b-lora.yml"
FSDP2 = "axolotl_configs/fsdp2.yml"
WORDS = (
    "the of and to in is you that it he was for on are as with his they at be this have from or one had "
    "by word but not what all were we when your can said there use an each which she do how their if will "
    "up other about out many then them these so some her would make like him into time has look two more "
    "write go see number no way could people my than first water been call who oil its now find long down "
    "day did get come made may part tool call result weather city json value error server request retry"
).split()
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


# -- data ------------------------------------------------------------------------------------------
def _text_of(tok, rng: random.Random, n_tokens: int) -> str:
    """Random words cut to ~n_tokens tokens of `tok`."""
    words = " ".join(rng.choice(WORDS) for _ in range(int(n_tokens * 1.2) + 8))
    enc = tok(words, return_offsets_mapping=True, add_special_tokens=False)
    offs = enc["offset_mapping"]
    if len(offs) <= n_tokens:
        return words
    return words[: offs[n_tokens][0]].rstrip()


def _conversation(tok, rng: random.Random, total: int) -> dict:
    user = max(8, total // 4)
    msgs = [
        {"role": "user", "content": _text_of(tok, rng, user)},
        {"role": "assistant", "content": _text_of(tok, rng, total - user)},
    ]
    return {"messages": msgs}


def _length(tok, conv: dict) -> int:
    return len(tok.apply_chat_template(conv["messages"], tokenize=True, return_dict=True)["input_ids"])


def make_data(out: Path, tokenizer_dir: Path, seed: int = 0) -> dict:
    """Write fixed_{4096,16384}.jsonl, mix.jsonl; returns {name: [token lengths]}."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    lengths: dict[str, list[int]] = {}
    for seq, rows in ((4096, 48), (16384, 12)):
        convs, lens = [], []
        target = seq - 24
        while len(convs) < rows:
            c = _conversation(tok, rng, target)
            n = _length(tok, c)
            if n > seq:  # re-tokenisation at the cut can add a token or two: retry a bit shorter
                target -= n - seq + 4
                continue
            convs.append(c)
            lens.append(n)
        (out / f"fixed_{seq}.jsonl").write_text("".join(json.dumps(c) + "\n" for c in convs))
        lengths[f"fixed_{seq}"] = lens
    convs, lens = [], []
    while len(convs) < 600:
        n = int(min(4000, max(64, math.exp(rng.gauss(math.log(900), 0.8)))))
        c = _conversation(tok, rng, n)
        convs.append(c)
        lens.append(_length(tok, c))
    (out / "mix.jsonl").write_text("".join(json.dumps(c) + "\n" for c in convs))
    lengths["mix"] = lens
    (out / "lengths.json").write_text(
        json.dumps(
            {
                k: {"n": len(v), "mean": sum(v) / len(v), "min": min(v), "max": max(v)}
                for k, v in lengths.items()
            },
            indent=1,
        )
    )
    return lengths


# -- experiments -----------------------------------------------------------------------------------
def _ds(path: Path) -> str:
    return json.dumps(
        [
            {
                "path": str(path),
                "ds_type": "json",
                "type": "chat_template",
                "field_messages": "messages",
                "roles_to_train": ["assistant"],
            }
        ]
    )


def experiment(
    name,
    layers,
    seq,
    steps,
    gpu="0",
    gpus=1,
    sets=(),
    overlay=False,
    data=None,
    packing=False,
    kind="train",
    timeout=330,
    first=False,
):
    return dict(
        name=name,
        layers=layers,
        seq=seq,
        steps=steps,
        gpu=gpu,
        gpus=gpus,
        sets=list(sets),
        overlay=overlay,
        data=data or f"fixed_{seq}",
        packing=packing,
        kind=kind,
        timeout=timeout,
        first=first,
    )


UNFUSED = ["liger_fused_linear_cross_entropy=false"]
NO_CKPT = ["gradient_checkpointing=false"]
PACK = ["sample_packing=true", "eval_sample_packing=false", "attn_implementation=sdpa"]
PLANS = {
    # queue "0" and queue "1" run at the same time, one GPU each; then "01" runs alone on both GPUs.
    "call1": [
        experiment("l8-s4096", 8, 4096, 12, gpu="1"),
        experiment("l8-s4096-unfused", 8, 4096, 12, gpu="1", sets=UNFUSED),
        experiment("l8-s16384", 8, 16384, 5, gpu="1"),
        experiment("l8-s16384-unfused", 8, 16384, 5, gpu="1", sets=UNFUSED),
        experiment("l64-s4096", 64, 4096, 7, gpu="0", timeout=420),
        experiment("l64-s16384", 64, 16384, 4, gpu="0"),
    ],
    # CPU smoke test of this driver on a tiny-geometry base at WORK/real4 (`pipeline dev real-base` with
    # small overrides): CPU settings, fused CE through the pipeline plugin's chunked path.
    "smoke": [
        experiment(
            "smoke",
            4,
            4096,
            2,
            gpu="0",
            sets=[
                "bf16=false",
                "tf32=false",
                "liger_rms_norm=false",
                "liger_rms_norm_gated=false",
                "liger_glu_activation=false",
                "lora_mlp_kernel=false",
                "lora_qkv_kernel=false",
                "lora_o_kernel=false",
            ],
            timeout=900,
        ),
    ],
    "call2": [
        experiment("l8-s4096-fsdp2x2", 8, 4096, 10, gpu="01", gpus=2, overlay=True, first=True),
        experiment(
            "l64-s4096-fsdp2x2-nockpt",
            64,
            4096,
            6,
            gpu="01",
            gpus=2,
            overlay=True,
            first=True,
            sets=["fsdp_config.activation_checkpointing=false"],
            timeout=300,
        ),
        experiment("l8-s4096-ga2", 8, 4096, 10, gpu="0", sets=["gradient_accumulation_steps=2"]),
        experiment("l64-s4096-nockpt", 64, 4096, 6, gpu="0", sets=NO_CKPT),
        experiment("packing-check", 8, 4096, 0, gpu="1", kind="packing_check", timeout=200),
        experiment("l8-mix-padded", 8, 4096, 40, gpu="1", data="mix"),
        experiment("l8-mix-packed", 8, 4096, 12, gpu="1", data="mix", sets=PACK, packing=True),
        experiment("l64-s4096-fsdp2x2", 64, 4096, 6, gpu="01", gpus=2, overlay=True),
    ],
}


def _run_dirs(parent: Path, name: str) -> list[Path]:
    """Run directories of experiment `name` (`<name>-<UTC stamp>`, not `<name>-<suffix>-<stamp>`), oldest first."""
    pat = re.compile(re.escape(name) + r"-\d{8}T\d+Z")
    return sorted(p for p in parent.glob(f"{name}-*") if pat.fullmatch(p.name))


def _wait_for(path: Path, timeout_s: float) -> bool:
    t = time.time()
    while not path.exists():
        if time.time() - t > timeout_s:
            return False
        time.sleep(2)
    return True


def _run_one(e: dict, work: Path, out: Path, peaks: dict, log) -> dict:
    base = work / f"real{e['layers']}"
    run_dir = work / "runs" / e["name"]
    logs = work / "logs"
    logs.mkdir(exist_ok=True)
    rec = {**{k: e[k] for k in ("name", "layers", "seq", "gpus", "packing")}, "sets": e["sets"]}
    if not _wait_for(base / ".done", 420):
        log(f"{e['name']}: no base {base}")
        return {**rec, "rc": None, "error": f"base {base} not built"}
    cmd = [
        sys.executable,
        "-m",
        "pipeline",
        "train",
        CONFIG,
        "--name",
        e["name"],
        "--no-progress",
        "--set",
        f"base_model={base}",
        "--set",
        "base_model_revision=null",
        "--set",
        f"sequence_len={e['seq']}",
        "--set",
        f"max_steps={e['steps']}",
        "--set",
        "gradient_accumulation_steps=1",
        "--set",
        "eval_strategy='no'",
        "--set",
        "save_strategy='no'",
        "--set",
        "test_datasets=null",
        "--set",
        "eval_steps=null",
        "--set",
        "save_steps=null",
        "--set",
        f"dataset_prepared_path={work / 'prepared'}",
        "--set",
        f"datasets={_ds(work / 'data' / (e['data'] + '.jsonl'))}",
    ]
    for s in e["sets"]:
        cmd += ["--set", s]
    if e["overlay"]:
        cmd += ["--overlay", FSDP2, "--gpus", str(e["gpus"])]
    if e["kind"] == "packing_check":
        cmd = [
            sys.executable,
            "benchmarks/packing_check.py",
            "--base",
            str(base),
            "--out",
            str(out / "packing_check.json"),
        ]
    devices = ",".join(e["gpu"]) if e["gpu"] != "01" else "0,1"
    peak = min(peaks[d] for d in devices.split(",") if d in peaks) if peaks else None
    env = dict(
        os.environ,
        CUDA_VISIBLE_DEVICES=devices,
        **NCCL_ENV,
        PIPELINE_STATE_DIR=str(work / f"state-{e['gpu']}"),
        PIPELINE_TRAIN__RUNS_DIR=str(run_dir.parent),
        PYTHONUNBUFFERED="1",
    )
    if peak:
        env["PIPELINE_TRAIN__PEAK_TFLOPS"] = f"{peak:.1f}"
    t0 = time.time()
    with open(logs / f"{e['name']}.log", "w") as f:
        f.write(" ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.Popen(
            cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True
        )
        try:
            rc = proc.wait(timeout=e["timeout"])
        except subprocess.TimeoutExpired:  # the launcher's children (ranks) are in the same session
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = "timeout"
    rec.update(rc=rc, wall_s=round(time.time() - t0, 1), peak_tflops_measured=peak)
    runs = _run_dirs(run_dir.parent, e["name"])
    if runs:
        rd = runs[-1]
        recs = (
            [json.loads(x) for x in (rd / "metrics.jsonl").read_text().splitlines() if x.strip()]
            if (rd / "metrics.jsonl").exists()
            else []
        )
        rec["steps"] = [
            {
                k: r.get(k)
                for k in (
                    "step",
                    "loss",
                    "grad_norm",
                    "time",
                    "tokens/total",
                    "tokens/trainable",
                    "memory/max_allocated (GiB)",
                )
            }
            for r in recs
            if r.get("event") == "log" and "loss" in r
        ]
        rec["begin"] = next((r for r in recs if r.get("event") == "begin"), None)
        man = rd / "adapter" / "manifest.json"
        if man.exists():
            m = json.loads(man.read_text())
            rec["summary"] = m.get("metrics")
            rec["adapter_dir"] = str(rd / "adapter")
        tail = (
            (rd / "train.log").read_text(errors="replace").splitlines()[-60:]
            if (rd / "train.log").exists()
            else []
        )
        (logs / f"{e['name']}.log").open("a").write("\n--- train.log tail ---\n" + "\n".join(tail) + "\n")
    log(f"{e['name']}: rc={rc} {rec.get('summary')} ({rec['wall_s']} s)")
    return rec


KERNELS_OFF = ["lora_mlp_kernel=false", "lora_qkv_kernel=false", "lora_o_kernel=false"]
_FALLBACK = {"kernels_off": False}


def _failed_in_lora_kernels(work: Path, name: str) -> bool:
    log = work / "logs" / f"{name}.log"
    text = log.read_text(errors="replace") if log.exists() else ""
    return "Traceback" in text and ("axolotl/kernels/lora" in text or "lora_kernels" in text)


def _run_with_fallback(e: dict, work: Path, out: Path, peaks: dict, log) -> dict:
    """Run; if axolotl's LoRA Triton kernels (auto-enabled on CUDA) break, rerun with them off and say so."""
    if _FALLBACK["kernels_off"] and e["kind"] == "train":
        e = {**e, "sets": e["sets"] + KERNELS_OFF}
    rec = _run_one(e, work, out, peaks, log)
    if rec.get("rc") not in (0, None) and e["kind"] == "train" and _failed_in_lora_kernels(work, e["name"]):
        _FALLBACK["kernels_off"] = True
        log(f"{e['name']}: axolotl's LoRA kernels failed; rerunning with them off")
        rec = {
            **_run_one({**e, "sets": e["sets"] + KERNELS_OFF}, work, out, peaks, log),
            "fallback": "lora_kernels_off",
        }
    return rec


def run_plan(plan: str, work: Path, out: Path, only: list[str] | None, deadline_s: float) -> None:
    peaks = json.loads((work / "peaks.json").read_text()) if (work / "peaks.json").exists() else {}
    exps = [e for e in PLANS[plan] if not only or e["name"] in only]
    records = out / "records.jsonl"
    lock = threading.Lock()
    t_start = time.time()

    def log(msg):
        with lock:
            print(f"[{time.time() - t_start:6.0f}s] {msg}", flush=True)

    def worker(queue):
        for e in queue:
            if time.time() - t_start > deadline_s:
                log(f"{e['name']}: skipped (deadline)")
                continue
            rec = _run_with_fallback(e, work, out, peaks, log)
            with lock, open(records, "a") as f:
                f.write(json.dumps(rec) + "\n")

    worker([e for e in exps if e["first"]])  # both GPUs, before the one-GPU queues
    singles = {q: [e for e in exps if e["gpu"] == q] for q in ("0", "1")}
    threads = [threading.Thread(target=worker, args=(singles[q],)) for q in singles if singles[q]]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    worker([e for e in exps if e["gpu"] == "01" and not e["first"]])


def measure_peaks(work: Path) -> dict:
    import torch

    out = {}
    for d in range(torch.cuda.device_count()):
        with torch.cuda.device(d):
            a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
            b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
            for _ in range(5):
                a @ b
            ts = []
            for _ in range(20):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                a @ b
                e1.record()
                e1.synchronize()
                ts.append(e0.elapsed_time(e1) / 1e3)
            ts.sort()
            out[str(d)] = 2 * 8192**3 / ts[len(ts) // 2] / 1e12
    (work / "peaks.json").write_text(json.dumps(out))
    return out


# -- adapters --------------------------------------------------------------------------------------
def _header(path: Path) -> dict:
    import struct

    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        h = json.loads(f.read(n))
    h.pop("__metadata__", None)
    return {k: (v["dtype"], v["shape"]) for k, v in h.items()}


def check_adapters(work: Path, out: Path) -> dict:
    """1-GPU vs FSDP2 adapters: same tensor names, dtypes, shapes, adapter_config; and `pipeline validate`
    of the 64-layer adapters against the real-layout base and a 27B-shaped NVFP4 served index."""
    res: dict = {}
    runs = work / "runs"

    def adapter(name):
        c = [d / "adapter" for d in _run_dirs(runs, name) if (d / "adapter").is_dir()]
        return c[-1] if c else None

    for one, two in (("l8-s4096-ga2", "l8-s4096-fsdp2x2"), ("l64-s4096", "l64-s4096-fsdp2x2")):
        a, b = adapter(one), adapter(two)
        if not (a and b):
            res[f"{one} vs {two}"] = "missing"
            continue
        ha, hb = _header(a / "adapter_model.safetensors"), _header(b / "adapter_model.safetensors")
        ca = json.loads((a / "adapter_config.json").read_text())
        cb = json.loads((b / "adapter_config.json").read_text())
        keys = ("r", "lora_alpha", "target_modules", "use_dora", "use_rslora", "modules_to_save")
        res[f"{one} vs {two}"] = {
            "tensors": len(ha),
            "same_keys_shapes_dtypes": ha == hb,
            "only_in_1gpu": sorted(set(ha) - set(hb))[:5],
            "only_in_2gpu": sorted(set(hb) - set(ha))[:5],
            "same_adapter_config": all(
                ca.get(k) == cb.get(k)
                if not isinstance(ca.get(k), list)
                else sorted(ca[k]) == sorted(cb.get(k) or [])
                for k in keys
            ),
            "example_key": sorted(ha)[0] if ha else None,
        }
    served = work / "served27b"
    if not served.exists():
        sys.path.insert(0, str(REPO / "benchmarks"))
        from qwen36_27b import text_config
        from validate_static import base_tensors, write_sparse_checkpoint

        quant = {
            "producer": {"name": "modelopt"},
            "quantization": {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head", "mtp*"]},
        }
        write_sparse_checkpoint(
            served,
            base_tensors("model.", quantized=True),
            text_config() | {"architectures": ["Qwen3_5ForCausalLM"]},
            4,
            {"hf_quant_config.json": quant},
        )
    for name in ("l64-s4096", "l64-s4096-fsdp2x2"):
        a = adapter(name)
        if a is None:
            continue
        p = subprocess.run(
            [
                sys.executable,
                "-m",
                "pipeline",
                "validate",
                str(a),
                "--base",
                str(work / "real64"),
                "--served",
                str(served),
                "--json",
            ],
            capture_output=True,
            text=True,
            cwd=REPO,
            timeout=100,
        )
        try:
            res[f"validate {name}"] = {"rc": p.returncode, "report": json.loads(p.stdout)}
        except json.JSONDecodeError:
            res[f"validate {name}"] = {
                "rc": p.returncode,
                "stdout": p.stdout[-2000:],
                "stderr": p.stderr[-2000:],
            }
    out.write_text(json.dumps(res, indent=1))
    return res


# -- summary ---------------------------------------------------------------------------------------
def summary(out_dirs: list[Path]) -> list[dict]:
    """One record per run (the benchmarks/results/axolotl_h200.json schema) from records.jsonl files."""
    rows = []
    for d in out_dirs:
        for line in (Path(d) / "records.jsonl").read_text().splitlines():
            r = json.loads(line)
            s = r.get("summary") or {}
            mem = [
                x["memory/max_allocated (GiB)"]
                for x in r.get("steps", [])
                if x.get("memory/max_allocated (GiB)")
            ]
            rows.append(
                {
                    "runner": "axolotl",
                    "name": r["name"],
                    "layers": r["layers"],
                    "seq": r["seq"],
                    "gpus": r["gpus"],
                    "packing": r["packing"],
                    "ok": r["rc"] == 0,
                    "tokens_per_s": s.get("tokens_per_s"),
                    "trainable_tokens_per_s": s.get("trainable_tokens_per_s"),
                    "mfu": round(100 * s["mfu"], 2) if s.get("mfu") else None,
                    "peak_tflops": s.get("peak_tflops"),
                    "peak_gb": round(max(mem) * 2**30 / 1e9, 2) if mem else None,
                    "base_params": (r.get("begin") or {}).get("base_params"),
                    "sets": r["sets"],
                    "losses": [x["loss"] for x in r.get("steps", [])],
                    "grad_norms": [x["grad_norm"] for x in r.get("steps", [])],
                }
            )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("data")
    d.add_argument("out", type=Path)
    d.add_argument("--tokenizer", type=Path, required=True)
    r = sub.add_parser("run")
    r.add_argument("plan", choices=sorted(PLANS))
    r.add_argument("--work", type=Path, required=True)
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--only", nargs="*")
    r.add_argument(
        "--deadline-s", type=float, default=1e9, help="start no experiment after this many seconds"
    )
    sub.add_parser("peaks").add_argument("--work", type=Path, required=True)
    ad = sub.add_parser("adapters")
    ad.add_argument("--work", type=Path, required=True)
    ad.add_argument("--out", type=Path, required=True)
    s = sub.add_parser("summary")
    s.add_argument("dirs", nargs="+", type=Path)
    s.add_argument("--json", type=Path)
    a = ap.parse_args()
    if a.cmd == "data":
        print(json.dumps({k: (min(v), max(v), len(v)) for k, v in make_data(a.out, a.tokenizer).items()}))
    elif a.cmd == "adapters":
        print(json.dumps(check_adapters(a.work, a.out))[:3000])
    elif a.cmd == "peaks":
        print(json.dumps(measure_peaks(a.work)))
    elif a.cmd == "run":
        a.out.mkdir(parents=True, exist_ok=True)
        run_plan(a.plan, a.work, a.out, a.only, a.deadline_s)
    else:
        rows = summary(a.dirs)
        if a.json:
            a.json.write_text(json.dumps(rows, indent=1) + "\n")
        for x in rows:
            print(
                f"{x['name']:28s} ok={x['ok']} tok/s={x['tokens_per_s']} mfu={x['mfu']} peak={x['peak_gb']}"
            )


if __name__ == "__main__":
    main()
