"""Where an adapter key lands inside vLLM's model: the served class's weight mapper, per vLLM version.

vLLM renames each adapter module (the key without `base_model.model.` and `.lora_A.weight`) with the
served class's `hf_to_vllm_mapper` (vllm/lora/utils.py `parse_fine_tuned_lora_name` ->
`WeightsMapper._map_name`: every matching `orig_to_new_prefix` entry in order, None drops the key),
then looks the name up among the model's LoRA-wrapped modules. A name that matches no module loads
with HTTP 200 and is never applied (only a debug log). The mappers are fields of the version table
(`VllmRange.mappers`, vllm/model_executor/models/qwen3_5.py, qwen3_vl.py; docs/vllm.md):
- `Qwen3_5ForConditionalGeneration` (the real Qwen3.6 checkpoint): `model.visual.` -> `visual.`,
  `lm_head.` -> `language_model.lm_head.`, `model.language_model.` -> `language_model.model.`
  (0.32+: `mtp.` dropped); no rule for `model.layers.` (upstream vllm#48019, PR #48022);
- `Qwen3_5ForCausalLM` (registered from 0.27): no mapper on 0.27 (only `model.layers.N` reaches the
  decoder), `model.language_model.` -> `model.` and `mtp.` dropped from 0.32.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.serving.versions import CAUSAL_CLASS, VL_CLASS, VllmRange

# Decoder layers inside vLLM's model, and the adapter prefix that reaches them (the served layout).
DECODER_PREFIX = {VL_CLASS: "language_model.model.layers.", CAUSAL_CLASS: "model.layers."}
SERVED_KEY_PREFIX = {VL_CLASS: "model.language_model.layers.", CAUSAL_CLASS: "model.layers."}
EMBEDDING_NAMES = {
    VL_CLASS: {"language_model.model.embed_tokens", "language_model.lm_head"},
    CAUSAL_CLASS: {"model.embed_tokens", "lm_head"},
}


@dataclass(frozen=True)
class RuntimeTarget:
    """What the served vLLM does with one adapter module.

    status: "applied" (a decoder-layer or embedding module), "ignored" (loads, never applied),
    "dropped" (the mapper removes the key: never applied). `runtime` is vLLM's module name.
    """

    status: str
    runtime: str | None
    reason: str = ""


def map_module(peft_module: str, architecture: str, rng: VllmRange) -> str | None:
    """vLLM's name for an adapter module under `architecture`'s mapper on `rng` (None: dropped by the mapper)."""
    name = peft_module + "."
    for prefix, new in dict(rng.mappers).get(architecture, ()):
        if name.startswith(prefix):
            if new is None:
                return None
            name = new + name[len(prefix) :]
    return name[:-1]


def runtime_target(peft_module: str, architecture: str, rng: VllmRange) -> RuntimeTarget:
    """Where `peft_module` (e.g. `model.layers.3.mlp.up_proj`) lands when `architecture` is served on `rng`."""
    mapped = map_module(peft_module, architecture, rng)
    if mapped is None:
        return RuntimeTarget("dropped", None, f"{architecture}'s weight mapper drops it")
    if mapped.startswith(DECODER_PREFIX[architecture]):
        return RuntimeTarget("applied", mapped)
    if mapped in EMBEDDING_NAMES[architecture]:
        if rng.embedding_lora:
            return RuntimeTarget("applied", mapped)
        return RuntimeTarget("ignored", mapped, f"vLLM {rng.name} has no embedding LoRA for Qwen3.5")
    if mapped.startswith("visual.") or mapped.startswith("mtp."):
        return RuntimeTarget("ignored", mapped, "vision-tower and MTP LoRA are accepted and never applied")
    return RuntimeTarget(
        "ignored",
        mapped,
        f"no module {mapped!r} in {architecture} (its decoder layers are {DECODER_PREFIX[architecture]}N)",
    )


def served_key_prefix(architecture: str) -> str | None:
    """The adapter key prefix of decoder layers that `architecture` applies (None: not a Qwen3.5 class)."""
    return SERVED_KEY_PREFIX.get(architecture)


def serving_class(architecture: str | None, rng: VllmRange, model_type: str | None = None) -> str | None:
    """The class that serves the adapter: the served checkpoint's `architecture` when known, else, for a Qwen3.5
    base (`model_type` qwen3_5...), the one class `rng` registers for qwen3_5 when it registers one (0.19-0.26:
    `Qwen3_5ForConditionalGeneration` whatever the checkpoint says: model_executor/models/registry.py); None
    when it cannot be known (0.27+ register both classes)."""
    if architecture is not None:
        return architecture
    if not str(model_type or "").startswith("qwen3_5") or len(rng.qwen35_classes) != 1:
        return None
    return next(iter(rng.qwen35_classes))
