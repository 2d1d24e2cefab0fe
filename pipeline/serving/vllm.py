"""vLLM's LoRA rules, in vLLM's own names, each with its source: the one place the pipeline keeps them.

Training-config checks, adapter validation, the canary and the fleet all ask this module what
the serving engine accepts. Sources are paths in the vLLM package (https://github.com/vllm-project/vllm,
`vllm/...` at the fleet's tag); facts and versions are collected in docs/vllm.md.
"""

from __future__ import annotations

import math

from pipeline.serving.versions import VllmRange

# vLLM returns a log-probability of -inf as -9999.0 (JSON has no -inf): `clamp_prompt_logprobs` in
# vllm/entrypoints/openai/generate/base/serving.py (0.25.1; the same in 0.32). Below this, no value.
LOGPROB_CLAMP_FLOOR = -9000.0


def usable_logprob(v: float | None) -> bool:
    """A log-probability that carries a value: a finite number above vLLM's -9999.0 clamp of -inf."""
    return v is not None and math.isfinite(v) and v > LOGPROB_CLAMP_FLOOR


# `--max-lora-rank` values vLLM accepts (vllm/config/lora.py, MaxLoRARanks).
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)

# adapter_config.json fields whose features vLLM refuses (vllm/lora/peft_helper.py PEFTHelper._validate_features,
# every version read; 0.19-0.27 drop lora_bias, layer_replication and the inits silently, 0.32+ refuse them: the
# fleet must not depend on what a version ignores): (check id suffix, field, feature). `config_checks` generates
# one rule per entry.
REFUSED_CONFIG_KEYS: tuple[tuple[str, str, str], ...] = (
    ("dora", "use_dora", "DoRA"),
    ("modules_to_save", "modules_to_save", "modules_to_save (full copies of modules)"),
    ("lora_bias", "lora_bias", "LoRA bias terms"),
    ("layer_replication", "layer_replication", "layer_replication"),
    ("alora", "alora_invocation_tokens", "aLoRA (activated LoRA)"),
    ("qalora", "use_qalora", "QALoRA"),
    ("bdlora", "use_bdlora", "block-diagonal LoRA (BD-LoRA)"),
)

# Linear modules vLLM can apply LoRA to in Qwen3.5 / Qwen3.6 (vllm/model_executor/models/qwen3_5.py
# packed_modules_mapping + supported_lora_modules), by decoder layer type.
QWEN35_MODULES = {
    "full_attention": {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"},
    "linear_attention": {
        "linear_attn.in_proj_qkv",
        "linear_attn.in_proj_z",
        "linear_attn.in_proj_b",
        "linear_attn.in_proj_a",
        "linear_attn.out_proj",
    },
    "any": {"mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"},
}
# Embedding-type modules (vLLM `embedding_modules`; other architectures name them wte/embedding):
# a hot-loading fleet does not serve LoRA on them unless it opts in (fleet.allow_embedding_targets).
EMBEDDING_MODULES = {"embed_tokens", "lm_head", "embedding", "wte"}
# Tensors vLLM skips when it loads an adapter (vllm/lora/utils.py `is_base_embedding_weights`, every version read):
# the copies of the base embedding / lm_head that peft's save_pretrained writes whenever embed_tokens or lm_head is
# targeted (`save_embedding_layers="auto"`, peft/utils/save_and_load.py).
BASE_EMBEDDING_SUFFIXES = (".embed_tokens.base_layer.weight", ".lm_head.base_layer.weight")
# safetensors dtypes of LoRA weights vLLM loads (bf16/fp16/fp32).
ALLOWED_DTYPES = {"BF16", "F16", "F32"}
# Quantization algorithms of served checkpoints whose packed shapes the pipeline can unpack.
KNOWN_QUANT = {
    "NVFP4",
    "FP8",
    "MIXED_PRECISION",
    "NVFP4_AWQ",
    "W4A8_AWQ",
    "INT4_AWQ",
    "MODELOPT",
    "FP8_PB_WO",
    "COMPRESSED-TENSORS",
}


def runtime_module(short: str, rng: VllmRange) -> str:
    """The name of the vLLM module that adapter module `short` (`q_proj`, ...) is applied through on `rng`:
    its packed parent (`qkv_proj`) or itself (`o_proj`; `in_proj_z` on 0.19, where LoRA splits the fused
    in_proj_qkvz). Source: the served class's packed_modules_mapping (`VllmRange.packed`)."""
    return next((parent for parent, kids in rng.packed if short in kids and parent != short), short)


def fleet_applies(short: str, targets: list[str] | None, rng: VllmRange) -> bool:
    """Whether vLLM's `--lora-target-modules` lets an adapter module (`q_proj`, ...) through on `rng`.

    vllm/lora/utils.py `is_in_target_modules` is asked about vLLM's runtime module (`runtime_module`):
    it passes when its own name is listed; from 0.20 (`target_modules_packed_aware`) also when one of a
    packed module's children is listed (listing `q_proj` opens `qkv_proj`, so `k_proj` is applied too) or
    when the module is a child of a listed packed parent. On 0.19 only runtime names count: PEFT names
    `q_proj`, `gate_proj`, `in_proj_b` open nothing.
    """
    if targets is None:
        return True
    t = set(targets)
    runtime = runtime_module(short, rng)
    if runtime in t:
        return True
    if not rng.target_modules_packed_aware:
        return False
    packed = dict(rng.packed)
    if t & set(packed.get(runtime, ())):
        return True
    return any(runtime in kids and parent in t for parent, kids in rng.packed)
