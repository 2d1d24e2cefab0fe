"""`pipeline dev trained-base` at tiny sizes on CPU: the real layout, a corpus with its digest, and figures."""

import json
import sysconfig
from pathlib import Path

import pytest
from safetensors import safe_open

from pipeline.dev.corpus import collect
from pipeline.dev.trainedbase import MTP_SHARD, REPORT, build_trained_base, geometry
from pipeline.errors import UsageError

SITE = Path(sysconfig.get_paths()["purelib"])


def test_corpus_is_installed_text_with_a_digest_and_a_heldout_split():
    a = collect([SITE / "typer"], max_bytes=400_000)
    b = collect([SITE / "typer"], max_bytes=400_000)
    assert a.sha256 == b.sha256 and len(a.sha256) == 64  # same installation, same corpus
    assert a.train and a.heldout and not set(a.train) & set(a.heldout)
    assert a.bytes == sum(len(t.encode()) for t in a.train + a.heldout)
    with pytest.raises(UsageError, match="not a directory"):
        collect([SITE / "no-such-package"])


def test_geometry_keeps_the_families_proportions():
    g = geometry(1024, 8192)
    assert (g["num_attention_heads"], g["num_key_value_heads"], g["head_dim"]) == (8, 2, 128)
    assert g["linear_num_value_heads"] == 3 * g["linear_num_key_heads"] and g["linear_key_head_dim"] == 128
    with pytest.raises(ValueError, match="multiple of 64"):
        geometry(100, 512)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("tb") / "base"
    rep = build_trained_base(
        out, layers=4, hidden=64, minutes=10, max_steps=3, device="cpu", corpus_roots=[SITE / "rich"], corpus_mb=0.6,
        vocab_size=400, seq_len=64, batch=4, lr=3e-3, mtp_len=32, eval_windows=4, greedy_prompts=1,
        prompt_len=8, new_tokens=6,
    )  # fmt: skip
    return out, rep


def test_writes_the_fleets_layout_with_an_mtp_layer(built):
    out, rep = built
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    text = cfg["text_config"]
    assert text["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert text["mtp_num_hidden_layers"] == 1 and text["vocab_size"] == rep["tokenizer"]["vocab"]
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert any(k.startswith("model.language_model.layers.0.linear_attn.") for k in index)
    assert any(k.startswith("model.language_model.layers.3.self_attn.") for k in index)
    mtp = {k for k, f in index.items() if f == MTP_SHARD}
    assert "mtp.fc.weight" in mtp and "mtp.layers.0.self_attn.q_proj.weight" in mtp
    assert all(k.startswith("mtp.") for k in mtp)
    with safe_open(str(out / MTP_SHARD), "pt") as f:
        assert f.get_tensor("mtp.fc.weight").shape == (64, 128)
    assert (out / "tokenizer.json").is_file() and "<|im_start|>" in (out / "chat_template.jinja").read_text()
    assert json.loads((out / REPORT).read_text())["corpus"]["sha256"] == rep["corpus"]["sha256"]


def test_training_learns_and_reports_mtp_figures(built):
    _, rep = built
    assert rep["training"]["steps"] == 3
    assert rep["heldout_ppl"] < rep["heldout_ppl_initial"]  # it learnt something of the held-out text
    for key in ("mtp_heldout_text", "mtp_greedy"):
        fig = rep[key]
        assert len(fig["agreement"]) == len(fig["acceptance"]) == 3
        assert fig["acceptance_length"] == pytest.approx(1 + sum(fig["acceptance"]), abs=1e-3)


def test_refuses_bad_geometry_before_writing(tmp_path):
    with pytest.raises(UsageError, match="multiple of 4"):
        build_trained_base(tmp_path / "x", layers=6, device="cpu")
    assert not (tmp_path / "x").exists()
