"""`pipeline dev real-base`: the exact Qwen3.6-27B geometry, in the real checkpoint layout."""

import json
from pathlib import Path

import pytest
from safetensors import safe_open
from typer.testing import CliRunner

from pipeline.dev.realbase import (
    QWEN36_27B_TEXT,
    build_real_base,
    layer_types,
    real_config,
    text_parameter_count,
)
from pipeline.errors import UsageError

# A small stand-in geometry for the file-writing tests (the 64-layer model is 54 GB); the real
# geometry itself is checked through the config and the meta-device parameter count.
SMALL_TEXT = dict(
    hidden_size=128,
    intermediate_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    vocab_size=2048,
)
SMALL_VISION = dict(depth=1, hidden_size=64, intermediate_size=128, num_heads=2)


def test_real_geometry_matches_the_published_model():
    cfg = real_config(64)
    t = cfg.text_config
    assert (t.hidden_size, t.intermediate_size, t.vocab_size) == (5120, 17408, 248320)
    assert (t.num_attention_heads, t.num_key_value_heads, t.head_dim) == (24, 4, 256)
    assert (t.linear_num_key_heads, t.linear_num_value_heads, t.linear_key_head_dim) == (16, 48, 128)
    assert t.layer_types[:4] == ["linear_attention"] * 3 + ["full_attention"]
    assert t.layer_types.count("full_attention") == 16 and not cfg.tie_word_embeddings
    assert cfg.vision_config.out_hidden_size == 5120
    assert layer_types(8) == (["linear_attention"] * 3 + ["full_attention"]) * 2
    # 26,895,998,464 text parameters at 64 layers (benchmarks/RESULTS.md, counted there on a full
    # meta-device model), ~26.9 B in docs/qwen3.6-27b.md
    assert text_parameter_count(64) == 26_895_998_464
    embed = (
        2 * QWEN36_27B_TEXT["vocab_size"] * QWEN36_27B_TEXT["hidden_size"] + QWEN36_27B_TEXT["hidden_size"]
    )
    assert (text_parameter_count(64) - embed) == 16 * (text_parameter_count(4) - embed)


def test_builds_the_real_layout(tmp_path):
    out = build_real_base(
        tmp_path / "b",
        4,
        text_overrides=SMALL_TEXT,
        vision_overrides=SMALL_VISION,
        shard_gb=0.002,
    )
    idx = json.loads((out / "model.safetensors.index.json").read_text())
    names = set(idx["weight_map"])
    shards = sorted(set(idx["weight_map"].values()))
    assert len(shards) > 1 and all((out / s).exists() for s in shards)
    assert "model.language_model.layers.0.linear_attn.in_proj_qkv.weight" in names
    assert "model.language_model.layers.3.self_attn.q_proj.weight" in names
    assert {"lm_head.weight", "model.language_model.embed_tokens.weight", "mtp.fc.weight"} <= names
    assert any(n.startswith("model.visual.") for n in names) and any(
        n.startswith("mtp.layers.0.") for n in names
    )
    assert not any(n.startswith("model.layers.") for n in names)
    total = 0
    for s in shards:
        with safe_open(str(out / s), "pt") as f:
            for k in f.keys():
                assert idx["weight_map"][k] == s
                t = f.get_tensor(k)
                total += t.numel() * t.element_size()
                if k.endswith("q_proj.weight"):  # gated attention: 2 x heads x head_dim
                    assert tuple(t.shape) == (2 * 4 * 64, 128) and str(t.dtype) == "torch.bfloat16"
    assert total == idx["metadata"]["total_size"]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3_5ForConditionalGeneration"] and cfg["model_type"] == "qwen3_5"
    assert cfg["text_config"]["mtp_num_hidden_layers"] == 1
    for f in ("tokenizer.json", "chat_template.jinja", "preprocessor_config.json", "generation_config.json"):
        assert (out / f).exists(), f
    # transformers loads it as the class the shipped config names, every weight from the files
    from transformers import Qwen3_5ForConditionalGeneration

    model, info = Qwen3_5ForConditionalGeneration.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"]


def test_bad_arguments(tmp_path):
    from pipeline.cli import app

    with pytest.raises(ValueError, match="layers"):
        real_config(0)
    with pytest.raises(ValueError, match=">= 4"):  # new-user finding: --layers 1 ended in StopIteration
        real_config(3)
    with pytest.raises(UsageError, match="not a directory"):
        build_real_base(Path("/dev/null"), 4)
    with pytest.raises(ValueError, match="shard_gb"):
        build_real_base(tmp_path / "x", 4, shard_gb=0)
    res = CliRunner().invoke(app, ["dev", "real-base", str(tmp_path / "y"), "--layers", "0"])
    assert res.exit_code == 2 and not (tmp_path / "y").exists()


def test_cuda_without_gpu_and_a_failed_build_leave_out_as_it_was(tmp_path, monkeypatch):
    """New-user finding: `--device cuda` on a CPU machine gave a traceback and a partial directory."""
    import torch

    from pipeline.dev import realbase
    from pipeline.errors import UsageError

    out = tmp_path / "base"
    out.mkdir()
    (out / "config.json").write_text("old")  # a checkpoint built before: replaced only when complete
    if not torch.cuda.is_available():
        with pytest.raises(UsageError, match="no CUDA GPU"):
            build_real_base(out, 4, device="cuda")
        assert (out / "config.json").read_text() == "old"

    def boom(dst, *a, **k):
        (dst / "model-00001-of-00002.safetensors").write_bytes(b"half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(realbase, "_write_real_base", boom)
    with pytest.raises(OSError, match="No space"):
        build_real_base(out, 4)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base"]
    assert [p.name for p in out.iterdir()] == ["config.json"]


def test_served_base_from_a_real_base(tmp_path):
    """`pipeline dev served-base` on an 8-layer real-layout build (6 Gated-DeltaNet + 2 full attention + MTP),
    the shape the GPU run quantizes at full width: modelopt on CPU here (tests/merge/test_quantize.py has the rest)."""
    pytest.importorskip("modelopt", reason="nvidia-modelopt is a dev dependency")
    from pipeline.artifacts.checkpoint import read_checkpoint
    from pipeline.cli import app

    src = build_real_base(
        tmp_path / "b", 8, text_overrides=SMALL_TEXT, vision_overrides=SMALL_VISION, shard_gb=0.004
    )
    out = tmp_path / "served"
    calib = tmp_path / "calib.jsonl"  # one short conversation keeps the test cheap
    calib.write_text(
        json.dumps({"messages": [{"role": "user", "content": "What is the weather in Tokyo?"}]}) + "\n"
    )
    args = ["--device", "cpu", "--shard-gb", "0.002", "--calib-data", str(calib), "--max-seq-len", "16"]
    r = CliRunner().invoke(app, ["dev", "served-base", str(src), str(out), *args])
    assert r.exit_code == 0, r.output
    ck = read_checkpoint(out)
    man = json.loads((out / "manifest.json").read_text())
    assert man["kind"] == "served-checkpoint" and man["quantization"]["mtp_tensors"] == 15
    assert (
        man["quantization"]["calibration"]["samples"] == 1
        and man["quantization"]["calibration"]["tokens"] <= 16
    )
    assert ck.config["architectures"] == ["Qwen3_5ForConditionalGeneration"] and ck.layout == "vl"
    packed = {m.rsplit(".", 1)[-1] for m, t in ck.modules.items() if t.dtype == "U8"}
    assert packed == {"q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "out_proj"} | {
        "gate_proj",
        "up_proj",
        "down_proj",
    }
    assert sum(1 for m in ck.modules if m.endswith("in_proj_qkv")) == 6
    assert not any(n.startswith("model.visual.") for n in ck.tensors)
    assert (out / "model.safetensors.index.json").is_file() and (out / "preprocessor_config.json").is_file()
