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
