"""The served-checkpoint builder through nvidia-modelopt, on CPU: layout, config, index, exclusions, MTP kept.

modelopt's NVFP4 max calibration and its HF export run on CPU for the tiny base (calibration only
observes ranges; packing is plain torch); only a forward pass *through* fake-quantized layers
needs CUDA (the Triton / CUDA-extension kernels), and nothing here runs one. Serving the export
needs vLLM on a GPU (scripts/gpu, benchmarks/vllm_h200.py).
"""

from __future__ import annotations

import json

import pytest

from pipeline.artifacts.checkpoint import canonical_module, logical_linear_shape, read_checkpoint
from pipeline.errors import UsageError
from tests.merge.test_merge import tensor_bytes

pytest.importorskip("modelopt", reason="nvidia-modelopt is a dev dependency (pyproject.toml)")

NVFP4 = {"q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "out_proj"}
NVFP4 |= {"gate_proj", "up_proj", "down_proj"}
BF16_LINEARS = {"in_proj_a", "in_proj_b"}


@pytest.fixture(scope="module")
def export(tiny_vl_base, tmp_path_factory):
    """One modelopt export of the tiny VL base, sharded small so that the index is exercised (~10 s)."""
    from pipeline.merge.quantize import quantize_checkpoint

    out = tmp_path_factory.mktemp("nvfp4") / "served"
    record = quantize_checkpoint(tiny_vl_base, out, device="cpu", max_shard_size="300KB")
    return out, record


def test_served_layout_config_and_index(export):
    out, record = export
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3_5ForConditionalGeneration"]  # vLLM 0.19-0.25 serve only this class
    assert cfg["quantization_config"]["quant_method"] == "modelopt"
    assert cfg["quantization_config"]["quant_algo"] == "NVFP4"
    assert cfg["text_config"]["mtp_num_hidden_layers"] == 1
    hq = json.loads((out / "hf_quant_config.json").read_text())
    assert hq["producer"] == {"name": "modelopt", "version": record["version"]}
    assert hq["quantization"]["quant_algo"] == "NVFP4" and hq["quantization"]["group_size"] == 16
    assert sorted(cfg["quantization_config"]["ignore"]) == sorted(hq["quantization"]["exclude_modules"])
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 1 and sorted(set(index["weight_map"].values())) == shards
    ck = read_checkpoint(out)
    assert set(index["weight_map"]) == set(ck.tensors)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in ck.tensors.values())
    assert ck.layout == "vl" and not any("visual" in n for n in ck.tensors)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (out / f).is_file()
    assert record["calibration"]["samples"] == 8 and record["calibration"]["tokens"] > 0


def test_exclusions_match_the_fleet_recipe(export, tiny_vl_base):
    """NVFP4 on every decoder linear but in_proj_a/b; bf16 for lm_head, embeddings, conv1d, mtp.*."""
    out, record = export
    ck, base = read_checkpoint(out), read_checkpoint(tiny_vl_base)
    seen = set()
    for name, info in ck.tensors.items():
        cm = canonical_module(name)
        if not cm or not cm[0].startswith("layers."):
            continue
        sub = cm[0].rsplit(".", 1)[-1]
        if sub in NVFP4 and cm[1] == ".weight":
            seen.add(sub)
            out_f, in_f = base.modules[cm[0]].shape
            assert info.dtype == "U8" and tuple(info.shape) == (out_f, in_f // 2), name
            stem = name[: -len(".weight")]
            assert ck.tensors[stem + ".weight_scale"].dtype == "F8_E4M3"
            assert tuple(ck.tensors[stem + ".weight_scale"].shape) == (out_f, in_f // 16)
            assert ck.tensors[stem + ".weight_scale_2"].dtype == "F32"
            assert ck.tensors[stem + ".input_scale"].dtype == "F32"
            assert logical_linear_shape(ck, cm[0]) == (out_f, in_f)
        if sub in BF16_LINEARS or sub == "conv1d":
            assert info.dtype == "BF16", name
    assert seen == NVFP4
    for name in ("lm_head.weight", "model.language_model.embed_tokens.weight"):
        assert ck.tensors[name].dtype == "BF16"
    excl = record["exclude_modules"]
    assert "mtp*" in excl and "lm_head" in excl
    assert {e.rsplit(".", 1)[-1] for e in excl if ".layers." in e} == {"conv1d", "in_proj_a", "in_proj_b"}


def test_mtp_tensors_are_the_source_bytes(export, tiny_vl_base):
    out, record = export
    src = {k: v for k, v in tensor_bytes(tiny_vl_base).items() if k.startswith("mtp.")}
    got = {k: v for k, v in tensor_bytes(out).items() if k.startswith("mtp.")}
    assert len(src) == 15 and got == src and record["mtp_tensors"] == 15
    assert all(t.dtype == "BF16" for n, t in read_checkpoint(out).tensors.items() if n.startswith("mtp."))


def test_packed_weights_dequantize_to_the_source(export, tiny_vl_base):
    """The export is a quantisation of *these* weights: e2m1 codes x block scale x global scale ~ source."""
    import torch
    from safetensors import safe_open

    from pipeline.dev.tinybase import E2M1_GRID

    out, _ = export
    name = "model.language_model.layers.0.mlp.gate_proj"
    ck, base = read_checkpoint(out), read_checkpoint(tiny_vl_base)

    def get(ckpt, tensor):
        with safe_open(str(ckpt.path / ckpt.tensors[tensor].file), framework="pt") as f:
            return f.get_tensor(tensor)

    packed, scale, scale2 = (get(ck, name + s) for s in (".weight", ".weight_scale", ".weight_scale_2"))
    w = get(base, name + ".weight").float()
    codes = torch.stack([packed & 0xF, packed >> 4], -1).reshape(w.shape).long()
    mag = torch.tensor(E2M1_GRID)[codes & 7] * torch.where(codes >= 8, -1.0, 1.0)
    deq = mag.reshape(w.shape[0], -1, 16) * (scale.float() * scale2.float()).unsqueeze(-1)
    err = (deq.reshape(w.shape) - w).abs()
    block_amax = (
        w.reshape(w.shape[0], -1, 16).abs().amax(-1, keepdim=True).expand(-1, -1, 16).reshape(w.shape)
    )
    # e2m1's widest gap is 4 -> 6: at most a third of the block max (plus FP8 rounding of the scale)
    assert bool((err <= block_amax / 3 * 1.1 + 1e-6).all())
    assert err.mean() < 0.1 * w.abs().mean()


def test_export_passes_validate_served(export, tiny_base, tiny_vl_base, tmp_path):
    """What the builder writes is what `validate --served` accepts: no served.* error for a tiny adapter."""
    from pipeline.validate import FleetRules, validate_adapter
    from tests.support.helpers import peft_adapter

    out, _ = export
    adapter = peft_adapter(tiny_base, tmp_path / "a", r=8, alpha=16)
    rep = validate_adapter(adapter, tiny_vl_base, FleetRules(vllm_version="0.25.1"), served_dir=out)
    served = [c for c in rep.checks if c.id.startswith("served.")]
    assert not [c for c in served if c.severity == "error"], [(c.id, c.message) for c in served]
    assert rep.stats["served"]["quant_algo"] == "NVFP4"


def test_fixture_writer_matches_modelopt(export, tiny_vl_base, tmp_path):
    """`build_tiny_served` (the fast fixture of the validate tests) writes modelopt's format for each module."""
    from pipeline.dev.tinybase import build_tiny_served

    out, _ = export
    fixture = read_checkpoint(build_tiny_served(tiny_vl_base, tmp_path / "fixture"))
    real = read_checkpoint(out)

    def by_module(ck):
        d = {}
        for name, info in ck.tensors.items():
            cm = canonical_module(name)
            key = cm if cm else (name.replace("model.language_model.", "model."), "")
            d[key] = (info.dtype, tuple(info.shape))
        return d

    assert by_module(fixture) == by_module(real)
    fq = json.loads((fixture.path / "hf_quant_config.json").read_text())["quantization"]
    rq = json.loads((out / "hf_quant_config.json").read_text())["quantization"]
    assert set(fq) == set(rq) and (fq["quant_algo"], fq["group_size"]) == (rq["quant_algo"], rq["group_size"])


def test_bad_input_is_refused_before_writing(export, tiny_vl_base, tmp_path, monkeypatch):
    from pipeline.merge import quantize

    out, _ = export
    with pytest.raises(UsageError, match="already quantized"):
        quantize.quantize_checkpoint(out, tmp_path / "x", device="cpu")
    with pytest.raises(UsageError, match="supported formats"):
        quantize.quantize_checkpoint(tiny_vl_base, tmp_path / "x", fmt="fp8")
    with pytest.raises(UsageError, match="no config.json"):
        quantize.quantize_checkpoint(tmp_path, tmp_path / "x", device="cpu")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "f").write_text("x")
    with pytest.raises(UsageError, match="not empty"):
        quantize.quantize_checkpoint(tiny_vl_base, tmp_path / "full", device="cpu")
    bad = tmp_path / "calib.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n{"text": "no messages"}\n')
    with pytest.raises(UsageError, match=r"calib.jsonl:2: no \"messages\""):
        quantize.load_calibration(bad)
    from importlib import metadata

    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", missing)
    with pytest.raises(UsageError, match="nvidia-modelopt is not installed"):
        quantize.quantize_checkpoint(tiny_vl_base, tmp_path / "y", device="cpu")
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_gdn_scale_warning_reads_the_real_export(export, tiny_base, tiny_vl_base, tmp_path):
    """modelopt's export lists `linear_attn.conv1d` / `in_proj_a` as excluded while `in_proj_qkv` is NVFP4:
    the 0.19 scale-bug warning must fire on it (it read "a pattern mentions linear_attn" as excluded)."""
    from pipeline.validate import FleetRules, validate_adapter
    from tests.support.helpers import peft_adapter

    out, _ = export
    adapter = peft_adapter(tiny_base, tmp_path / "a", r=8, alpha=16, targets=["in_proj_qkv", "q_proj"])
    old = validate_adapter(adapter, tiny_vl_base, FleetRules(vllm_version="0.19.1"), served_dir=out)
    assert "served.nvfp4_gdn_scales" in {c.id for c in old.checks}
    new = validate_adapter(adapter, tiny_vl_base, FleetRules(vllm_version="0.25.1"), served_dir=out)
    assert "served.nvfp4_gdn_scales" not in {c.id for c in new.checks}


@pytest.fixture(scope="module")
def vl_adapter(tiny_base, tmp_path_factory):
    from tests.merge.test_merge import rekey_adapter, to_vl
    from tests.support.helpers import peft_adapter

    plain = peft_adapter(tiny_base, tmp_path_factory.mktemp("qa") / "plain", r=8, alpha=16)
    return rekey_adapter(plain, tmp_path_factory.mktemp("qa") / "vl", to_vl)


def test_merge_quantize_nvfp4(tiny_vl_base, vl_adapter, tmp_path):
    """`pipeline merge --quantize nvfp4`: the served layout of the *merged* weights, manifest provenance, MTP kept."""
    import torch
    from safetensors.torch import load_file
    from typer.testing import CliRunner

    from pipeline.artifacts.manifest import MergedManifest, read_manifest, verify_files
    from pipeline.cli import app
    from pipeline.dev.tinybase import E2M1_GRID

    out = tmp_path / "merged-nvfp4"
    r = CliRunner().invoke(
        app, ["merge", str(vl_adapter), "--base", str(tiny_vl_base), "--out", str(out), "--quantize", "nvfp4"]
    )
    assert r.exit_code == 0, r.output
    assert "engine-side parity pending" in r.output
    m = read_manifest(out)
    assert isinstance(m, MergedManifest) and m.format == "nvfp4" and m.requantization is None
    q = m.quantization
    assert q.tool == "nvidia-modelopt" and q.version == "0.47.0" and q.config == "NVFP4_DEFAULT_CFG"
    assert q.extra_disabled == ["*mtp*", "*visual*"] and q.calibration["samples"] == 8
    assert m.adapter.path == str(vl_adapter.resolve()) and m.base.fingerprint
    assert m.merge.merged_modules == m.merge.lora_pairs > 0
    assert m.served_parity.status == "pending" and not verify_files(out, m.files)
    assert not [p for p in tmp_path.iterdir() if p.name != out.name]  # no bf16 scratch, no partial left
    src = {k: v for k, v in tensor_bytes(tiny_vl_base).items() if k.startswith("mtp.")}
    assert {k: v for k, v in tensor_bytes(out).items() if k.startswith("mtp.")} == src
    # the packed weights are the merged ones (W + scale * B @ A), not the base's
    name = "model.language_model.layers.3.self_attn.q_proj"
    t = {}
    for f in out.glob("*.safetensors"):
        t.update({k: v for k, v in load_file(str(f)).items() if k.startswith(name)})
    base = {}
    for f in tiny_vl_base.glob("*.safetensors"):
        base.update({k: v for k, v in load_file(str(f)).items() if k.startswith(name)})
    lora = load_file(str(vl_adapter / "adapter_model.safetensors"))
    key = "base_model.model." + name
    w = base[name + ".weight"].float()
    merged = w + 2.0 * lora[key + ".lora_B.weight"].float() @ lora[key + ".lora_A.weight"].float()
    codes = torch.stack([t[name + ".weight"] & 0xF, t[name + ".weight"] >> 4], -1).reshape(w.shape).long()
    mag = torch.tensor(E2M1_GRID)[codes & 7] * torch.where(codes >= 8, -1.0, 1.0)
    scale = t[name + ".weight_scale"].float() * t[name + ".weight_scale_2"].float()
    deq = (mag.reshape(w.shape[0], -1, 16) * scale.unsqueeze(-1)).reshape(w.shape)
    assert (deq - merged).abs().mean() < 0.8 * (deq - w).abs().mean()
    # and `validate --served` reads it as a served checkpoint of this base (geometry, modules, shapes)
    from pipeline.validate import FleetRules, validate_adapter

    # vLLM 0.25.1, the GPU fleet's version (0.19.x refuses NVFP4 linear_attn: served.nvfp4_gdn_scales)
    rep = validate_adapter(vl_adapter, tiny_vl_base, FleetRules(vllm_version="0.25.1"), served_dir=out)
    served = [c for c in rep.checks if c.id.startswith("served.") and c.severity == "error"]
    assert not served, [(c.id, c.message) for c in served]
    assert rep.stats["served"]["quant_algo"] == "NVFP4" and rep.stats["served"]["layout"] == "vl"


def test_merge_quantize_failure_leaves_nothing(tiny_vl_base, vl_adapter, tmp_path, monkeypatch):
    import pipeline.merge as merge_pkg

    def boom(*a, **k):
        raise RuntimeError("export failed")

    monkeypatch.setattr(merge_pkg, "quantize_checkpoint", boom)
    with pytest.raises(RuntimeError, match="export failed"):
        merge_pkg.merge_and_quantize(vl_adapter, tiny_vl_base, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(UsageError, match="quantizes the bf16 merge"):
        from pipeline.cli.merge import Dtype, Quantize, merge

        merge(vl_adapter, tiny_vl_base, tmp_path / "o2", dtype=Dtype.float32, quantize=Quantize.nvfp4)
