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

import yaml

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


def make_data(
    out: Path,
    tokenizer_dir: Path,
    seed: int = 0,
    seqs: tuple[int, ...] = (4096, 16384),
    mix_median: int = 900,
    mix_max: int = 4000,
    mix_n: int = 600,
) -> dict:
    """Write fixed_{seq}.jsonl for each of `seqs`, mix.jsonl; returns {name: [token lengths]}."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    lengths: dict[str, list[int]] = {}
    for seq in seqs:
        rows = max(12, 48 * 4096 // seq)
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
    while len(convs) < mix_n:
        n = int(min(mix_max, max(64, math.exp(rng.gauss(math.log(mix_median), 0.8)))))
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
    sweep=None,
    policy_from=None,
    drop_base=False,
    strategy=None,
):
    """One `pipeline train` run (kind "train"), or the packing check; `sweep`: recompute phases measured
    in this run (benchmarks/recompute_sweep.py); `policy_from`: take the recompute policy that
    `best_policy` picks from that earlier sweep experiment (this plan's, or `--policy-records`);
    `drop_base`: delete the base afterwards (the 64 GiB disk holds one 64-layer base and nothing else big)."""
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
        sweep=sweep,
        policy_from=policy_from,
        drop_base=drop_base,
        strategy=strategy,
    )


UNFUSED = ["liger_fused_linear_cross_entropy=false"]
NO_DROPOUT = ["lora_dropout=0.0", "sample_packing=false"]
NO_CKPT = ["gradient_checkpointing=false"]
PACK = ["sample_packing=true", "eval_sample_packing=false", "attn_implementation=sdpa"]
CPU = [  # CPU smoke runs: the tiny text base (`smoke-base`), no Triton kernels
    "model_type=AutoModelForCausalLM",
    "liger_fused_linear_cross_entropy=false",
    "bf16=false",
    "tf32=false",
    "liger_rms_norm=false",
    "liger_rms_norm_gated=false",
    "liger_glu_activation=false",
    "lora_mlp_kernel=false",
    "lora_qkv_kernel=false",
    "lora_o_kernel=false",
]
# Recompute policies of the shipped config, one phase each (benchmarks/recompute_sweep.py). 64 layers
# = 48 linear_attention + 16 full_attention; every_n_layers k checkpoints layers with index % k == 0.
SWEEP = [
    dict(name="warmup", every_n_layers=1, steps=2),  # compile (tilelang/Triton) lands here
    dict(name="full", every_n_layers=1, steps=3),  # the shipped policy so far: every layer recomputed
    dict(name="full+fla_gdn", every_n_layers=1, fla_gdn=True, steps=3),
    dict(name="linear_attention_only", every_n_layers=1, types=["linear_attention"], fla_gdn="best", steps=3),
    dict(name="full_attention_only", every_n_layers=1, types=["full_attention"], fla_gdn="best", steps=3),
    dict(name="every_2", every_n_layers=2, fla_gdn="best", steps=3),
    dict(name="every_2+offload", every_n_layers=2, offload=True, fla_gdn="best", steps=3),
    dict(name="full+offload", every_n_layers=1, offload=True, fla_gdn="best", steps=3),
    dict(name="none", every_n_layers=0, fla_gdn="best", steps=3),
]
SMOKE_SWEEP = [
    dict(name="warmup", every_n_layers=1, steps=1),
    dict(name="full", every_n_layers=1, steps=2),
    dict(name="linear_attention_only", every_n_layers=1, types=["linear_attention"], steps=2),
    dict(name="every_2", every_n_layers=2, steps=2),
    dict(name="none", every_n_layers=0, steps=2),
]
SWEEP_PLUGIN = "benchmarks.recompute_sweep.SweepPlugin"
# memory of the shipped config besides activations: the bf16 weights + ~2.3 GB (LoRA, optimizer,
# buffers; from the full-recompute peaks 60.1 GB at 4096 and 72.2 GB at 16384, benchmarks/RESULTS.md)
STATIC_GB_OVER_WEIGHTS = 2.3
LIMIT_GB = 80.0
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
    # CPU smoke test of this driver on a tiny-geometry base at WORK/real4 (`smoke-base`): CPU settings,
    # fused CE through the pipeline plugin's chunked path. The train runs pack (the shipped config).
    "smoke": [
        experiment("smoke", 4, 512, 2, sets=CPU, timeout=900),
        experiment("smoke-unpacked", 4, 512, 2, data="mix", sets=[*CPU, "sample_packing=false"], timeout=900),
        experiment(
            "smoke-packing-check",
            4,
            512,
            0,
            kind="packing_check",
            sets=[*CPU, "plugins=[pipeline.train.axolotl_plugin.PipelinePlugin]"],
            timeout=900,
        ),
    ],
    # the recompute sweep and the policy choice on CPU (every_n_layers/types phases; no offload: transformers 5.16)
    "smoke-sweep": [
        experiment(
            "smoke-sweep",
            4,
            512,
            sum(p["steps"] for p in SMOKE_SWEEP),
            sets=[*CPU, "sample_packing=false"],
            sweep=SMOKE_SWEEP,
            timeout=900,
        ),
        experiment(
            "smoke-best",
            4,
            512,
            2,
            sets=[*CPU, "sample_packing=false"],
            policy_from="smoke-sweep",
            timeout=900,
        ),
    ],
    # ONE H200, call A (~8 min cold): packing check on an 8-layer base (deleted after), then the 64-layer
    # fixed-4096 recompute sweep of the shipped config: the policies in phases of one run.
    "h200-a": [
        experiment("packing-check", 8, 4096, 0, kind="packing_check", timeout=300, drop_base=True),
        experiment(
            "l64-s4096-sweep",
            64,
            4096,
            sum(p["steps"] for p in SWEEP),
            sets=["sample_packing=false"],
            sweep=SWEEP,
            timeout=400,
        ),
    ],
    # ONE H200, call B (~7 min cold, ~4 warm right after A): the realistic length mix at 64 layers,
    # unpacked vs the shipped config (packed rows of 16384) with the recompute policy that call A's sweep
    # picked for 16384 under 80 GB: its peak is the 16384 figure.
    "h200-b": [
        experiment("l64-mix-unpacked", 64, 16384, 8, data="mix", sets=["sample_packing=false"], timeout=300),
        experiment(
            "l64-mix-packed",
            64,
            16384,
            6,
            data="mix",
            packing=True,
            policy_from="l64-s4096-sweep",
            timeout=260,
        ),
    ],
    # nvidia-h200-x2 (issue 28, ~8 min): 64 layers, seq 4096, the same global batch (2 rows per step),
    # LoRA dropout off so that the losses can be compared: 1 GPU (GA 2) vs DDP x2 vs FSDP2 x2.
    "ddp2": [
        experiment(
            "l64-s4096-1gpu-ga2", 64, 4096, 6, gpu="0", sets=["gradient_accumulation_steps=2", *NO_DROPOUT]
        ),
        experiment(
            "l64-s4096-ddp-x2", 64, 4096, 6, gpu="01", gpus=2, strategy="ddp", sets=NO_DROPOUT, timeout=300
        ),
        experiment(
            "l64-s4096-fsdp2-x2",
            64,
            4096,
            6,
            gpu="01",
            gpus=2,
            strategy="fsdp2",
            sets=NO_DROPOUT,
            timeout=300,
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


def _weights_gb(base: Path) -> float | None:
    idx = base / "model.safetensors.index.json"
    try:
        return json.loads(idx.read_text())["metadata"]["total_size"] / 1e9
    except (OSError, KeyError, ValueError):
        return None


def phase_metrics(
    phases: list[dict], steps: list[dict], base_params: int | None, peak_tflops: float | None
) -> list[dict]:
    """Per sweep phase: tokens/s between the logs of its first and last step (the first step of a
    phase carries the switch), MFU (6 x base parameters x tokens/s / peak), peak GB over its steps."""
    by_step = {x["step"]: x for x in steps if x.get("step") is not None}
    out = []
    for ph in phases:
        a, b = by_step.get(ph["first_step"]), by_step.get(ph["last_step"])
        row = {k: v for k, v in ph.items() if k != "step_end_times"}
        if a and b and b["time"] > a["time"] and b.get("tokens/total") and a.get("tokens/total") is not None:
            tps = (b["tokens/total"] - a["tokens/total"]) / (b["time"] - a["time"])
            row["tokens_per_s"] = round(tps, 1)
            if base_params and peak_tflops:
                row["mfu"] = round(100 * 6 * base_params * tps / (peak_tflops * 1e12), 2)
        mem = [
            by_step[i].get("memory/max_allocated (GiB)")
            for i in range(ph["first_step"], ph["last_step"] + 1)
            if i in by_step and by_step[i].get("memory/max_allocated (GiB)")
        ]
        row["peak_gb"] = round(max(mem) * 2**30 / 1e9, 2) if mem else None
        out.append(row)
    return out


def policy_sets(ph: dict) -> list[str]:
    """The config overrides that make a sweep phase's policy the run's policy."""
    n = int(ph.get("every_n_layers", 1))
    if n <= 0:
        sets = ["gradient_checkpointing=false"]
    else:
        kw = (
            ["use_reentrant: true"]
            + ([f"every_n_layers: {n}"] if n != 1 else [])
            + (["offload: true"] if ph.get("offload") else [])
        )
        sets = ["gradient_checkpointing=true", "gradient_checkpointing_kwargs={" + ", ".join(kw) + "}"]
        if ph.get("types"):
            sets.append(f"pipeline_recompute_layer_types=[{', '.join(ph['types'])}]")
    if ph.get("fla_gdn"):
        sets.append("pipeline_fla_gdn=true")
    return sets


def best_policy(sweep: dict, seq: int, weights_gb: float | None, limit_gb: float = LIMIT_GB) -> dict:
    """The sweep phase with the highest MFU whose peak, scaled to `seq`, stays under `limit_gb` - 1.

    Scaling: activations grow linearly with the tokens of a row, so peak(seq) = static + (peak - static)
    x seq / sweep seq, static = weights + STATIC_GB_OVER_WEIGHTS (an estimate: the run at `seq` measures it).
    Falls back to the `full` phase when nothing is estimated to fit."""
    static = (weights_gb or 0) + STATIC_GB_OVER_WEIGHTS
    cands = []
    for ph in sweep.get("phases") or []:
        if ph["name"] == "warmup" or ph.get("mfu") is None or ph.get("peak_gb") is None:
            continue
        est = static + (ph["peak_gb"] - static) * seq / sweep["seq"]
        cands.append({**ph, "est_peak_gb_at_seq": round(est, 1)})
    fits = [c for c in cands if c["est_peak_gb_at_seq"] <= limit_gb - 1]
    pick = (
        max(fits, key=lambda c: c["mfu"]) if fits else next((c for c in cands if c["name"] == "full"), None)
    )
    return {
        "phase": pick,
        "sets": policy_sets(pick) if pick else [],
        "seq": seq,
        "limit_gb": limit_gb,
        "candidates": cands,
    }


def ensure_base(work: Path, layers: int, log) -> bool:
    """WORK/real{layers}: a random real-geometry base (`pipeline dev real-base`, drawn on the GPU), built
    once per machine; a smoke base (`smoke-base`) must exist already."""
    base = work / f"real{layers}"
    with _BUILD_LOCK:  # two queues may want the same base
        if (base / ".done").exists():
            return True
        return _build_base(work, base, layers, log)


_BUILD_LOCK = threading.Lock()


def _build_base(work: Path, base: Path, layers: int, log) -> bool:
    import torch

    if not torch.cuda.is_available():
        log(f"no base {base} (CPU: build it with `smoke-base`)")
        return False
    t = time.time()
    with open(work / "logs" / f"build{layers}.log", "w") as f:
        rc = subprocess.run(
            [
                sys.executable,
                "-m",
                "pipeline",
                "dev",
                "real-base",
                str(base),
                "--layers",
                str(layers),
                "--device",
                "cuda",
            ],
            stdout=f,
            stderr=subprocess.STDOUT,
            cwd=REPO,
        ).returncode
    if rc == 0:
        (base / ".done").touch()
    log(f"base {base}: rc={rc} ({time.time() - t:.0f} s)")
    return rc == 0


def train_sets(e: dict, work: Path, base: Path, sets: list[str] | None = None) -> list[str]:
    """The `--set` overrides of experiment `e`'s `pipeline train` run: the fixed ones (base, length,
    steps, no evaluation or checkpoints, the synthetic data), then `sets` (default: `e["sets"]`;
    `_run_one` adds the chosen recompute policy), then the sweep plugin when `e` sweeps."""
    sets = list(e["sets"] if sets is None else sets)
    out = [
        f"base_model={base}",
        "base_model_revision=null",
        f"sequence_len={e['seq']}",
        f"max_steps={e['steps']}",
        "gradient_accumulation_steps=1",
        "eval_strategy='no'",
        "save_strategy='no'",
        "test_datasets=null",
        "eval_steps=null",
        "save_steps=null",
        f"dataset_prepared_path={work / 'prepared'}",
        f"datasets={_ds(work / 'data' / (e['data'] + '.jsonl'))}",
        *sets,
    ]
    if e.get("sweep"):  # added to the config's plugins (the last --set plugins=... wins)
        plugins = next((x.split("=", 1)[1] for x in reversed(sets) if x.startswith("plugins=")), None)
        listed = yaml.safe_load(plugins) if plugins else ["axolotl.integrations.liger.LigerPlugin"]
        out.append(f"plugins=[{', '.join([*listed, SWEEP_PLUGIN])}]")
    return out


def smoke(work: Path) -> int:
    """CPU check of the driver in seconds (the suite runs it): the tiny base and data at toy sizes, and
    every `pipeline train` experiment of every plan through the pipeline's own config check (known
    keys, axolotl's validation), so a renamed key or a bad value in a plan fails here, not on the GPU."""
    from pipeline.dev.tinybase import build_tiny_base
    from pipeline.errors import PipelineError
    from pipeline.train.config import load_training_config
    from pipeline.train.schema import check_axolotl_schema

    base = work / "real4"
    if not (base / ".done").exists():
        build_tiny_base(base)
        (base / ".done").touch()
    lengths = make_data(work / "data", base, seqs=(512,), mix_median=100, mix_max=400, mix_n=8)
    print(f"data: {json.dumps({k: (min(v), max(v), len(v)) for k, v in lengths.items()})}")
    bad, n = [], 0
    for plan, experiments in sorted(PLANS.items()):
        for e in experiments:
            if e["kind"] != "train":
                continue
            overlays = [REPO / FSDP2] if e["overlay"] else []
            try:
                tc = load_training_config(REPO / CONFIG, train_sets(e, work, base), overlays)
                check_axolotl_schema(tc)
            except PipelineError as err:
                bad.append(f"{plan}/{e['name']}: {str(err)[:400]}")
            n += 1
    print(f"{n} train experiments in {len(PLANS)} plans checked; {len(bad)} refused")
    for b in bad:
        print("  " + b)
    return 1 if bad else 0


def _run_one(e: dict, work: Path, out: Path, peaks: dict, log, done: dict | None = None) -> dict:
    base = work / f"real{e['layers']}"
    run_dir = work / "runs" / e["name"]
    logs = work / "logs"
    logs.mkdir(exist_ok=True)
    rec = {**{k: e[k] for k in ("name", "layers", "seq", "gpus", "packing")}, "sets": list(e["sets"])}
    if not ensure_base(work, e["layers"], log):
        return {**rec, "rc": None, "error": f"base {base} not built"}
    if e.get("policy_from"):
        sweep = (done or {}).get(e["policy_from"])
        if not sweep or not sweep.get("phases"):
            log(f"{e['name']}: no sweep {e['policy_from']} to take the policy from")
            return {**rec, "rc": None, "error": f"no sweep {e['policy_from']}"}
        rec["policy"] = best_policy(sweep, e["seq"], _weights_gb(base))
        rec["sets"] += rec["policy"]["sets"]
        log(
            f"{e['name']}: policy {rec['policy']['phase'] and rec['policy']['phase']['name']}: {rec['policy']['sets']}"
        )
    cmd = [sys.executable, "-m", "pipeline", "train", CONFIG, "--name", e["name"], "--no-progress"]
    for item in train_sets(e, work, base, rec["sets"]):
        cmd += ["--set", item]
    sweep_out = out / f"{e['name']}-phases.jsonl"
    if e["overlay"]:
        cmd += ["--overlay", FSDP2, "--gpus", str(e["gpus"])]
    elif e["gpus"] > 1:  # pipeline train picks (or is told) DDP or FSDP2: pipeline.train.strategy
        cmd += ["--gpus", str(e["gpus"])] + (["--strategy", e["strategy"]] if e.get("strategy") else [])
    if e["kind"] == "packing_check":
        cmd = [
            sys.executable,
            "benchmarks/packing_check.py",
            "--base",
            str(base),
            "--out",
            str(out / f"{e['name']}.json"),
            "--row",
            str(e["seq"]),
            *[x for item in e["sets"] for x in ("--set", item)],
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
    if e.get("sweep"):
        env.update(RECOMPUTE_SWEEP=json.dumps(e["sweep"]), RECOMPUTE_SWEEP_OUT=str(sweep_out))
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
    if e.get("sweep") and sweep_out.exists():
        phases = [json.loads(x) for x in sweep_out.read_text().splitlines() if x.strip()]
        begin = rec.get("begin") or {}
        rec["phases"] = phase_metrics(phases, rec.get("steps", []), begin.get("base_params"), peak)
        for ph in rec["phases"]:
            log(
                f"  {ph['name']:24s} {ph.get('tokens_per_s')} tok/s  mfu {ph.get('mfu')}  peak {ph.get('peak_gb')} GB  {ph['layers']}"
            )
    if e["kind"] == "packing_check" and (out / f"{e['name']}.json").exists():
        rec["packing_check"] = {
            k: v
            for k, v in json.loads((out / f"{e['name']}.json").read_text()).items()
            if not isinstance(v, list)
        }
    if e.get("drop_base"):
        import shutil

        shutil.rmtree(base, ignore_errors=True)
    log(f"{e['name']}: rc={rc} {rec.get('summary')} ({rec['wall_s']} s)")
    return rec


KERNELS_OFF = ["lora_mlp_kernel=false", "lora_qkv_kernel=false", "lora_o_kernel=false"]
_FALLBACK = {"kernels_off": False}


def _failed_in_lora_kernels(work: Path, name: str) -> bool:
    log = work / "logs" / f"{name}.log"
    text = log.read_text(errors="replace") if log.exists() else ""
    return "Traceback" in text and ("axolotl/kernels/lora" in text or "lora_kernels" in text)


def _run_with_fallback(e: dict, work: Path, out: Path, peaks: dict, log, done: dict | None = None) -> dict:
    """Run; if axolotl's LoRA Triton kernels (auto-enabled on CUDA) break, rerun with them off and say so."""
    if _FALLBACK["kernels_off"] and e["kind"] == "train":
        e = {**e, "sets": e["sets"] + KERNELS_OFF}
    rec = _run_one(e, work, out, peaks, log, done)
    if rec.get("rc") not in (0, None) and e["kind"] == "train" and _failed_in_lora_kernels(work, e["name"]):
        _FALLBACK["kernels_off"] = True
        log(f"{e['name']}: axolotl's LoRA kernels failed; rerunning with them off")
        rec = {
            **_run_one({**e, "sets": e["sets"] + KERNELS_OFF}, work, out, peaks, log, done),
            "fallback": "lora_kernels_off",
        }
    return rec


def run_plan(
    plan: str,
    work: Path,
    out: Path,
    only: list[str] | None,
    deadline_s: float,
    policy_records: list[Path] = (),
) -> None:
    peaks = json.loads((work / "peaks.json").read_text()) if (work / "peaks.json").exists() else {}
    exps = [e for e in PLANS[plan] if not only or e["name"] in only]
    records = out / "records.jsonl"
    lock = threading.Lock()
    t_start = time.time()

    def log(msg):
        with lock:
            print(f"[{time.time() - t_start:6.0f}s] {msg}", flush=True)

    done: dict[str, dict] = {}
    for path in policy_records:  # an earlier call's sweep (call B takes call A's policy)
        for line in Path(path).read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                done[r["name"]] = r

    def worker(queue):
        for e in queue:
            left = deadline_s - (time.time() - t_start)
            if left <= 0:
                log(f"{e['name']}: skipped (deadline)")
                continue
            rec = _run_with_fallback(
                {**e, "timeout": min(e["timeout"], left + 60)}, work, out, peaks, log, done
            )
            done[e["name"]] = rec
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


ADAPTER_PAIRS = {  # (1-GPU run, multi-GPU run) whose adapters must have the same layout; 64-layer ones validated
    "call2": [("l8-s4096-ga2", "l8-s4096-fsdp2x2"), ("l64-s4096", "l64-s4096-fsdp2x2")],
    "ddp2": [("l64-s4096-1gpu-ga2", "l64-s4096-ddp-x2"), ("l64-s4096-1gpu-ga2", "l64-s4096-fsdp2-x2")],
}


def check_adapters(work: Path, out: Path, plan: str = "call2") -> dict:
    """1-GPU vs FSDP2 adapters: same tensor names, dtypes, shapes, adapter_config; and `pipeline validate`
    of the 64-layer adapters against the real-layout base and a 27B-shaped NVFP4 served index."""
    res: dict = {}
    runs = work / "runs"

    def adapter(name):
        c = [d / "adapter" for d in _run_dirs(runs, name) if (d / "adapter").is_dir()]
        return c[-1] if c else None

    pairs = ADAPTER_PAIRS[plan]
    for one, two in pairs:
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
    for name in dict.fromkeys(n for pair in pairs for n in pair if n.startswith("l64")):
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
                    # a run that exits 0 with a NaN or inf loss is no result
                    "ok": r["rc"] == 0 and all(math.isfinite(float(x["loss"])) for x in r.get("steps", [])),
                    "tokens_per_s": s.get("tokens_per_s"),
                    "trainable_tokens_per_s": s.get("trainable_tokens_per_s"),
                    "mfu": round(100 * s["mfu"], 2) if s.get("mfu") else None,
                    "peak_tflops": s.get("peak_tflops"),
                    "peak_gb": round(max(mem) * 2**30 / 1e9, 2) if mem else None,
                    "base_params": (r.get("begin") or {}).get("base_params"),
                    "sets": r["sets"],
                    "losses": [x["loss"] for x in r.get("steps", [])],
                    "grad_norms": [x["grad_norm"] for x in r.get("steps", [])],
                    **{k: r[k] for k in ("phases", "policy", "packing_check") if r.get(k)},
                }
            )
    return rows


def scaling(rows: list[dict], one: str = "l64-s4096-1gpu-ga2") -> list[dict]:
    """2-GPU runs vs the 1-GPU run of the same plan: scaling efficiency = tok/s(2) / (2 x tok/s(1)),
    and the largest relative per-step loss difference (same global batch, dropout off)."""
    by = {r["name"]: r for r in rows}
    ref = by.get(one)
    out = []
    for r in rows:
        if not ref or r["gpus"] < 2 or not r.get("tokens_per_s") or not ref.get("tokens_per_s"):
            continue
        n = min(len(r["losses"]), len(ref["losses"]))
        diffs = [abs(a - b) / abs(b) for a, b in zip(r["losses"][:n], ref["losses"][:n], strict=True) if b]
        out.append(
            {
                "name": r["name"],
                "scaling_efficiency": round(r["tokens_per_s"] / (r["gpus"] * ref["tokens_per_s"]), 4),
                "max_rel_loss_diff_vs_1gpu": (
                    (math.inf if any(not math.isfinite(d) for d in diffs) else max(diffs)) if diffs else None
                ),
                "steps_compared": n,
            }
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("data")
    d.add_argument("out", type=Path)
    d.add_argument("--tokenizer", type=Path, required=True)
    d.add_argument("--seqs", type=int, nargs="+", default=[4096, 16384])
    d.add_argument("--mix-median", type=int, default=900)
    d.add_argument("--mix-max", type=int, default=4000)
    d.add_argument("--mix-n", type=int, default=600)
    sm = sub.add_parser(
        "smoke", help="seconds, CPU: tiny data, every plan's train config checked (the suite's)"
    )
    sm.add_argument("--work", type=Path, required=True)
    sb = sub.add_parser("smoke-base", help="the tiny text-layout base at WORK/real4 (CPU smoke tests)")
    sb.add_argument("--work", type=Path, required=True)
    r = sub.add_parser("run")
    r.add_argument("plan", choices=sorted(PLANS))
    r.add_argument("--work", type=Path, required=True)
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--only", nargs="*")
    r.add_argument(
        "--deadline-s", type=float, default=1e9, help="start no experiment after this many seconds"
    )
    r.add_argument(
        "--policy-records", type=Path, nargs="*", default=[], help="records.jsonl of an earlier call"
    )
    sub.add_parser("peaks").add_argument("--work", type=Path, required=True)
    ad = sub.add_parser("adapters")
    ad.add_argument("--work", type=Path, required=True)
    ad.add_argument("--out", type=Path, required=True)
    ad.add_argument("--plan", choices=sorted(ADAPTER_PAIRS), default="call2")
    s = sub.add_parser("summary")
    s.add_argument("dirs", nargs="+", type=Path)
    s.add_argument("--json", type=Path)
    a = ap.parse_args()
    if a.cmd == "data":
        lengths = make_data(
            a.out, a.tokenizer, seqs=tuple(a.seqs), mix_median=a.mix_median, mix_max=a.mix_max, mix_n=a.mix_n
        )
        print(json.dumps({k: (min(v), max(v), len(v)) for k, v in lengths.items()}))
    elif a.cmd == "smoke":
        sys.exit(smoke(a.work))
    elif a.cmd == "smoke-base":  # the text-layout tiny base: the VL class needs torchvision for its processor
        from pipeline.dev.tinybase import build_tiny_base

        build_tiny_base(a.work / "real4")
        (a.work / "real4" / ".done").touch()
    elif a.cmd == "adapters":
        print(json.dumps(check_adapters(a.work, a.out, a.plan))[:3000])
    elif a.cmd == "peaks":
        print(json.dumps(measure_peaks(a.work)))
    elif a.cmd == "run":
        a.out.mkdir(parents=True, exist_ok=True)
        (a.work / "logs").mkdir(parents=True, exist_ok=True)
        run_plan(a.plan, a.work, a.out, a.only, a.deadline_s, a.policy_records)
    else:
        rows = summary(a.dirs)
        for sc in scaling(rows):
            next(r for r in rows if r["name"] == sc["name"])["scaling"] = sc
        if a.json:
            a.json.write_text(json.dumps(rows, indent=1) + "\n")
        for x in rows:
            print(
                f"{x['name']:28s} ok={x['ok']} tok/s={x['tokens_per_s']} mfu={x['mfu']} peak={x['peak_gb']}"
            )
            for ph in x.get("phases") or []:
                print(
                    f"    {ph['name']:24s} tok/s={ph.get('tokens_per_s')} mfu={ph.get('mfu')} peak={ph.get('peak_gb')} {ph['layers']}"
                )
            if x.get("policy"):
                print(f"    policy for seq {x['policy']['seq']}: {x['policy']['sets']}")
            if x.get("scaling"):
                print(f"    scaling {x['scaling']}")
            if x.get("packing_check"):
                pc = x["packing_check"]
                print(f"    packing check ok={pc.get('ok')} max rel loss diff {pc.get('max_rel_diff_pipeline')} "
                      f"(unpatched {pc.get('max_rel_diff_unpatched')}, logits {pc.get('max_logit_rel_l2_pipeline')} vs "
                      f"{pc.get('max_logit_rel_l2_unpatched')}) grads {pc.get('grads')}")  # fmt: skip


if __name__ == "__main__":
    main()
