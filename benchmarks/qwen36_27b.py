"""Qwen3.6-27B text geometry for the synthetic benchmark checkpoints (one place).

Source: docs/qwen3.6-27b.md (public config.json and weight table).
Shapes are [out_features, in_features] of the linear modules a LoRA can target.
"""

from __future__ import annotations

H, INTER, VOCAB, LAYERS = 5120, 17408, 248320, 64
LINEAR = {  # Gated DeltaNet token mixer (48 of the 64 layers)
    "linear_attn.in_proj_qkv": (10240, H),
    "linear_attn.in_proj_z": (6144, H),
    "linear_attn.in_proj_b": (48, H),
    "linear_attn.in_proj_a": (48, H),
    "linear_attn.out_proj": (H, 6144),
}
FULL = {  # gated full attention (every 4th layer): q_proj is 2 x 24 heads x 256
    "self_attn.q_proj": (12288, H),
    "self_attn.k_proj": (1024, H),
    "self_attn.v_proj": (1024, H),
    "self_attn.o_proj": (H, 6144),
}
MLP = {"mlp.gate_proj": (INTER, H), "mlp.up_proj": (INTER, H), "mlp.down_proj": (H, INTER)}


def layer_types(n: int = LAYERS) -> list[str]:
    """[linear, linear, linear, full] repeated: full attention at layers 3, 7, ..."""
    return ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)]


def text_config(layers: int = LAYERS) -> dict:
    """The `text_config` of config.json for a `layers`-layer truncation of the model."""
    return {
        "model_type": "qwen3_5_text",
        "hidden_size": H,
        "num_hidden_layers": layers,
        "intermediate_size": INTER,
        "num_attention_heads": 24,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 48,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "vocab_size": VOCAB,
        "layer_types": layer_types(layers),
        "attn_output_gate": True,
        "mtp_num_hidden_layers": 1,
    }
