"""Preflight before axolotl: packing on Gated-DeltaNet models, materialised-logits memory."""

import json

import pytest

from pipeline.dev.realbase import real_config
from pipeline.train.config import load_training_config
from pipeline.train.preflight import (
    Gpu,
    detect_gpus,
    fused_loss_active,
    logits_memory_problem,
    model_family,
    packing_problems,
    varlen_gdn_missing,
)
from tests.support.helpers import REPO

PROD = REPO / "axolotl_configs" / "qwen3.6-27b-lora.yml"
H200 = Gpu("NVIDIA H200", 143771 * 2**20)
H100 = Gpu("NVIDIA H100 80GB HBM3", 81559 * 2**20)
A100 = Gpu("NVIDIA A100-SXM4-80GB", 81920 * 2**20)


@pytest.fixture()
def base27b(tmp_path):
    """config.json + index of the real 64-layer geometry (no weights: the checks read metadata only)."""
    d = tmp_path / "base"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(real_config(64).to_dict()))
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 53_800_000_000}}))
    return d


def test_family_from_config_or_class(base27b, tmp_path):
    assert model_family(load_training_config(PROD, [f"base_model={base27b}"])) == "qwen3_5"
    assert model_family(load_training_config(PROD)) == "qwen3_5"  # hub id: from model_type class name
    other = tmp_path / "llama"
    other.mkdir()
    (other / "config.json").write_text('{"model_type": "llama"}')
    tc = load_training_config(PROD, [f"base_model={other}", "sample_packing=true"])
    assert packing_problems(tc, []) == []


def test_packing_refused_without_the_varlen_path(base27b):
    tc = load_training_config(PROD, [f"base_model={base27b}", "sample_packing=true"])
    # this machine has no GPU: axolotl applies its cu_seqlens patch only on CUDA, fla is GPU-only
    (msg,) = packing_problems(tc, [])
    assert "sample_packing" in msg and "a CUDA GPU" in msg and "leaks" in msg
    # eval packing alone is never patched by axolotl
    tc = load_training_config(PROD, [f"base_model={base27b}", "eval_sample_packing=true"])
    assert any("eval_sample_packing: false" in m for m in packing_problems(tc, [A100]))
    assert packing_problems(load_training_config(PROD, [f"base_model={base27b}"]), []) == []


def test_packing_allowed_when_the_varlen_path_is_installed(base27b):
    # fla (installed with axolotl 0.19) and axolotl's qwen3_5 packing patch are on disk here
    assert varlen_gdn_missing("qwen3_5", [A100]) == []
    assert varlen_gdn_missing("qwen3_5", [H200], triton="3.7.1") == []
    tc = load_training_config(
        PROD, [f"base_model={base27b}", "sample_packing=true", "eval_sample_packing=false"]
    )
    assert packing_problems(tc, [A100]) == []


def test_packing_refused_on_hopper_with_old_triton():
    # measured wrong on an H200 with Triton 3.6 (benchmarks/RESULTS.md)
    (msg,) = varlen_gdn_missing("qwen3_5", [H200], triton="3.6.0")
    assert "Triton >= 3.7.1" in msg and "NVIDIA H200" in msg


def test_logits_memory(base27b):
    unfused = load_training_config(PROD, [f"base_model={base27b}", "liger_fused_linear_cross_entropy=false"])
    assert fused_loss_active(load_training_config(PROD)) and not fused_loss_active(unfused)
    msg = logits_memory_problem(unfused, [H100])  # 54 GB weights + ~41 GB logits at 16384 > 85 GB
    assert msg and "liger_fused_linear_cross_entropy: true" in msg and "sequence_len to <=" in msg
    assert logits_memory_problem(unfused, [H200]) is None  # ~95 GB fits 151 GB
    assert logits_memory_problem(load_training_config(PROD, [f"base_model={base27b}"]), [H100]) is None
    assert logits_memory_problem(unfused, []) is None  # no GPU detected: nothing to compare with
    short = load_training_config(
        PROD, [f"base_model={base27b}", "liger_fused_linear_cross_entropy=false", "sequence_len=4096"]
    )
    assert logits_memory_problem(short, [H100]) is None


def test_detect_gpus_without_nvidia_smi(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    assert detect_gpus() == []


def test_pipeline_train_refuses_packing_before_writing(project, tiny_base, tmp_path):
    from typer.testing import CliRunner

    from pipeline.cli import app

    res = CliRunner().invoke(
        app,
        [
            "train",
            str(REPO / "axolotl_configs/tiny-cpu.yml"),
            "--set",
            f"base_model={tiny_base}",
            "--set",
            "sample_packing=true",
            "--no-progress",
        ],
    )
    assert res.exit_code == 1, res.output
    assert "sample_packing on a Gated-DeltaNet model (qwen3_5_text)" in res.output
    assert not project.train.runs_dir.exists() or not any(project.train.runs_dir.iterdir())
