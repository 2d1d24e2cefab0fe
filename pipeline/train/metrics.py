"""Throughput and MFU of a training run from its `metrics.jsonl` (written by `pipeline.train.axolotl_plugin`).

Units: tokens/s, TFLOP/s (dense bf16), GiB for memory, seconds for times; MFU is a fraction.
"""

from __future__ import annotations

import json
from pathlib import Path

# Per-GPU dense bf16 peak (TFLOP/s, no sparsity) by device-name substring, from vendor datasheets;
# the longest matching key wins ("H20" vs "H200"). Override with train.peak_tflops, e.g. with a
# measured matmul rate: an H200 here ran 8192^3 bf16 products at 727-798 TFLOP/s, so MFU against
# the datasheet reads ~0.78x MFU against the measured rate (benchmarks/RESULTS.md).
# MFU = 6 x base parameters x tokens/s / (peak x GPUs).
PEAK_TFLOPS = {
    "H200": 989.0,
    "H100": 989.0,
    "GH200": 989.0,
    "H800": 989.0,
    "H20": 148.0,
    "B200": 2250.0,
    "B300": 2250.0,
    "A100": 312.0,
    "A800": 312.0,
    "L40S": 362.0,
    "L4": 121.0,
    "RTX PRO 6000": 504.0,
}


def read_metrics(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line being written
    return out


def peak_for(gpu: str | None) -> float | None:
    """Datasheet bf16 TFLOP/s for a CUDA device name (longest PEAK_TFLOPS key it contains), or None."""
    keys = [k for k in PEAK_TFLOPS if gpu and k in gpu]
    return PEAK_TFLOPS[max(keys, key=len)] if keys else None


def summarise(records: list[dict], peak_tflops: float | None = None) -> dict:
    """Final losses, throughput and MFU from the records of metrics.jsonl.

    Throughput counts training time only: the sum of gaps between consecutive training log
    records, leaving out gaps that contain an evaluation and gaps across a restart (a new `begin`
    record, e.g. after resuming: model loading is not training). Token counts are axolotl's
    cumulative `tokens/total` and `tokens/trainable` (all ranks). Keys written when derivable:
    train_loss, eval_loss, tokens_per_s, trainable_tokens_per_s, mfu (fraction of
    `peak_tflops` x world_size, default: PEAK_TFLOPS for the GPU named in `begin`), peak_tflops,
    peak_mem_gib (axolotl's `memory/max_allocated (GiB)`), train_runtime_s, steps.
    """
    out: dict = {}
    segment, seg_of = 0, []
    for r in records:  # which training session (one per `begin`) each record belongs to
        segment += r.get("event") == "begin"
        seg_of.append(segment)
    logs = [(s, r) for s, r in zip(seg_of, records, strict=True) if r.get("event") == "log"]
    begins = [r for r in records if r.get("event") == "begin"]
    begin = begins[-1] if begins else {}
    train = [(s, r) for s, r in logs if "loss" in r]
    evals = [r for _, r in logs if "eval_loss" in r]
    if train:
        out["train_loss"] = train[-1][1]["loss"]
    if evals:
        out["eval_loss"] = evals[-1]["eval_loss"]
    dt_s = dtok = dtrain = 0.0
    has_trainable = True
    tok = [(s, r) for s, r in train if "tokens/total" in r]
    for (sa, a), (sb, b) in zip(tok, tok[1:], strict=False):
        if sa != sb or any(a["time"] < e["time"] < b["time"] for e in evals):
            continue
        if b["tokens/total"] < a["tokens/total"]:  # counters reset: not a training gap
            continue
        dt_s += b["time"] - a["time"]
        dtok += b["tokens/total"] - a["tokens/total"]
        if "tokens/trainable" in a and "tokens/trainable" in b:
            dtrain += b["tokens/trainable"] - a["tokens/trainable"]
        else:
            has_trainable = False
    if dt_s > 0 and dtok > 0:
        out["tokens_per_s"] = dtok / dt_s
        if has_trainable:
            out["trainable_tokens_per_s"] = dtrain / dt_s
    final = next((r for _, r in reversed(logs) if "train_runtime" in r), None)
    if final:
        out["train_runtime_s"] = final["train_runtime"]
    mem = [r["memory/max_allocated (GiB)"] for _, r in logs if "memory/max_allocated (GiB)" in r]
    if mem:
        out["peak_mem_gib"] = max(mem)
    world = begin.get("world_size") or 1
    peak = peak_tflops or peak_for(begin.get("gpu"))
    if peak:
        out["peak_tflops"] = peak
    if peak and begin.get("base_params") and out.get("tokens_per_s"):
        out["mfu"] = 6 * begin["base_params"] * out["tokens_per_s"] / (peak * 1e12 * world)
    out["steps"] = max((r.get("step", 0) for _, r in logs), default=0)
    return out
