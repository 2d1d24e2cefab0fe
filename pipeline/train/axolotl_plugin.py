"""axolotl plugin loaded inside the trainer process (`plugins: [pipeline.train.axolotl_plugin.PipelinePlugin]`).

It adds one TrainerCallback that appends JSON lines to `$PIPELINE_METRICS_FILE` on the main
process: `begin` (max_steps, base parameter count), every `log` (step, loss, eval_loss,
learning_rate, grad_norm, axolotl's token counters, wall time), and `end`. The parent
`pipeline train` tails the file for its progress bar and for tokens/s and MFU.

Before the model loads it also gives `Qwen3_5ForConditionalGeneration` (the class the shipped
Qwen3.6-27B config loads) the fused linear cross-entropy that axolotl's Liger integration applies
to `Qwen3_5ForCausalLM` only, when the config sets `liger_fused_linear_cross_entropy: true`
(pipeline.train.fused_loss): the 248,320-wide logits are never materialised.

With `sample_packing` or `eval_sample_packing` on a Qwen3.5-family model it patches the
Gated-DeltaNet, decoder and text-model forwards so that packed samples stay independent
(pipeline.train.packing: conv window and recurrent state reset at every boundary, positions
restart per sample, full attention isolated). It runs after axolotl's own patches (axolotl calls
plugins' `pre_model_load` after its patch manager), so it replaces axolotl's packing forward.
"""

from __future__ import annotations

import json
import os
import time

from axolotl.integrations.base import BasePlugin
from transformers import TrainerCallback

from pipeline.train import packing
from pipeline.train.fused_loss import patch_vl_fused_cross_entropy
from pipeline.train.recompute import apply_layer_types, recompute_summary

METRICS_ENV = "PIPELINE_METRICS_FILE"


class MetricsFileCallback(TrainerCallback):
    def __init__(self, path: str, model=None):
        self.path = path
        self.params = None
        if model is not None:
            # Frozen base parameters a text token goes through: what forward + backward cost is
            # proportional to (6N/token). The vision tower of a VL class does not run on text.
            self.params = sum(
                p.numel() for n, p in model.named_parameters() if "lora_" not in n and "visual." not in n
            )

    def _write(self, state, record: dict) -> None:
        if not state.is_world_process_zero:
            return
        record.setdefault("time", time.time())
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")

    def on_train_begin(self, args, state, control, **kwargs):
        import torch

        world = int(os.environ.get("WORLD_SIZE", "1"))
        gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
        self._write(
            state,
            {
                "event": "begin",
                "max_steps": state.max_steps,
                "base_params": self.params,
                "world_size": world,
                "gpu": gpu,
                "recompute": recompute_summary(kwargs["model"]) if kwargs.get("model") is not None else None,
            },
        )

    def on_log(self, args, state, control, logs=None, **kwargs):
        rec = {"event": "log", "step": state.global_step, "max_steps": state.max_steps, "epoch": state.epoch}
        for k, v in (logs or {}).items():
            if isinstance(v, (int, float)):
                rec[k] = v
        self._write(state, rec)

    def on_train_end(self, args, state, control, **kwargs):
        self._write(state, {"event": "end", "step": state.global_step})


class RecomputeCallback(TrainerCallback):
    """Recompute only the listed decoder-layer types (pipeline.train.recompute); the Trainer has
    enabled checkpointing on every layer (or every k-th) by the time `on_train_begin` runs."""

    def __init__(self, types):
        self.types = list(types)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is not None and args.gradient_checkpointing:
            counts = apply_layer_types(model, self.types)
            print(f"pipeline: recomputing {counts['recomputed']} decoder layers ({', '.join(self.types)}), "
                  f"keeping the activations of {counts['kept']}", flush=True)  # fmt: skip


# axolotl model_config_type values whose loaded class is Qwen3_5ForConditionalGeneration
VL_FUSED_CE_TYPES = ("qwen3_5",)


def place_cpu_ranks_on_cpu() -> None:
    """Let the ranks of a multi-process run without CUDA (gloo, e.g. the CPU tests of multi-node
    launches) load the model on the CPU: axolotl 0.19 maps every rank to CUDA device LOCAL_RANK
    (`axolotl/utils/config/__init__.py` normalize_config: `device_map = {"": LOCAL_RANK}` whenever
    world_size != 1), and transformers then fails ("Cannot access accelerator device when none is
    available"). Patches `ModelLoader._set_device_map_config` once; a no-op when CUDA is available."""
    import torch
    from axolotl.loaders.model import ModelLoader

    original = ModelLoader._set_device_map_config
    if getattr(original, "__pipeline__", False):
        return

    def _set_device_map_config(self):
        original(self)
        dm = self.model_kwargs.get("device_map")
        if (
            not torch.cuda.is_available()
            and isinstance(dm, dict)
            and all(isinstance(v, int) for v in dm.values())
        ):
            self.model_kwargs["device_map"] = {"": "cpu"}

    _set_device_map_config.__pipeline__ = True
    ModelLoader._set_device_map_config = _set_device_map_config


class PipelinePlugin(BasePlugin):
    """Registers MetricsFileCallback when `$PIPELINE_METRICS_FILE` is set; fused CE for the Qwen3.5 VL class;
    exact packing for the Qwen3.5 family."""

    def register(self, cfg):
        place_cpu_ranks_on_cpu()

    def get_input_args(self) -> str:
        return "pipeline.train.recompute.PipelineArgs"

    def pre_model_load(self, cfg):
        packed = cfg.sample_packing or cfg.eval_sample_packing
        if (packed or cfg.pipeline_fla_gdn) and cfg.model_config_type in packing.FAMILIES:
            packing.apply(cfg.model_config_type)
            packing.route_all_rows(bool(cfg.pipeline_fla_gdn))
            import torch

            kernels = packing.kernels_for("cuda" if torch.cuda.is_available() else "cpu")
            print(
                f"pipeline: exact sample packing for {cfg.model_config_type} (conv and recurrent state reset "
                f"at every packed-sample boundary, {kernels} kernels"
                f"{'; every row through this path' if cfg.pipeline_fla_gdn else ''}; pipeline.train.packing)",
                flush=True,
            )
        if cfg.liger_fused_linear_cross_entropy and cfg.model_config_type in VL_FUSED_CE_TYPES:
            patch_vl_fused_cross_entropy()
            print(
                "pipeline: fused linear cross-entropy applied to Qwen3_5ForConditionalGeneration "
                "(logits are not materialised when labels are given)",
                flush=True,
            )

    def add_callbacks_pre_trainer(self, cfg, model):
        out = []
        if cfg.gradient_checkpointing and cfg.pipeline_recompute_layer_types is not None:
            out.append(RecomputeCallback(cfg.pipeline_recompute_layer_types))
        path = os.environ.get(METRICS_ENV)
        if path:
            out.append(MetricsFileCallback(path, model))
        return out
