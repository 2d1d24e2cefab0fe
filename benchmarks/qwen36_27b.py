"""Qwen3.6-27B text geometry for the synthetic benchmark checkpoints (one place).

Source: docs/qwen3.6-27b.md (public config.json and weight table).
Shapes are [out_features, in_features] of the linear modules a LoRA can target.

`Geometry` derives every shape from the config's head counts and sizes, so the same code builds the
real-size checkpoints (`QWEN36_27B`) and the toy one the benchmarks' smoke modes use (`TINY`, the
same layer pattern and module set at a few kB per tensor). The module-level names are the 27B's.

    python benchmarks/qwen36_27b.py --smoke    # the derived shapes equal the published table
"""

from __future__ import annotations

import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Geometry:
    hidden: int
    intermediate: int
    vocab: int
    heads: int  # full attention: query heads (q_proj also carries the output gate: 2 x heads x head_dim)
    kv_heads: int
    head_dim: int
    linear_k_heads: int  # Gated DeltaNet
    linear_v_heads: int
    linear_k_dim: int
    linear_v_dim: int
    conv_kernel: int = 4
    layers: int = 64

    @property
    def linear(self) -> dict[str, tuple[int, int]]:
        """Gated DeltaNet token mixer (3 of every 4 layers)."""
        qkv = 2 * self.linear_k_heads * self.linear_k_dim + self.linear_v_heads * self.linear_v_dim
        v = self.linear_v_heads * self.linear_v_dim
        return {
            "linear_attn.in_proj_qkv": (qkv, self.hidden),
            "linear_attn.in_proj_z": (v, self.hidden),
            "linear_attn.in_proj_b": (self.linear_v_heads, self.hidden),
            "linear_attn.in_proj_a": (self.linear_v_heads, self.hidden),
            "linear_attn.out_proj": (self.hidden, v),
        }

    @property
    def full(self) -> dict[str, tuple[int, int]]:
        """Gated full attention (every 4th layer)."""
        return {
            "self_attn.q_proj": (2 * self.heads * self.head_dim, self.hidden),
            "self_attn.k_proj": (self.kv_heads * self.head_dim, self.hidden),
            "self_attn.v_proj": (self.kv_heads * self.head_dim, self.hidden),
            "self_attn.o_proj": (self.hidden, self.heads * self.head_dim),
        }

    @property
    def mlp(self) -> dict[str, tuple[int, int]]:
        h, i = self.hidden, self.intermediate
        return {"mlp.gate_proj": (i, h), "mlp.up_proj": (i, h), "mlp.down_proj": (h, i)}

    @property
    def linear_other(self) -> dict[str, tuple[int, ...]]:
        """The DeltaNet layer's non-linear tensors: conv over q, k, v; per-value-head decay and bias; norm."""
        qkv = self.linear["linear_attn.in_proj_qkv"][0]
        return {
            "linear_attn.conv1d.weight": (qkv, 1, self.conv_kernel),
            "linear_attn.A_log": (self.linear_v_heads,),
            "linear_attn.dt_bias": (self.linear_v_heads,),
            "linear_attn.norm.weight": (self.linear_v_dim,),
        }

    @property
    def full_other(self) -> dict[str, tuple[int, ...]]:
        return {"self_attn.q_norm.weight": (self.head_dim,), "self_attn.k_norm.weight": (self.head_dim,)}

    def text_config(self, layers: int | None = None) -> dict:
        """The `text_config` of config.json for a `layers`-layer truncation of the model."""
        n = self.layers if layers is None else layers
        return {
            "model_type": "qwen3_5_text",
            "hidden_size": self.hidden,
            "num_hidden_layers": n,
            "intermediate_size": self.intermediate,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "linear_num_key_heads": self.linear_k_heads,
            "linear_num_value_heads": self.linear_v_heads,
            "linear_key_head_dim": self.linear_k_dim,
            "linear_value_head_dim": self.linear_v_dim,
            "linear_conv_kernel_dim": self.conv_kernel,
            "vocab_size": self.vocab,
            "layer_types": layer_types(n),
            "attn_output_gate": True,
            "mtp_num_hidden_layers": 1,
        }


def layer_types(n: int = 64) -> list[str]:
    """[linear, linear, linear, full] repeated: full attention at layers 3, 7, ..."""
    return ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)]


QWEN36_27B = Geometry(
    hidden=5120,
    intermediate=17408,
    vocab=248320,
    heads=24,
    kv_heads=4,
    head_dim=256,
    linear_k_heads=16,
    linear_v_heads=48,
    linear_k_dim=128,
    linear_v_dim=128,
)
TINY = Geometry(
    hidden=64,
    intermediate=128,
    vocab=512,
    heads=2,
    kv_heads=1,
    head_dim=16,
    linear_k_heads=2,
    linear_v_heads=4,
    linear_k_dim=16,
    linear_v_dim=16,
    layers=8,
)

H, INTER, VOCAB, LAYERS = QWEN36_27B.hidden, QWEN36_27B.intermediate, QWEN36_27B.vocab, QWEN36_27B.layers
LINEAR, FULL, MLP = QWEN36_27B.linear, QWEN36_27B.full, QWEN36_27B.mlp


def text_config(layers: int = LAYERS) -> dict:
    """The 27B's `text_config` for a `layers`-layer truncation."""
    return QWEN36_27B.text_config(layers)


# The published weight table (docs/qwen3.6-27b.md): what `Geometry` must derive for the 27B.
PUBLISHED = {
    "linear_attn.in_proj_qkv": (10240, 5120),
    "linear_attn.in_proj_z": (6144, 5120),
    "linear_attn.in_proj_b": (48, 5120),
    "linear_attn.in_proj_a": (48, 5120),
    "linear_attn.out_proj": (5120, 6144),
    "linear_attn.conv1d.weight": (10240, 1, 4),
    "self_attn.q_proj": (12288, 5120),
    "self_attn.k_proj": (1024, 5120),
    "self_attn.v_proj": (1024, 5120),
    "self_attn.o_proj": (5120, 6144),
    "mlp.gate_proj": (17408, 5120),
    "mlp.up_proj": (17408, 5120),
    "mlp.down_proj": (5120, 17408),
}


def main(argv: list[str] | None = None) -> int:
    """`--smoke`: the shapes derived for the 27B equal PUBLISHED, and TINY derives a consistent set."""
    derived = {**QWEN36_27B.linear, **QWEN36_27B.linear_other, **QWEN36_27B.full, **QWEN36_27B.mlp}
    wrong = {k: (derived.get(k), v) for k, v in PUBLISHED.items() if derived.get(k) != v}
    for name, g in (("Qwen3.6-27B", QWEN36_27B), ("tiny", TINY)):
        group = sum(
            a * b
            for t in layer_types(4)
            for a, b in {**(g.full if t == "full_attention" else g.linear), **g.mlp}.values()
        )
        print(f"{name}: hidden {g.hidden}, {group:,} LoRA-targetable weights per group of 4 layers")
    print("shapes: " + ("equal the published table" if not wrong else f"DIFFER {wrong}"))
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
