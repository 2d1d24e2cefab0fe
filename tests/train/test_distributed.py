"""Multi-GPU training goes through axolotl's own launchers with the shipped FSDP2 overlay.

A CPU run of the multi-process path is not possible with axolotl 0.19: with WORLD_SIZE > 1 it maps
each rank to CUDA device LOCAL_RANK (axolotl/utils/config/__init__.py) and FSDP2 calls
torch.cuda.set_device, so a two-process gloo run on this CPU-only machine fails inside axolotl
("Cannot access accelerator device" / "no attribute '_cuda_setDevice'"). What can be checked here
is the command we hand to axolotl and that axolotl's own schema accepts the merged config.
"""

import sys

from pipeline.train.config import load_training_config
from pipeline.train.launch import launcher_command
from tests.support.helpers import REPO


def test_launcher_commands(tmp_path):
    y = tmp_path / "resolved.yml"
    base = [sys.executable, "-m", "axolotl.cli.main", "train", str(y), "--launcher"]
    assert launcher_command(y) == [*base, "python"]
    assert launcher_command(y, gpus=2) == [*base, "accelerate", "--", "--num_processes", "2"]
    assert launcher_command(y, gpus=4, launcher="torchrun") == [
        *base,
        "torchrun",
        "--",
        "--nproc_per_node",
        "4",
    ]
    # the user's own launcher arguments win and pass through untouched
    cmd = launcher_command(y, gpus=2, launcher_args=["--num_processes=2", "--main_process_port", "29600"])
    assert cmd[-4:] == ["--", "--num_processes=2", "--main_process_port", "29600"]


def test_fsdp2_overlay_is_valid_for_axolotl():
    from axolotl.utils.config import validate_config
    from axolotl.utils.dict import DictDefault

    tc = load_training_config(
        REPO / "axolotl_configs/qwen3.6-27b-lora.yml",
        ["base_model_revision=abc123"],
        [REPO / "axolotl_configs/fsdp2.yml"],
    )
    assert tc.data["lora_r"] == 16 and tc.data["gradient_checkpointing"] is False
    cfg = validate_config(DictDefault(tc.data))
    assert cfg.fsdp_version == 2
    assert cfg.fsdp_config.transformer_layer_cls_to_wrap == "Qwen3_5DecoderLayer"
    assert cfg.fsdp_config.activation_checkpointing is True
    # the class named for wrapping exists in the installed transformers
    from transformers.models.qwen3_5 import modeling_qwen3_5

    assert hasattr(modeling_qwen3_5, "Qwen3_5DecoderLayer")


def test_fsdp2_checkpoint_wrapper_names_are_removed_from_the_adapter(tmp_path):
    """An FSDP2 run with activation checkpointing saved `..._checkpoint_wrapped_module._checkpoint_wrapped_module.
    linear_attn...` keys on 2 H200s (benchmarks/RESULTS.md); pipeline train writes the 1-GPU layout."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    from pipeline.train.wrapped_keys import normalise_adapter_keys

    p = tmp_path / "adapter_model.safetensors"
    plain = "base_model.model.model.language_model.layers.0.linear_attn.in_proj_qkv.lora_A.weight"
    wrapped = plain.replace("layers.0.", "layers.0._checkpoint_wrapped_module._checkpoint_wrapped_module.")
    other = "base_model.model.model.language_model.layers.3.self_attn.q_proj.lora_B.weight"
    save_file({wrapped: torch.ones(16, 64), other: torch.zeros(128, 16)}, str(p), metadata={"format": "pt"})
    assert normalise_adapter_keys(p) == 1
    with safe_open(str(p), "pt") as f:
        assert sorted(f.keys()) == sorted([plain, other]) and f.metadata() == {"format": "pt"}
        assert f.get_tensor(plain).shape == (16, 64)
    assert normalise_adapter_keys(p) == 0  # already in the 1-GPU layout: untouched


def test_cpu_ranks_load_on_the_cpu():
    """axolotl 0.19 maps every rank to CUDA device LOCAL_RANK, also without CUDA; the plugin maps them to the CPU."""
    import torch
    from axolotl.loaders.model import ModelLoader
    from axolotl.utils.dict import DictDefault

    from pipeline.train.axolotl_plugin import PipelinePlugin

    PipelinePlugin().register({})
    loader = ModelLoader.__new__(ModelLoader)  # only the device-map step, no model
    loader.cfg, loader.model_kwargs = DictDefault({"device_map": {"": 1}, "torch_dtype": torch.float32}), {}
    loader._set_device_map_config()
    assert loader.model_kwargs["device_map"] == ({"": 1} if torch.cuda.is_available() else {"": "cpu"})
