"""Deterministic tiny random-weight Qwen3.5 bases for the demo and tests (no downloads).

Two checkpoint layouts of the same weights:
- ``text``: what `Qwen3_5ForCausalLM.save_pretrained` writes (`model.layers.N...`, `lm_head`),
  loadable by transformers/axolotl/peft; the layout the demo trains on.
- ``vl``: the layout of the real Qwen3.6-27B checkpoint (`model.language_model.layers.N...`,
  `lm_head`, `mtp.*` tensors for one MTP layer, a stub `model.visual.*` tower), sharded with a
  `model.safetensors.index.json`; for key-mapping, validation and merge tests. transformers
  cannot load it as a causal LM (that is the point: the pipeline must map names itself).

Geometry follows the real model's pattern (`layer_types` [linear x3, full], gated attention
so `q_proj` is 2 x heads x head_dim wide) at toy size: hidden 128, 4 layers, vocab ~1k.
Linear-attention head dims are 128 because vLLM's CPU Qwen3.5 path needs them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from pipeline.artifacts.checkpoint import TEXT_PREFIXES
from pipeline.dev.output import write_whole

TINY_TEXT_CONFIG = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    layer_types=["linear_attention"] * 3 + ["full_attention"],
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
]
VOCAB_SIZE = 1024


def chat_template_text() -> str:
    """The Qwen-style chat template shipped with the tiny base (Jinja source)."""
    return (Path(__file__).parent / "assets" / "chat_template.jinja").read_text()


def _corpus(dataset_dir: Path | None) -> list[str]:
    """Text to train the tokenizer on: the sample datasets plus fixed filler, deterministic."""
    lines = [
        "You are a helpful assistant. The quick brown fox jumps over the lazy dog.",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nTokyo\n</parameter>\n</function>\n</tool_call>",
        "# Tools You may call one or more functions. Available functions: VALUE NAME ARG",
        '0123456789 {}[]":,.-_/ true false null',
    ]
    if dataset_dir and dataset_dir.is_dir():
        for f in sorted(dataset_dir.glob("*.jsonl")):
            lines.extend(f.read_text().splitlines())
    return lines


def build_tokenizer(out: Path, dataset_dir: Path | None = None, *, corpus=None, vocab_size: int = VOCAB_SIZE):
    """Train a byte-level BPE tokenizer locally (the `tokenizers` library) and save it with the chat template.

    Args:
        out: directory the tokenizer files are saved to.
        dataset_dir: chat JSONL files added to the default corpus (the tiny base's).
        corpus: an iterable of texts to train on instead of the default corpus (`pipeline dev trained-base`).
        vocab_size: ids in all, the special tokens (`SPECIAL_TOKENS`) included (default 1,024).

    Returns the transformers fast tokenizer. Deterministic for the same corpus.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(dataset_dir) if corpus is None else corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS[1:],
        model_max_length=4096,
    )
    fast.chat_template = chat_template_text()
    fast.save_pretrained(out)
    return fast


def build_tiny_base(out: Path, layout: str = "text", seed: int = 0, dataset_dir: Path | None = None) -> Path:
    """Write a tiny random-weight Qwen3.5 base (config, bf16 safetensors, tokenizer) to `out`.

    Args:
        out: directory to create; an existing one is replaced only if empty or a checkpoint, and
            the base is written whole (`pipeline.dev.output.write_whole`).
        layout: ``text`` (Qwen3_5ForCausalLM, one shard) or ``vl`` (real checkpoint key layout,
            3 shards with index, `mtp.*` and `model.visual.*` tensors).
        seed: torch seed; the same seed gives byte-identical weights.
        dataset_dir: JSONL files to train the tokenizer on (default: the repo's `datasets/`).

    Returns: `out`. Raises ValueError for an unknown layout, UsageError for an `out` that may not
    be written.
    """
    if layout not in ("text", "vl"):
        raise ValueError(f"unknown layout {layout!r}: use 'text' or 'vl'")
    with write_whole(out) as partial:
        _write_tiny_base(partial, layout, seed, dataset_dir)
    return Path(out)


def _write_tiny_base(out: Path, layout: str, seed: int, dataset_dir: Path | None) -> None:
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    if dataset_dir is None:
        dataset_dir = Path(__file__).resolve().parents[2] / "datasets"
    tok = build_tokenizer(out, dataset_dir)

    torch.manual_seed(seed)
    cfg = Qwen3_5TextConfig(
        vocab_size=len(tok),
        bos_token_id=None,
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
        **TINY_TEXT_CONFIG,
    )
    model = Qwen3_5ForCausalLM(cfg).to(torch.bfloat16)
    model.generation_config.do_sample = False
    model.generation_config.eos_token_id = cfg.eos_token_id
    model.generation_config.pad_token_id = cfg.pad_token_id
    if layout == "text":
        model.save_pretrained(out)
        return
    _write_vl_layout(out, model, seed)


def _write_vl_layout(out: Path, model, seed: int) -> None:
    """Re-key the text weights into the Qwen3.6 checkpoint layout and shard them."""
    import torch
    from safetensors.torch import save_file

    text_cfg = model.config.to_dict()
    g = torch.Generator().manual_seed(seed + 1)
    h = model.config.hidden_size
    tensors: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        key = name.replace("model.", "model.language_model.", 1) if name.startswith("model.") else name
        tensors[key] = t.contiguous()
    # One MTP layer: a full-attention decoder layer + fc + norms (names as in the real checkpoint).
    full = next(i for i, lt in enumerate(model.config.layer_types) if lt == "full_attention")
    for name, t in model.state_dict().items():
        prefix = f"model.layers.{full}."
        if name.startswith(prefix):
            tensors["mtp.layers.0." + name[len(prefix) :]] = (torch.randn(t.shape, generator=g) * 0.02).to(
                t.dtype
            )
    tensors["mtp.fc.weight"] = (torch.randn(h, 2 * h, generator=g) * 0.02).to(torch.bfloat16)
    for n in ("mtp.norm.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight"):
        tensors[n] = torch.ones(h, dtype=torch.bfloat16)
    # A stub vision tower so that "copy everything else byte-identical" has something to copy.
    tensors["model.visual.patch_embed.proj.weight"] = (torch.randn(h, 3, 2, 16, 16, generator=g) * 0.02).to(
        torch.bfloat16
    )
    tensors["model.visual.blocks.0.attn.qkv.weight"] = (torch.randn(3 * h, h, generator=g) * 0.02).to(
        torch.bfloat16
    )

    names = sorted(tensors)
    n_shards = 3
    weight_map: dict[str, str] = {}
    total = 0
    for s in range(n_shards):
        fname = f"model-{s + 1:05d}-of-{n_shards:05d}.safetensors"
        part = {k: tensors[k] for k in names[s::n_shards]}
        save_file(part, str(out / fname), metadata={"format": "pt"})
        for k, t in part.items():
            weight_map[k] = fname
            total += t.numel() * t.element_size()
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2, sort_keys=True)
    )
    text_cfg.pop("architectures", None)
    text_cfg["mtp_num_hidden_layers"] = 1
    config = {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "text_config": text_cfg,
        "vision_config": {"hidden_size": h, "depth": 1, "model_type": "qwen3_5"},
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))


# -- a served (NVFP4 ModelOpt-format) checkpoint, the fast fixture --------------------------------------
# The real builder is `pipeline.merge.quantize` (nvidia-modelopt; `pipeline dev served-base`). This
# hand-written writer stays as the fixture of the `validate --served` tests: it takes ~0.1 s where
# modelopt takes ~10 s per session on CPU, and it writes variants modelopt's recipe does not (other
# exclusions, the text layout of the 0.32+ CausalLM class, a drifted chat template).
# tests/merge/test_quantize.py checks that it writes modelopt's format, tensor by tensor.
# modelopt's NVFP4 default exclusions for Qwen3.5 (configs/ptq/units/default_disabled_quantizers) + mtp.
MODELOPT_EXCLUDES = [
    "lm_head",
    "*linear_attn.conv1d",
    "*linear_attn.in_proj_a",
    "*linear_attn.in_proj_b",
    "mtp*",
]
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitudes of the FP4 e2m1 code points 0..7
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
    "generation_config.json",
)


def quantize_nvfp4(w):
    """NVFP4-quantize a 2-D weight [out, in] (in divisible by 16) the way ModelOpt stores it.

    Returns (packed U8 [out, in/2] (low nibble first), block scales F8_E4M3 [out, in/16],
    global scale F32 []). Each code is sign bit 3 + e2m1 magnitude index; a value is
    code x block_scale x global_scale (NVIDIA TensorRT-Model-Optimizer NVFP4 format).
    """
    import torch

    w = w.float()
    out_f, in_f = w.shape
    grid = torch.tensor(E2M1_GRID)
    scale2 = (w.abs().max() / (448.0 * 6.0)).clamp(min=1e-12)
    blocks = w.reshape(out_f, in_f // 16, 16)
    scale = (blocks.abs().amax(-1) / 6.0 / scale2).to(torch.float8_e4m3fn)
    denom = (scale.float() * scale2).clamp(min=1e-12).unsqueeze(-1)
    q = blocks / denom
    idx = (q.abs().unsqueeze(-1) - grid).abs().argmin(-1)
    codes = (idx | ((q < 0).long() << 3)).to(torch.uint8).reshape(out_f, in_f)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.contiguous(), scale.contiguous(), scale2.reshape(()).to(torch.float32)


def build_tiny_served(
    base_dir: Path, out: Path, exclude_modules: list[str] | None = None, chat_template: str | None = None
) -> Path:
    """Write a text-only NVFP4 ModelOpt-style checkpoint of a tiny base (either layout) to `out`.

    Like the fleet's served checkpoint (e.g. an NVFP4 + MTP repackaging of Qwen3.6-27B): tensors
    under `model.layers.N.` (text layout, vision tower dropped), decoder-layer linears as U8
    `.weight` [out, in/2] + `.weight_scale` F8_E4M3 [out, in/16] + `.weight_scale_2` F32 +
    `.input_scale` F32, everything else (embeddings, norms, lm_head, `mtp.*`) bf16, and
    `hf_quant_config.json` + `quantization_config` in config.json. Tokenizer files are copied
    from the base; `chat_template` replaces the served template (to test template drift).

    Args:
        exclude_modules: fnmatch patterns of linear modules kept in bf16 (written to
            `exclude_modules`), default `MODELOPT_EXCLUDES` (what modelopt's recipe keeps in bf16).
    Returns: `out` (replaced if it exists).
    """
    import fnmatch

    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    base_dir, out = Path(base_dir), Path(out)
    exclude = list(exclude_modules or MODELOPT_EXCLUDES)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(base_dir.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            for name in f.keys():
                if "visual." in name:
                    continue
                key = name
                for p in TEXT_PREFIXES:
                    if name.startswith(p):
                        key = "model." + name[len(p) :]
                        break
                t = f.get_tensor(name)
                stem = key[: -len(".weight")] if key.endswith(".weight") else None
                if (
                    stem
                    and t.dim() == 2
                    and ".layers." in stem
                    and stem.startswith("model.")
                    and not any(fnmatch.fnmatch(stem, pat) for pat in exclude)
                ):
                    packed, scale, scale2 = quantize_nvfp4(t)
                    tensors[key] = packed
                    tensors[stem + ".weight_scale"] = scale
                    tensors[stem + ".weight_scale_2"] = scale2
                    tensors[stem + ".input_scale"] = torch.ones((), dtype=torch.float32)
                else:
                    tensors[key] = t.contiguous()
    fname = "model.safetensors"
    save_file(tensors, str(out / fname), metadata={"format": "pt"})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (out / "model.safetensors.index.json").write_text(
        json.dumps(
            {"metadata": {"total_size": total}, "weight_map": {k: fname for k in sorted(tensors)}}, indent=2
        )
    )
    quant = {
        "producer": {"name": "modelopt", "version": "0.37.0"},
        "quantization": {
            "quant_algo": "NVFP4",
            "kv_cache_quant_algo": "FP8",
            "group_size": 16,
            "exclude_modules": exclude,
        },
    }
    (out / "hf_quant_config.json").write_text(json.dumps(quant, indent=2))
    base_cfg = json.loads((base_dir / "config.json").read_text())
    cfg = dict(base_cfg.get("text_config") or base_cfg)
    cfg.update(
        {
            "architectures": ["Qwen3_5ForCausalLM"],
            "model_type": "qwen3_5_text",
            "torch_dtype": "bfloat16",
            "quantization_config": {"quant_method": "modelopt", **quant["quantization"]},
        }
    )
    cfg.setdefault("mtp_num_hidden_layers", 1 if any(k.startswith("mtp.") for k in tensors) else 0)
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    for f in TOKENIZER_FILES:
        if (base_dir / f).exists():
            shutil.copy2(base_dir / f, out / f)
    if chat_template is not None:
        (out / "chat_template.jinja").write_text(chat_template)
        tc = out / "tokenizer_config.json"
        if tc.exists():
            d = json.loads(tc.read_text())
            d.pop("chat_template", None)
            tc.write_text(json.dumps(d, indent=2))
    return out
