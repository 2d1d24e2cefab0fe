"""vLLM's rules by version range (docs/vllm.md): parsing release/nightly strings, each range's facts, refusals."""

import pytest

from pipeline.serving.modules import map_module, runtime_target
from pipeline.serving.versions import CAUSAL_CLASS, RANGES, VL_CLASS, UnknownVllmVersion, release, rules_for


@pytest.mark.parametrize(
    "version, name",
    [
        ("0.19.0", "0.19"),
        ("0.19.1", "0.19"),
        ("0.19.2rc1", "0.19"),
        ("0.19.2rc1.dev123+gabcdef1", "0.19"),  # the seed fleet's nightly: between 0.19.1 and 0.20.0
        ("0.20.0", "0.20"),
        ("0.20.0rc1.dev5+g1234", "0.20"),
        ("0.21.0", "0.21-0.26"),
        ("0.25.1", "0.21-0.26"),
        ("0.26.0", "0.21-0.26"),
        ("0.27.1", "0.27"),
        ("0.32.0", "0.32"),
        ("0.33.0", "0.33"),
        (" 0.33.1 ", "0.33"),
    ],
)
def test_versions_map_to_their_range(version, name):
    assert rules_for(version).name == name


@pytest.mark.parametrize("version", ["0.18.1", "0.28.0", "0.31.9", "0.34.0", "1.0.0", "0.9"])
def test_versions_outside_every_range_are_refused_never_treated_as_newest(version):
    with pytest.raises(
        UnknownVllmVersion, match="outside every version range.*--allow serving.version_unknown"
    ):
        rules_for(version)


@pytest.mark.parametrize("bad", ["nightly", "", "v0.19.x", "latest"])
def test_unparseable_versions_are_refused(bad):
    with pytest.raises(UnknownVllmVersion, match="does not parse"):
        rules_for(bad)


def test_release_pads_and_strips_pre_dev_local():
    assert release("0.19.2rc1.dev123+gabcdef") == (0, 19, 2)
    assert release("0.20") == (0, 20, 0)


def test_rule_table_per_range():
    r19, r20, r21, r33 = (rules_for(v) for v in ("0.19.1", "0.20.0", "0.22.0", "0.33.0"))
    # rank_pattern/alpha_pattern: ignored up to 0.25, honoured in 0.32+
    assert not r19.honours_patterns and not r21.honours_patterns and r33.honours_patterns
    # the CausalLM class only from 0.32; the VL class everywhere
    assert r19.qwen35_classes == r21.qwen35_classes == {VL_CLASS}
    assert r33.qwen35_classes == {VL_CLASS, CAUSAL_CLASS}
    # embedding LoRA, packed-aware --lora-target-modules (swap facts: tests/fleet/test_swap_rules.py)
    assert not r19.embedding_lora and r33.embedding_lora
    assert not r19.target_modules_packed_aware and r20.target_modules_packed_aware
    assert r19.fully_sharded_skips_in_proj_qkv and not r20.fully_sharded_skips_in_proj_qkv
    assert r19.nvfp4_gdn_scale_bug and not r20.nvfp4_gdn_scale_bug
    for r in RANGES:
        assert r.source and r.low < r.high
    assert all(a.high <= b.low for a, b in zip(RANGES, RANGES[1:], strict=False)), "ranges must not overlap"


@pytest.mark.parametrize(
    "module, arch, version, status",
    [
        (
            "model.layers.3.mlp.up_proj",
            VL_CLASS,
            "0.19.2",
            "ignored",
        ),  # upstream #48019: no model.layers. rule
        ("model.layers.3.mlp.up_proj", VL_CLASS, "0.33.0", "ignored"),
        ("model.language_model.layers.3.mlp.up_proj", VL_CLASS, "0.19.2", "applied"),
        ("model.layers.3.mlp.up_proj", CAUSAL_CLASS, "0.32.0", "applied"),
        ("model.language_model.layers.3.mlp.up_proj", CAUSAL_CLASS, "0.32.0", "applied"),
        ("mtp.layers.0.mlp.up_proj", VL_CLASS, "0.19.2", "ignored"),  # no mtp. rule before 0.32: no module
        ("mtp.layers.0.mlp.up_proj", VL_CLASS, "0.32.0", "dropped"),
        ("model.visual.blocks.0.attn.qkv", VL_CLASS, "0.19.2", "ignored"),
        ("lm_head", VL_CLASS, "0.19.2", "ignored"),  # no embedding LoRA on 0.19
        ("lm_head", VL_CLASS, "0.33.0", "applied"),
    ],
)
def test_runtime_target_follows_the_served_class_mapper(module, arch, version, status):
    assert runtime_target(module, arch, rules_for(version)).status == status


def test_vl_mapper_names():
    r32 = rules_for("0.32.0")
    assert map_module("model.language_model.layers.0.self_attn.q_proj", VL_CLASS, r32) == (
        "language_model.model.layers.0.self_attn.q_proj"
    )
    assert map_module("lm_head", VL_CLASS, r32) == "language_model.lm_head"
    assert map_module("mtp.fc", CAUSAL_CLASS, r32) is None


def test_causal_class_on_027_has_no_mapper():
    """0.27 registers Qwen3_5ForCausalLM without a hf_to_vllm_mapper (qwen3_5.py): only `model.layers.N` keys
    reach its decoder; the VL-layout keys load and change nothing."""
    r27 = rules_for("0.27.1")
    assert runtime_target("model.layers.3.mlp.up_proj", CAUSAL_CLASS, r27).status == "applied"
    assert runtime_target("model.language_model.layers.3.mlp.up_proj", CAUSAL_CLASS, r27).status == "ignored"
