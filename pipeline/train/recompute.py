"""Which decoder layers activation checkpointing recomputes, and the plugin's config keys.

Full recompute (`gradient_checkpointing: true`) does a third of a LoRA step's FLOPs twice; keeping
every layer's activations instead needs ~1 GB per layer and 4,096 tokens on Qwen3.6-27B
(benchmarks/RESULTS.md: 60 GB with recompute, 126 GB without). Two ways to spend memory left over:

- every k-th layer: transformers' own `gradient_checkpointing_kwargs: {every_n_layers: k}`
  (transformers >= 5.16: the Trainer pops it and checkpoints layers whose index % k == 0; 5.17 also
  takes `offload: true`, the checkpointed inputs in pinned host memory). Nothing to do here.
- by layer type: `pipeline_recompute_layer_types: [linear_attention]` recomputes only the listed
  decoder-layer types (`config.layer_types`: the 48 Gated-DeltaNet `linear_attention` and 16
  `full_attention` layers of Qwen3.6-27B); the others keep their activations. Applied by
  `apply_layer_types` after the Trainer enabled checkpointing (the plugin's callback, at train begin).

`PipelineArgs` is the pipeline plugin's input model: axolotl merges it into its config schema
(`BasePlugin.get_input_args`), so `pipeline train`'s schema check knows these keys.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

LAYER_TYPES = ("linear_attention", "full_attention")


class PipelineArgs(BaseModel):
    """Config keys of the pipeline's axolotl plugin (pipeline.train.axolotl_plugin.PipelinePlugin)."""

    pipeline_recompute_layer_types: list[Literal["linear_attention", "full_attention"]] | None = Field(
        default=None,
        json_schema_extra={
            "description": "with gradient_checkpointing: recompute only decoder layers of these types; "
            "the others keep their activations (pipeline.train.recompute)"
        },
    )
    pipeline_fla_gdn: bool | None = Field(
        default=None,
        json_schema_extra={
            "description": "on CUDA with flash-linear-attention: run every Gated-DeltaNet layer through the "
            "packing forward (fla's causal_conv1d and chunk rule, axolotl's fused LoRA projections), packed "
            "rows or not (pipeline.train.packing); default: packed rows only"
        },
    )


def layer_type(module) -> str | None:
    """A decoder layer's type from the model config's `layer_types` (transformers stores it as
    `block_type` on Qwen3.5 decoder layers, `layer_type` on others), or None."""
    t = getattr(module, "block_type", None) or getattr(module, "layer_type", None)
    return t if isinstance(t, str) else None


def checkpointed_layers(model) -> list:
    """The repeated decoder blocks gradient checkpointing acts on (transformers' GradientCheckpointingLayer)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def apply_layer_types(model, types) -> dict[str, int]:
    """Stop recomputing decoder layers whose type is not in `types`; returns
    {"recomputed": n, "kept": m} over the typed decoder layers (after the change).

    Layers transformers already leaves un-checkpointed (every_n_layers) stay so."""
    wanted = set(types)
    recomputed = kept = 0
    for m in checkpointed_layers(model):
        t = layer_type(m)
        if t is None:
            continue
        if m.gradient_checkpointing and t not in wanted:
            m.gradient_checkpointing = False
        if m.gradient_checkpointing:
            recomputed += 1
        else:
            kept += 1
    return {"recomputed": recomputed, "kept": kept}


def recompute_summary(model) -> dict[str, int]:
    """{"recomputed": n, "kept": m}: decoder layers with and without activation recompute now."""
    layers = [m for m in checkpointed_layers(model) if layer_type(m) is not None]
    n = sum(1 for m in layers if m.gradient_checkpointing)
    return {"recomputed": n, "kept": len(layers) - n}
