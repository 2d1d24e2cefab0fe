"""Preflight before axolotl: packing on Gated-DeltaNet models, materialised-logits memory."""

import json
import shutil

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


def test_packing_allowed_where_the_exact_patch_runs(base27b):
    """pipeline.train.packing covers qwen3_5 (text and VL) and qwen3_5_moe: on CPU through its torch
    reference, on a GPU through fla's varlen kernels (installed here with axolotl 0.19)."""
    for flag in ("sample_packing", "eval_sample_packing"):
        tc = load_training_config(PROD, [f"base_model={base27b}", f"{flag}=true"])
        assert packing_problems(tc, []) == []
        assert packing_problems(tc, [A100]) == []
    assert varlen_gdn_missing("qwen3_5_text", []) == []
    assert varlen_gdn_missing("qwen3_5_moe", [H200], triton="3.7.1") == []
    assert varlen_gdn_missing("qwen3_5", [H200], triton="3.6.0", tilelang=True) == []


def test_packing_refused_where_it_cannot_be_exact(base27b, tmp_path, monkeypatch):
    # a family the patch does not cover: qwen3_next (its fused in_proj_qkvz layer)
    nxt = tmp_path / "next"
    nxt.mkdir()
    (nxt / "config.json").write_text('{"model_type": "qwen3_next"}')
    (msg,) = packing_problems(load_training_config(PROD, [f"base_model={nxt}", "sample_packing=true"]), [])
    assert "qwen3_next" in msg and "pipeline/train/packing.py" in msg and "leaks" in msg
    # Hopper with Triton < 3.7.1 and no tilelang: fla refuses its backward there
    (msg,) = varlen_gdn_missing("qwen3_5", [H200], triton="3.6.0", tilelang=False)
    assert "Triton >= 3.7.1 or tilelang" in msg and "NVIDIA H200" in msg
    # a GPU host without fla's varlen kernels
    import pipeline.train.preflight as pf

    monkeypatch.setattr(pf, "_package_dir", lambda name: None)
    tc = load_training_config(PROD, [f"base_model={base27b}", "eval_sample_packing=true"])
    (msg,) = packing_problems(tc, [A100])
    assert "eval_sample_packing" in msg and "flash-linear-attention" in msg
    assert packing_problems(tc, []) == []  # CPU: the torch reference needs no fla


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


def test_pipeline_train_refuses_packing_before_writing(project, tmp_path):
    from typer.testing import CliRunner

    from pipeline.cli import app

    base = tmp_path / "next"
    base.mkdir()
    (base / "config.json").write_text('{"model_type": "qwen3_next"}')
    res = CliRunner().invoke(
        app,
        [
            "train",
            str(REPO / "axolotl_configs/tiny-cpu.yml"),
            "--set",
            f"base_model={base}",
            "--set",
            "sample_packing=true",
            "--no-progress",
        ],
    )
    assert res.exit_code == 1, res.output
    assert "sample_packing on a Gated-DeltaNet model (qwen3_next)" in res.output
    assert not project.train.runs_dir.exists() or not any(project.train.runs_dir.iterdir())


@pytest.mark.parametrize(
    "layout", ["modules/causal_conv1d/__init__.py", "modules/convolution.py", "modules/conv/__init__.py"]
)
def test_fla_varlen_kernels_found_in_every_layout(tmp_path, monkeypatch, layout):
    """fla 0.6.0 moved the conv to fla/modules/causal_conv1d/ (0.4.1-0.5.x: convolution.py): the
    first preflight missed it on the H200 and refused a run fla could serve."""
    import pipeline.train.preflight as pf

    fla = tmp_path / "fla"
    (fla / "ops" / "gated_delta_rule").mkdir(parents=True)
    (fla / layout).parent.mkdir(parents=True, exist_ok=True)
    (fla / layout).write_text("")
    monkeypatch.setattr(pf, "_package_dir", lambda name: fla if name == "fla" else None)
    assert pf._fla_varlen_installed() and varlen_gdn_missing("qwen3_5", [A100]) == []
    shutil.rmtree(fla / "modules")
    assert (
        not pf._fla_varlen_installed()
        and "flash-linear-attention" in varlen_gdn_missing("qwen3_5", [A100])[0]
    )
