"""Random-weight bases with the exact Qwen3.6-27B geometry, in the real checkpoint layout.

For throughput and memory runs of the shipped config on a GPU host that has no model hub: the same
tensors, shapes, dtype and key layout as `Qwen/Qwen3.6-27B` (docs/qwen3.6-27b.md), with N decoder
layers in the [linear x3, full] pattern, so `pipeline train axolotl_configs/qwen3.6-27b-lora.yml`
runs unchanged except `base_model` (and the layer count it implies).

Layout written (`out/`):
  config.json                      `Qwen3_5ForConditionalGeneration`, `text_config` + `vision_config`
  model-0000i-of-0000n.safetensors bf16, ~`shard_gb` each, keys `model.language_model.*`,
                                   `model.visual.*`, `lm_head.weight`, `mtp.*` (one MTP layer)
  model.safetensors.index.json     `metadata.total_size` (bytes) + `weight_map`
  tokenizer files, chat template   the tiny base's byte-level BPE (1,024 ids, pipeline.dev.tinybase)
  preprocessor_config.json,        image/video processor settings of the Qwen3.5 family (patch 16,
  video_preprocessor_config.json   temporal patch 2, merge 2): axolotl loads the processor for the
                                   VL class even for text-only data
  generation_config.json

What differs from the real checkpoint: the weights are random (transformers' own initialisation:
normal(0, 0.02) linears/embeddings, zero RMSNorm offsets, the Gated-DeltaNet `A_log`/`dt_bias`
init), the tokenizer has 1,024 ids instead of ~248k (the embedding and lm_head keep all 248,320
rows, so the cost per token is the real one), the vision tower is transformers' default
`Qwen3_5VisionConfig` with `out_hidden_size` set to the text width, and rotary settings are
transformers' defaults. Cost per token depends on none of these.
"""

from __future__ import annotations

import json
import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pipeline.dev.output import write_whole
from pipeline.dev.tinybase import build_tokenizer
from pipeline.errors import UsageError

log = logging.getLogger(__name__)

# Qwen3.6-27B text geometry (docs/qwen3.6-27b.md; the model's public config.json).
QWEN36_27B_TEXT = dict(
    hidden_size=5120,
    intermediate_size=17408,
    num_hidden_layers=64,
    num_attention_heads=24,
    num_key_value_heads=4,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=48,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    vocab_size=248320,
    tie_word_embeddings=False,
    rms_norm_eps=1e-6,
    max_position_embeddings=262144,
)
FULL_ATTENTION_INTERVAL = 4  # layer_types: [linear, linear, linear, full] repeated
MTP_LAYERS = 1
DEFAULT_SHARD_GB = 4.0


def layer_types(n_layers: int) -> list[str]:
    """`layer_types` for `n_layers` decoder layers: full attention at every 4th (3, 7, 11, ...)."""
    return [
        "full_attention" if (i + 1) % FULL_ATTENTION_INTERVAL == 0 else "linear_attention"
        for i in range(n_layers)
    ]


def real_config(layers: int = 64, text_overrides: dict | None = None, vision_overrides: dict | None = None):
    """The `Qwen3_5Config` (VL wrapper) of Qwen3.6-27B with `layers` decoder layers.

    `text_overrides`/`vision_overrides` replace geometry fields (tests build a small model through
    the same code). Raises ValueError when `layers` < 4 (fewer have no full-attention layer, which
    the MTP layer copies).
    """
    from transformers import Qwen3_5Config

    if layers < FULL_ATTENTION_INTERVAL:
        raise ValueError(
            f"layers must be >= {FULL_ATTENTION_INTERVAL} (3 linear-attention + 1 full-attention, repeated), got {layers}"
        )
    text = {**QWEN36_27B_TEXT, "num_hidden_layers": layers, **(text_overrides or {})}
    text["layer_types"] = layer_types(text["num_hidden_layers"])
    vision = {"out_hidden_size": text["hidden_size"], **(vision_overrides or {})}
    cfg = Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=False)
    cfg.architectures = ["Qwen3_5ForConditionalGeneration"]
    cfg.text_config.mtp_num_hidden_layers = MTP_LAYERS
    return cfg


def text_parameter_count(layers: int = 64, text_overrides: dict | None = None) -> int:
    """Parameters of the text model (embeddings, decoder layers, final norm, lm_head; no vision, no MTP):
    26,895,998,464 for the 64-layer Qwen3.6-27B. One decoder layer of each type is built on the meta
    device (no memory) and counted."""
    import torch
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer

    cfg = real_config(layers, text_overrides).text_config
    per_type: dict[str, int] = {}
    with torch.device("meta"):
        for i, t in enumerate(cfg.layer_types):
            if t not in per_type:
                per_type[t] = sum(p.numel() for p in Qwen3_5DecoderLayer(cfg, i).parameters())
    embed = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
    return embed + cfg.hidden_size + sum(per_type[t] for t in cfg.layer_types)


def _mtp_tensors(model, generator, device) -> dict:
    """One MTP layer named as in the real checkpoint: a full-attention decoder layer + fc + 3 norms."""
    import torch

    text = model.model.language_model
    full = next(i for i, t in enumerate(model.config.text_config.layer_types) if t == "full_attention")
    h = model.config.text_config.hidden_size
    out = {}
    for name, p in text.layers[full].state_dict().items():
        if name.endswith("norm.weight"):
            out[f"mtp.layers.0.{name}"] = torch.zeros_like(p)
        else:
            t = torch.empty(p.shape, dtype=torch.float32, device=device).normal_(0, 0.02, generator=generator)
            out[f"mtp.layers.0.{name}"] = t.to(p.dtype)
    out["mtp.fc.weight"] = (
        torch.empty(h, 2 * h, dtype=torch.float32, device=device).normal_(0, 0.02, generator=generator)
    ).to(torch.bfloat16)
    for n in ("mtp.norm.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight"):
        out[n] = torch.zeros(h, dtype=torch.bfloat16, device=device)
    return out


# Image/video processor settings as shipped with the Qwen3.5/3.6 VL checkpoints (patch 16, temporal
# patch 2, spatial merge 2, mean/std 0.5); written as JSON so no torchvision is needed to build.
_PROCESSOR_COMMON = {
    "processor_class": "Qwen3VLProcessor",
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "do_resize": True,
    "do_convert_rgb": True,
}
PREPROCESSOR_CONFIG = {
    **_PROCESSOR_COMMON,
    "image_processor_type": "Qwen2VLImageProcessor",
    "size": {"shortest_edge": 65536, "longest_edge": 16777216},
}
VIDEO_PREPROCESSOR_CONFIG = {
    **_PROCESSOR_COMMON,
    "video_processor_type": "Qwen3VLVideoProcessor",
    "size": {"shortest_edge": 4096, "longest_edge": 25165824},
    "fps": 2,
}


def _shards(tensors: dict, shard_bytes: int) -> list[list[str]]:
    """Group tensor names (sorted, so layers stay together) into shards of at most ~shard_bytes."""
    groups: list[list[str]] = [[]]
    size = 0
    for name in sorted(tensors):
        n = tensors[name].numel() * tensors[name].element_size()
        if groups[-1] and size + n > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += n
    return groups


def build_real_base(
    out: Path,
    layers: int = 64,
    *,
    device: str = "cpu",
    seed: int = 0,
    shard_gb: float = DEFAULT_SHARD_GB,
    threads: int = 8,
    text_overrides: dict | None = None,
    vision_overrides: dict | None = None,
) -> Path:
    """Write a random-weight bf16 Qwen3.6-27B-geometry checkpoint with `layers` layers to `out`.

    Args:
        out: directory to create (replaced if it exists).
        layers: decoder layers (64 = the full model, ~54 GB on disk; 8 = ~9 GB).
        device: where the weights are drawn ("cuda" draws the 64-layer model in seconds; it needs
            ~2 bytes per parameter of free device memory, 55 GB for 64 layers).
        seed: torch seed; the same seed, device and geometry give the same weights.
        shard_gb: target shard size in GB (1e9 bytes); the real checkpoint has ~3.5 GB shards.
        threads: shards written in parallel.
        text_overrides / vision_overrides: geometry replacements (tests only).

    `out` is checked and written whole as `pipeline.dev.output.write_whole` says (a non-empty
    directory that is no checkpoint, or the working directory, is refused; a failed build leaves
    `out` as it was).

    Returns `out`. Raises ValueError for layers < 4 or shard_gb <= 0 (or not finite), UsageError for
    `device="cuda"` without a visible CUDA GPU or an `out` that may not be written (before anything is written).
    """
    import torch

    if not math.isfinite(shard_gb) or shard_gb <= 0:
        raise ValueError(f"shard_gb must be a finite number > 0, got {shard_gb}")
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(f"--device {device}: no CUDA GPU is visible to torch here; use --device cpu")
    cfg = real_config(layers, text_overrides, vision_overrides)
    with write_whole(out) as partial:
        _write_real_base(partial, cfg, device=device, seed=seed, shard_gb=shard_gb, threads=threads)
    log.info("checkpoint in %s", out)
    return Path(out)


def _write_real_base(out: Path, cfg, *, device: str, seed: int, shard_gb: float, threads: int) -> None:
    """Draw the weights of `cfg` on `device` and write shards, index, config and tokenizer into `out`."""
    import torch
    from safetensors.torch import save_file
    from transformers import GenerationConfig, Qwen3_5ForConditionalGeneration

    t0 = time.time()
    tok = build_tokenizer(out)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    pad = tok.convert_tokens_to_ids("<|endoftext|>")
    cfg.text_config.eos_token_id = eos
    cfg.text_config.pad_token_id = pad

    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen3_5ForConditionalGeneration._from_config(cfg, dtype=torch.bfloat16)
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    tensors = {k: v for k, v in model.state_dict().items()}
    tensors.update(_mtp_tensors(model, gen, device))
    log.info(
        "drew %.2f B parameters on %s in %.1f s",
        sum(t.numel() for t in tensors.values()) / 1e9,
        device,
        time.time() - t0,
    )

    groups = _shards(tensors, int(shard_gb * 1e9))
    n = len(groups)
    weight_map: dict[str, str] = {}

    def write(i: int) -> int:
        fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        part = {k: tensors[k].detach().to("cpu").contiguous() for k in groups[i]}
        save_file(part, str(out / fname), metadata={"format": "pt"})
        return sum(t.numel() * t.element_size() for t in part.values())

    for i, g in enumerate(groups):
        for k in g:
            weight_map[k] = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        total = sum(pool.map(write, range(n)))
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2, sort_keys=True)
    )
    config = cfg.to_dict()
    config["dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    GenerationConfig(eos_token_id=eos, pad_token_id=pad, do_sample=False).save_pretrained(out)
    (out / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR_CONFIG, indent=2))
    (out / "video_preprocessor_config.json").write_text(json.dumps(VIDEO_PREPROCESSOR_CONFIG, indent=2))
    log.info("wrote %.1f GB in %d shards in %.1f s", total / 1e9, n, time.time() - t0)
