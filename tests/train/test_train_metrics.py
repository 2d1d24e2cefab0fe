"""`pipeline.train.metrics.summarise`: tokens/s and MFU from a synthetic metrics.jsonl (CPU, no training)."""

from __future__ import annotations

import json

import pytest

from pipeline.train.metrics import PEAK_TFLOPS, peak_for, read_metrics, summarise

PARAMS = 26_895_998_464  # Qwen3.6-27B text model, counted by benchmarks/train_throughput.py


def _write(path, records, partial_tail=False):
    text = "".join(json.dumps(r) + "\n" for r in records)
    if partial_tail:
        text += '{"event": "log", "step": 9'  # a line the trainer is still writing
    path.write_text(text)
    return path


def _steps(t0, first_step, n, tok0=0, dt=2.0, tokens=4096, trainable=3072, **extra):
    return [
        {
            "event": "log",
            "step": first_step + i,
            "loss": 2.0 - 0.01 * i,
            "time": t0 + dt * i,
            "tokens/total": tok0 + tokens * (i + 1),
            "tokens/trainable": tok0 * 3 // 4 + trainable * (i + 1),
            **extra,
        }
        for i in range(n)
    ]


def begin(gpu="NVIDIA H200", world=1, params=PARAMS):
    return {
        "event": "begin",
        "max_steps": 10,
        "base_params": params,
        "world_size": world,
        "gpu": gpu,
        "time": 0,
    }


def test_tokens_per_s_and_mfu_from_file(tmp_path):
    recs = [begin(), *_steps(100.0, 1, 5)]
    out = summarise(read_metrics(_write(tmp_path / "metrics.jsonl", recs, partial_tail=True)))
    assert out["tokens_per_s"] == pytest.approx(2048.0)  # 4096 tokens every 2 s
    assert out["trainable_tokens_per_s"] == pytest.approx(1536.0)
    assert out["peak_tflops"] == PEAK_TFLOPS["H200"]
    assert out["mfu"] == pytest.approx(6 * PARAMS * 2048 / 989e12)
    assert out["train_loss"] == pytest.approx(1.96)
    assert out["steps"] == 5


def test_evaluation_time_is_not_training_time():
    logs = _steps(100.0, 1, 4)
    logs[2]["time"] += 30.0  # an evaluation ran between steps 2 and 3 ...
    logs[3]["time"] += 30.0
    ev = {"event": "log", "step": 2, "eval_loss": 1.5, "time": 125.0}
    out = summarise([begin(), *logs[:2], ev, *logs[2:]])
    assert out["tokens_per_s"] == pytest.approx(2048.0)  # ... and its 30 s gap is left out
    assert out["eval_loss"] == 1.5


def test_resume_gap_and_counter_reset_are_skipped():
    first = _steps(100.0, 1, 3)
    # resumed 10 minutes later; axolotl's counters restart from zero in the new process
    second = _steps(800.0, 4, 3, dt=4.0)
    out = summarise([begin(), *first, begin(), *second])
    # 2 gaps of 2 s (4096 tokens each) + 2 gaps of 4 s: 16384 tokens in 12 s
    assert out["tokens_per_s"] == pytest.approx(16384 / 12)
    assert out["steps"] == 6


def test_peak_override_world_size_and_memory():
    logs = _steps(0.0, 1, 3, **{"memory/max_allocated (GiB)": 55.5})
    logs[1]["memory/max_allocated (GiB)"] = 60.25
    out = summarise([begin(world=4), *logs], peak_tflops=790.0)
    assert out["peak_tflops"] == 790.0
    assert out["mfu"] == pytest.approx(6 * PARAMS * 2048 / (790e12 * 4))
    assert out["peak_mem_gib"] == 60.25


def test_unknown_gpu_or_no_token_counters_gives_no_mfu():
    out = summarise([begin(gpu="Some Future Accelerator"), *_steps(0.0, 1, 3)])
    assert "mfu" not in out and out["tokens_per_s"] == pytest.approx(2048.0)
    bare = [{"event": "log", "step": i, "loss": 1.0, "time": float(i)} for i in range(1, 4)]
    out = summarise([begin(), *bare])
    assert "tokens_per_s" not in out and "mfu" not in out and out["train_loss"] == 1.0


@pytest.mark.parametrize(
    ("name", "peak"),
    [
        ("NVIDIA H200", 989.0),
        ("NVIDIA H20", 148.0),
        ("NVIDIA GH200 480GB", 989.0),
        ("NVIDIA L40S", 362.0),
        ("NVIDIA L4", 121.0),
        ("Tesla T4", None),
        (None, None),
    ],
)
def test_peak_lookup_prefers_the_longest_name(name, peak):
    assert peak_for(name) == peak
