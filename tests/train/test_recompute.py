"""Partial activation recompute (pipeline.train.recompute): which layers are recomputed, same gradients."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pipeline.train.config import load_training_config
from pipeline.train.recompute import apply_layer_types, recompute_summary
from tests.support.helpers import REPO

TINY = REPO / "axolotl_configs" / "tiny-cpu.yml"


@pytest.fixture()
def model(tiny_base):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(tiny_base), dtype=torch.float32)
    m.config.use_cache = False
    return m.train()


def _grads(model, ids):
    model.zero_grad()
    model(input_ids=ids, labels=ids).loss.backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


def test_layer_types_and_every_n(model):
    # tiny base: layer_types [linear x3, full]
    model.gradient_checkpointing_enable({"use_reentrant": False})
    assert recompute_summary(model) == {"recomputed": 4, "kept": 0}
    assert apply_layer_types(model, ["full_attention"]) == {"recomputed": 1, "kept": 3}
    # transformers' every_n_layers first (layers 0 and 2), then the type filter keeps it
    model.gradient_checkpointing_enable({"use_reentrant": False}, every_n_layers=2)
    assert recompute_summary(model) == {"recomputed": 2, "kept": 2}
    assert apply_layer_types(model, ["linear_attention"]) == {"recomputed": 2, "kept": 2}
    assert apply_layer_types(model, ["full_attention"]) == {"recomputed": 0, "kept": 4}


def test_partial_recompute_gives_the_same_gradients(model):
    from pipeline.train.axolotl_plugin import RecomputeCallback

    ids = torch.randint(10, 1000, (1, 48), generator=torch.Generator().manual_seed(0))
    model.gradient_checkpointing_disable()
    want = _grads(model, ids)
    model.gradient_checkpointing_enable({"use_reentrant": False})
    RecomputeCallback(["linear_attention"]).on_train_begin(
        SimpleNamespace(gradient_checkpointing=True), None, None, model=model
    )
    assert recompute_summary(model) == {"recomputed": 3, "kept": 1}
    assert torch.allclose(_grads(model, ids), want, rtol=1e-5, atol=1e-7)


def test_the_keys_are_in_axolotls_schema(tmp_path):
    """The plugin's input model is merged into axolotl's: the keys pass, a typo and a bad value do not."""
    from pipeline.errors import CheckFailed
    from pipeline.train.schema import check_axolotl_schema

    base = [f"base_model={tmp_path}", "gradient_checkpointing=true"]
    check_axolotl_schema(
        load_training_config(TINY, [*base, "pipeline_recompute_layer_types=[linear_attention]"])
    )
    check_axolotl_schema(
        load_training_config(
            TINY, [*base, "gradient_checkpointing_kwargs={use_reentrant: true, every_n_layers: 2}"]
        )
    )
    with pytest.raises(CheckFailed, match="did you mean `pipeline_recompute_layer_types`"):
        check_axolotl_schema(
            load_training_config(TINY, [*base, "pipeline_recompute_layer_type=[linear_attention]"])
        )
    with pytest.raises(CheckFailed, match="pipeline_recompute_layer_types"):
        check_axolotl_schema(load_training_config(TINY, [*base, "pipeline_recompute_layer_types=[mlp]"]))


def test_benchmark_picks_the_fastest_policy_that_fits_at_16384():
    """benchmarks/axolotl_h200.py best_policy: peaks scaled from the 4096 sweep to 16384 (static =
    weights + 2.3 GB), the fastest under 79 GB wins, and its config overrides are the run's."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("axolotl_h200", REPO / "benchmarks" / "axolotl_h200.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    phases = [
        {"name": "warmup", "every_n_layers": 1, "mfu": 30.0, "peak_gb": 60.1},
        {"name": "full", "every_n_layers": 1, "mfu": 47.7, "peak_gb": 60.1},  # 16384: ~72 GB
        {"name": "every_2", "every_n_layers": 2, "mfu": 56.0, "peak_gb": 93.0},  # 16384: ~205 GB
        {
            "name": "linear_only",
            "every_n_layers": 1,
            "types": ["linear_attention"],
            "fla_gdn": True,
            "mfu": 49.0,
            "peak_gb": 61.0,
        },
    ]
    pick = bench.best_policy({"seq": 4096, "phases": phases}, 16384, 53.8)
    assert pick["phase"]["name"] == "linear_only" and pick["phase"]["est_peak_gb_at_seq"] < 79
    assert pick["sets"] == [
        "gradient_checkpointing=true",
        "gradient_checkpointing_kwargs={use_reentrant: true}",
        "pipeline_recompute_layer_types=[linear_attention]",
        "pipeline_fla_gdn=true",
    ]
    assert (
        bench.best_policy({"seq": 4096, "phases": phases}, 4096, 53.8, limit_gb=141)["phase"]["name"]
        == "every_2"
    )
    assert bench.policy_sets({"every_n_layers": 0}) == ["gradient_checkpointing=false"]
    assert bench.policy_sets({"every_n_layers": 2, "offload": True})[1] == (
        "gradient_checkpointing_kwargs={use_reentrant: true, every_n_layers: 2, offload: true}"
    )
