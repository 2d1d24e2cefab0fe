"""vLLM's LoRA rules, in vLLM's own names, each with its source: the one place the pipeline keeps them.

Training-config checks, adapter validation, the canary and the fleet all ask this module what
the serving engine accepts. Sources are paths in the vLLM package (https://github.com/vllm-project/vllm,
`vllm/...` at the fleet's tag); facts and versions are collected in docs/vllm.md.
"""

from __future__ import annotations

# `--max-lora-rank` values vLLM accepts (vllm/config/lora.py, MaxLoRARanks).
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)

# adapter_config.json keys whose features vLLM refuses (vllm/lora/peft_helper.py, PEFTHelper._validate_features).
REFUSED_CONFIG_KEYS = {
    "use_dora": "DoRA",
    "lora_bias": "LoRA bias terms",
    "layer_replication": "layer_replication",
    "modules_to_save": "modules_to_save",
    "use_bdlora": "block-diagonal LoRA",
    "use_qalora": "QALoRA",
}

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
# Packed runtime modules of Qwen3.5 in vLLM (qwen3_5.py packed_modules_mapping).
PACKED_MODULES = {
    "qkv_proj": ["q_proj", "k_proj", "v_proj"],
    "gate_up_proj": ["gate_proj", "up_proj"],
    "in_proj_qkvz": ["in_proj_qkv", "in_proj_z"],
    "in_proj_ba": ["in_proj_b", "in_proj_a"],
}
# Embedding-type modules (vLLM `embedding_modules`; other architectures name them wte/embedding):
# a hot-loading fleet does not serve LoRA on them unless it opts in (fleet.allow_embedding_targets).
EMBEDDING_MODULES = {"embed_tokens", "lm_head", "embedding", "wte"}
# safetensors dtypes of LoRA weights vLLM loads (bf16/fp16/fp32).
ALLOWED_DTYPES = {"BF16", "F16", "F32"}
# init_lora_weights strings that only set the initial adapter (vllm/lora/peft_helper.py _init_is_supported).
PLAIN_INITS = {"gaussian", "eva", "orthogonal", "mica", "lora_ga"}
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


def fleet_applies(short: str, targets: list[str] | None) -> bool:
    """Whether vLLM's `--lora-target-modules` lets an adapter module (`q_proj`, ...) through.

    vllm/lora/utils.py `is_in_target_modules`: a runtime module passes if its suffix is listed,
    or for a packed module (`qkv_proj`) if any of its children is; adapter module `k_proj` is
    then applied through the packed `qkv_proj` even when only `q_proj` is listed.
    """
    if targets is None:
        return True
    t = set(targets)
    if short in t:
        return True
    return any(short in kids and (parent in t or t & set(kids)) for parent, kids in PACKED_MODULES.items())
