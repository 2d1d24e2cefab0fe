"""`peft_targets` decides exactly as peft's `check_target_module_exists` (peft is the reference here)."""

import itertools

import pytest

from pipeline.artifacts.peft_match import peft_targets

MODULES = [
    f"model.{p}layers.{i}.{sub}"
    for p in ("", "language_model.")
    for i in range(4)
    for sub in ("self_attn.q_proj", "mlp.down_proj", "linear_attn.in_proj_qkv", "mlp.up_proj")
] + ["lm_head", "model.embed_tokens", "model.layers.1.mlp.experts.0.down_proj"]
CONFIGS = [
    {"target_modules": ["q_proj", "down_proj"]},
    {"target_modules": ["q_proj"], "layers_to_transform": [0, 2]},
    {"target_modules": ["down_proj"], "layers_to_transform": 1},
    {"target_modules": ["down_proj"], "layers_to_transform": [1], "layers_pattern": "layers"},
    {"target_modules": ["down_proj"], "layers_to_transform": [1], "layers_pattern": ["h", "layers"]},
    {"target_modules": ["model.layers.3.mlp.up_proj"], "layers_to_transform": [0]},
    {"target_modules": ".*\\.(q_proj|up_proj)"},
    {"target_modules": ["q_proj", "up_proj"], "exclude_modules": ["up_proj"]},
    {"target_modules": ["q_proj", "up_proj"], "exclude_modules": ".*layers\\.0\\..*"},
    {"target_modules": ["down_proj"], "modules_to_save": ["experts"]},
    {"target_modules": None, "target_parameters": ["mlp.experts.down_proj"]},
    {"target_modules": ["lm_head", "embed_tokens"]},
]


@pytest.mark.parametrize("i", range(len(CONFIGS)))
def test_matches_peft(i):
    from peft import LoraConfig
    from peft.tuners.tuners_utils import check_target_module_exists

    raw = CONFIGS[i]
    kwargs = {k: v for k, v in raw.items() if v is not None}
    cfg = (
        LoraConfig(r=8, **kwargs)
        if raw.get("target_modules") is not None or "target_parameters" in raw
        else None
    )
    for module in MODULES:
        want = bool(check_target_module_exists(cfg, module)) and not type(
            check_target_module_exists(cfg, module)
        ).__name__.startswith("_Excluded")
        assert peft_targets(raw, module) == want, (raw, module)


def test_every_module_combination_is_covered():
    assert len(list(itertools.product(CONFIGS, MODULES))) > 400


def test_combinations_peft_refuses_are_config_problems():
    from pipeline.artifacts.adapter import config_problems

    for raw in (
        {"target_modules": ".*q_proj", "layers_to_transform": [0]},
        {"target_modules": ["q_proj"], "layers_pattern": "layers"},
    ):
        assert [p.kind for p in config_problems(raw)] == ["type"], raw
