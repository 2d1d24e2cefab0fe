"""Several GPUs (pipeline.train.strategy): DDP when the replicated base fits, else FSDP2, and why."""

from __future__ import annotations

import json

import pytest
import yaml

from pipeline.dev.realbase import real_config
from pipeline.train.config import load_training_config
from pipeline.train.launch import training_setup
from pipeline.train.preflight import Gpu
from pipeline.train.strategy import FSDP2_SETTINGS, apply_choice, choose, replicated_bytes
from tests.support.helpers import REPO

PROD = REPO / "axolotl_configs" / "qwen3.6-27b-lora.yml"
H200 = Gpu("NVIDIA H200", 143771 * 2**20)
H100 = Gpu("NVIDIA H100 80GB HBM3", 81559 * 2**20)
A100_40 = Gpu("NVIDIA A100-SXM4-40GB", 40960 * 2**20)


@pytest.fixture()
def base27b(tmp_path):
    d = tmp_path / "base"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(real_config(64).to_dict()))
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 53_800_000_000}}))
    return d


@pytest.mark.parametrize(
    "sets, measured_gb",
    [  # the shipped config's peaks on one H200 (benchmarks/RESULTS.md)
        (["sequence_len=4096"], 60.1),
        (["sequence_len=16384"], 72.2),
        (["sequence_len=4096", "gradient_checkpointing=false"], 126.1),
    ],
)
def test_estimate_reproduces_the_measured_peaks(base27b, sets, measured_gb):
    est = replicated_bytes(load_training_config(PROD, [f"base_model={base27b}", *sets])) / 1e9
    assert abs(est - measured_gb) / measured_gb < 0.05, est


def test_choice_and_reason(base27b):
    tc = load_training_config(PROD, [f"base_model={base27b}", "sequence_len=4096"])
    c = choose(tc, [H200, H200])
    assert c.strategy == "ddp" and "fits each GPU" in c.reason and "NVIDIA H200" in c.reason
    c = choose(tc, [A100_40, A100_40])
    assert c.strategy == "fsdp2" and "does not fit" in c.reason
    assert choose(tc, [A100_40], "ddp").strategy == "ddp"  # the override wins, the estimate is still said
    assert "--strategy ddp" in choose(tc, [A100_40], "ddp").reason
    assert choose(tc, [H200], "fsdp2").strategy == "fsdp2"
    over = load_training_config(PROD, [f"base_model={base27b}"], [REPO / "axolotl_configs" / "fsdp2.yml"])
    assert choose(over, [H200]).strategy == "fsdp2"  # the config's own FSDP settings
    assert choose(tc, []).strategy == "ddp"  # CPU processes (gloo)
    assert choose(load_training_config(PROD), [H200]).strategy == "fsdp2"  # a hub id: size unknown


def test_what_each_strategy_sets(base27b):
    over = yaml.safe_load((REPO / "axolotl_configs" / "fsdp2.yml").read_text())
    assert FSDP2_SETTINGS == over  # the overlay users pass and what --strategy fsdp2 applies agree
    tc = load_training_config(PROD, [f"base_model={base27b}"], [REPO / "axolotl_configs" / "fsdp2.yml"])
    ddp = apply_choice(tc.data, choose(tc, [H200], "ddp"))
    assert (
        not any(k in ddp for k in ("fsdp_version", "fsdp_config"))
        and ddp["ddp_find_unused_parameters"] is False
    )
    plain = load_training_config(PROD, [f"base_model={base27b}"])
    fsdp = apply_choice(plain.data, choose(plain, [A100_40]))
    assert fsdp["fsdp_version"] == 2 and fsdp["gradient_checkpointing"] is False


def test_gpus_option_applies_and_records_the_choice(base27b):
    tc, plan = training_setup(PROD, [f"base_model={base27b}"], gpus=2, visible=[H200, H200])
    assert (plan.launcher, plan.world, plan.choice.strategy) == ("accelerate", 2, "ddp")
    assert tc.data["ddp_find_unused_parameters"] is False
    assert plan.choice.to_dict()["ddp_per_gpu_gb"] == pytest.approx(72, abs=4)  # seq 16384
    tc, plan = training_setup(PROD, [f"base_model={base27b}"], gpus=2, strategy="fsdp2", visible=[H200, H200])
    assert plan.choice.strategy == "fsdp2" and tc.data["fsdp_version"] == 2
    _, one = training_setup(PROD, [f"base_model={base27b}"], visible=[H200])
    assert one.choice is None and one.world == 1
