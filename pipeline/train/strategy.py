"""How `pipeline train --gpus N` spreads a LoRA run over several GPUs: DDP or FSDP2, and why.

For LoRA the base is frozen: data parallelism (DDP) replicates it and all-reduces only the LoRA
gradients (~0.2 GB for the shipped Qwen3.6-27B config), while FSDP2 shards it and all-gathers
every layer's weights each step (52 GB of bf16 base per step at micro batch 1: 50-57% scaling on
two H200s, benchmarks/RESULTS.md). So `auto` picks DDP whenever the per-GPU memory estimate of a
replicated run fits the smallest visible GPU, else FSDP2; `--strategy ddp|fsdp2` overrides.

Per-GPU estimate (bytes) with the base replicated, from the shipped config's measured peaks on
an H200 (benchmarks/RESULTS.md: 60.1 GB at seq 4096 and 72.2 GB at 16384 with full recompute,
126.1 GB at 4096 without; weights 53.8 GB):
  weights (the base's safetensors size) x (1 + 0.043)  LoRA weights, gradients, Adam state, buffers
  + tokens x hidden x (2 x layers + 63)               recompute on: each layer's input is kept
  + tokens x hidden x 52 x layers                    recompute off: every activation is kept
  + tokens x vocab x 10                              logits materialised (no fused loss)
tokens = micro_batch_size x sequence_len. A run fits when the estimate is at most 92% of the GPU.

What each strategy sets in the config axolotl runs:
- ddp: no FSDP keys (axolotl's accelerate launcher then runs plain DDP), and
  `ddp_find_unused_parameters: false`: every LoRA parameter gets a gradient each step, and with
  axolotl's reentrant activation checkpointing `true` fails ("Expected to mark a variable ready
  only once"); frozen parameters are not tracked by DDP at all.
- fsdp2: `FSDP2_SETTINGS` (= axolotl_configs/fsdp2.yml) unless the config has FSDP settings already.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.train.config import TrainingConfig
from pipeline.train.fused_loss import LOGIT_BYTES_PER_ELEMENT
from pipeline.train.preflight import Gpu, base_config, fused_loss_active, weights_bytes

STATIC_PER_WEIGHT = 0.043
RECOMPUTE_PER_LAYER_HIDDEN = 2  # bytes per token per layer per hidden unit: the layer input, bf16
RECOMPUTE_EXTRA_HIDDEN = 63  # the layer being recomputed, the loss chunk, buffers
NO_RECOMPUTE_PER_LAYER_HIDDEN = 52
FIT_SHARE = 0.92
FSDP_KEYS = ("fsdp", "fsdp_config", "fsdp_version")
FSDP2_SETTINGS = {
    "fsdp_version": 2,
    "fsdp_config": {
        "offload_params": False,
        "cpu_ram_efficient_loading": True,
        "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "transformer_layer_cls_to_wrap": "Qwen3_5DecoderLayer",
        "state_dict_type": "FULL_STATE_DICT",
        "reshard_after_forward": True,
        "activation_checkpointing": True,
    },
    "gradient_checkpointing": False,
}


@dataclass(frozen=True)
class Choice:
    strategy: str  # "ddp" | "fsdp2"
    reason: str
    per_gpu_bytes: int | None = None  # the estimate with the base replicated

    def to_dict(self) -> dict:
        gb = None if self.per_gpu_bytes is None else round(self.per_gpu_bytes / 1e9, 1)
        return {"strategy": self.strategy, "reason": self.reason, "ddp_per_gpu_gb": gb}


def has_fsdp(data: dict) -> bool:
    return any(data.get(k) for k in FSDP_KEYS)


def replicated_bytes(tc: TrainingConfig) -> int | None:
    """Per-GPU bytes of a run with the whole base on each GPU (module docstring), or None when the
    base is not a local directory with a config.json and weights."""
    cfg = base_config(tc)
    if cfg is None:
        return None
    text = cfg.get("text_config") or cfg
    hidden, layers = text.get("hidden_size"), text.get("num_hidden_layers")
    vocab = text.get("vocab_size") or cfg.get("vocab_size")
    weights = weights_bytes(tc)
    seq, mbs = tc.data.get("sequence_len"), tc.data.get("micro_batch_size") or 1
    if not all(isinstance(x, int) for x in (hidden, layers, vocab, seq, mbs)) or not weights:
        return None
    tokens = mbs * seq
    if tc.data.get("gradient_checkpointing"):
        act = tokens * hidden * (RECOMPUTE_PER_LAYER_HIDDEN * layers + RECOMPUTE_EXTRA_HIDDEN)
    else:
        act = tokens * hidden * NO_RECOMPUTE_PER_LAYER_HIDDEN * layers
    logits = 0 if fused_loss_active(tc) else tokens * vocab * LOGIT_BYTES_PER_ELEMENT
    return int(weights * (1 + STATIC_PER_WEIGHT) + act + logits)


def choose(tc: TrainingConfig, gpus: list[Gpu], requested: str = "auto") -> Choice:
    """DDP or FSDP2 for a run over several processes, with the reason (see the module docstring)."""
    est = replicated_bytes(tc)
    gpu = min(gpus, key=lambda g: g.total_bytes) if gpus else None
    fits = est is not None and gpu is not None and est <= FIT_SHARE * gpu.total_bytes
    where = (
        f"~{est / 1e9:.0f} GB per GPU with the base replicated vs {gpu.total_bytes / 1e9:.0f} GB on {gpu.name}"
        if est is not None and gpu is not None
        else None
    )
    if requested == "ddp":
        return Choice("ddp", f"--strategy ddp{f' ({where})' if where else ''}", est)
    if requested == "fsdp2":
        return Choice("fsdp2", f"--strategy fsdp2{f' ({where})' if where else ''}", est)
    if has_fsdp(tc.data):
        return Choice("fsdp2", "the config sets FSDP (fsdp_version / fsdp_config)", est)
    if gpu is None:
        return Choice("ddp", "no GPU detected (CPU processes, gloo): nothing to shard for", est)
    if est is None:
        return Choice(
            "fsdp2",
            "the base's size is unknown here (not a local checkpoint): sharding is the safe choice",
            est,
        )
    if fits:
        return Choice(
            "ddp",
            f"the frozen base fits each GPU: {where}, within {FIT_SHARE:.0%}; only LoRA gradients are all-reduced",
            est,
        )
    return Choice(
        "fsdp2", f"the frozen base does not fit each GPU: {where} (> {FIT_SHARE:.0%}); FSDP2 shards it", est
    )


def apply_choice(data: dict, choice: Choice) -> dict:
    """The config for the chosen strategy (a new dict; see the module docstring)."""
    d = dict(data)
    if choice.strategy == "ddp":
        for k in FSDP_KEYS:
            d.pop(k, None)
        d["ddp_find_unused_parameters"] = False
    elif not has_fsdp(d):
        d.update({k: (dict(v) if isinstance(v, dict) else v) for k, v in FSDP2_SETTINGS.items()})
    return d
