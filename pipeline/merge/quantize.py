"""bf16 Qwen3.5/3.6 checkpoint -> the fleet's served format: a ModelOpt NVFP4 export with the MTP head kept.

NVIDIA's own quantizer does the work (`nvidia-modelopt`, pinned in pyproject.toml and
scripts/gpu/modelopt-requirements.txt): `modelopt.torch.quantization.quantize` with
`NVFP4_DEFAULT_CFG` and max calibration, then `modelopt.torch.export.export_hf_checkpoint`,
which writes the packed weights, `hf_quant_config.json`, `config.json` `quantization_config` and
the shard index. This module only decides what goes in and puts back what transformers drops.

The recipe is the one of the fleet's checkpoint class, `sakamakismile/Qwen3.6-27B-Text-NVFP4-MTP`
(model card: modelopt format; recipe of `osoleve/Qwen3.5-27B-Text-NVFP4-MTP`, produced by the
lna-lab GGUF-to-NVFP4-SM120 pipeline: `NVFP4_DEFAULT_CFG` plus `*mtp*` and `*visual*` disabled,
the 15 `mtp.*` tensors grafted back in bf16 and listed in the ignore list, vision tower stripped;
docs/qwen3.6-27b.md "Served checkpoint" has the sources):

- NVFP4 (W4A4: e2m1 values, FP8-E4M3 scale per 16 inputs, FP32 global scale) on every decoder
  linear: `self_attn.{q,k,v,o}_proj`, `linear_attn.{in_proj_qkv,in_proj_z,out_proj}`,
  `mlp.{gate,up,down}_proj`;
- bf16 (modelopt's default exclusions for Qwen3.5, `configs/ptq/units/default_disabled_quantizers`):
  `lm_head`, `embed_tokens`, `linear_attn.conv1d`, `linear_attn.in_proj_a`, `linear_attn.in_proj_b`;
  and `mtp.*`, `model.visual.*` (the two added rules);
- the `mtp.*` tensors copied unchanged from the source (transformers' Qwen3.5 classes have no
  MTP module, so `from_pretrained` drops them: the drafter would have nothing to load), exported
  through `extra_state_dict` and excluded as `mtp*` (modelopt's `_mtp_layer_prefixes` hook);
- text only: the vision tower is not exported; `architectures` stays
  `Qwen3_5ForConditionalGeneration` (the only class vLLM 0.19-0.25 registers for `qwen3_5`), served
  with `--language-model-only`, which never builds the tower.

Runs on CPU for small models (max calibration only observes ranges; export packs in torch) and on
CUDA for real ones. Needs `nvidia-modelopt`; raises UsageError naming the install when it is absent.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import shutil
import time
from pathlib import Path

from pipeline.artifacts.checkpoint import read_checkpoint
from pipeline.artifacts.fingerprint import base_fingerprint
from pipeline.artifacts.hashing import sha256_file
from pipeline.errors import UsageError

QUANT_FORMATS = ("nvfp4",)
BASE_CONFIG = "NVFP4_DEFAULT_CFG"
# Added to modelopt's defaults, as the fleet's checkpoint recipe does (module docstring).
EXTRA_DISABLED = ("*mtp*", "*visual*")
MTP_PREFIX = "mtp"
DEFAULT_SHARD = "5GB"
DEFAULT_MAX_SEQ_LEN = 512
# Files of the source that the export does not write (tokenizer, template, processors).
SIDE_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
    "video_preprocessor_config.json",
)
# Calibration when the caller gives none: short chat turns (the canary's prompts and a few more).
# Enough for the random-weight dev bases; a real merge should calibrate on its own chat data.
DEFAULT_CALIBRATION = (
    "What is the weather in Tokyo right now?",
    "Call the get_weather tool for Paris and report the result.",
    "Summarise: the quick brown fox jumps over the lazy dog.",
    "List three prime numbers and explain why they are prime.",
    "Write a Python function that reverses a string, then explain it in one sentence.",
    "Translate 'good morning, how are you?' into French, German and Japanese.",
    "You are a helpful assistant. Plan a three-day trip to Kyoto with a budget.",
    "Explain the difference between a list and a tuple, with an example of each.",
)


log = logging.getLogger(__name__)


def modelopt_version() -> str:
    """The installed nvidia-modelopt version. Raises UsageError when it is not installed."""
    from importlib import metadata

    try:
        return metadata.version("nvidia-modelopt")
    except metadata.PackageNotFoundError:
        raise UsageError(
            "nvidia-modelopt is not installed: `pip install nvidia-modelopt==0.47.0` (CPU or CUDA; "
            "on a host without a package index carry the wheels of scripts/gpu/modelopt-requirements.txt)"
        ) from None


def quant_config() -> dict:
    """modelopt's `NVFP4_DEFAULT_CFG` with `EXTRA_DISABLED` appended (later rules win in modelopt)."""
    import modelopt.torch.quantization as mtq

    cfg = copy.deepcopy(getattr(mtq, BASE_CONFIG))
    extra = [{"quantizer_name": p, "enable": False} for p in EXTRA_DISABLED]
    if isinstance(cfg["quant_cfg"], list):  # modelopt >= 0.4x: an ordered rule list
        cfg["quant_cfg"] = [*cfg["quant_cfg"], *extra]
    else:  # older releases: {pattern: rule}
        cfg["quant_cfg"].update({p: {"enable": False} for p in EXTRA_DISABLED})
    return cfg


def load_calibration(path: Path | None) -> tuple[list, str]:
    """Calibration conversations: rows of a chat JSONL (`{"messages": [...]}`, as `pipeline train` reads)
    or, without a path, `DEFAULT_CALIBRATION` as single user turns. Returns (items, source label).

    Raises UsageError for an unreadable file or a row without a `messages` list (file and line named).
    """
    if path is None:
        return [[{"role": "user", "content": p}] for p in DEFAULT_CALIBRATION], "builtin prompts"
    path = Path(path)
    items = []
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise UsageError(f"--calib-data {path}: {e.strerror or e}") from e
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise UsageError(f"{path}:{i}: not JSON ({e.msg}); calibration data is chat JSONL") from e
        msgs = row.get("messages") if isinstance(row, dict) else None
        if not isinstance(msgs, list) or not msgs:
            raise UsageError(f'{path}:{i}: no "messages" list; calibration data is chat JSONL rows')
        items.append(msgs)
    if not items:
        raise UsageError(f"{path}: no calibration rows")
    return items, str(path)


def _token_batches(tok, items: list, max_seq_len: int) -> list[list[int]]:
    out = []
    for msgs in items:
        if getattr(tok, "chat_template", None):
            gen = msgs[-1].get("role") == "user"
            ids = tok.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=True, return_dict=True)
            ids = ids["input_ids"]
        else:
            ids = tok("\n".join(str(m.get("content", "")) for m in msgs))["input_ids"]
        out.append(list(ids)[:max_seq_len])
    return out


def _model_class(config: dict):
    import transformers

    arch = (config.get("architectures") or [""])[0]
    cls = getattr(transformers, arch, None) if arch else None
    if cls is None:
        raise UsageError(f"config.json architectures {arch!r}: not a transformers class this build knows")
    return cls


def _mtp_tensors(src: Path, ckpt) -> dict:
    """The source's `mtp.*` tensors, unchanged (bf16 bytes), on CPU."""
    from safetensors import safe_open

    by_file: dict[str, list[str]] = {}
    for name, info in ckpt.tensors.items():
        if name.startswith(MTP_PREFIX + "."):
            by_file.setdefault(info.file, []).append(name)
    out = {}
    for fname, names in sorted(by_file.items()):
        with safe_open(str(src / fname), framework="pt") as f:
            for n in names:
                out[n] = f.get_tensor(n)
    return out


def quantize_checkpoint(
    src: Path,
    out: Path,
    *,
    fmt: str = "nvfp4",
    device: str = "auto",
    calibration: list | None = None,
    calibration_source: str = "builtin prompts",
    max_seq_len: int = DEFAULT_MAX_SEQ_LEN,
    max_shard_size: str = DEFAULT_SHARD,
) -> dict:
    """Quantize the bf16 checkpoint `src` into `out` (an empty or new directory) as the fleet's NVFP4 + MTP format.

    Args:
        src: bf16 safetensors checkpoint of a Qwen3.5-family model (VL layout
            `model.language_model.*` + `mtp.*`, or the text layout), with its tokenizer.
        out: directory to write; callers make it atomic (`write_whole`, merge's partial dir).
        device: `cuda`, `cpu` or `auto` (CUDA when torch sees a GPU). The model is loaded there
            whole in bf16 (~2 bytes per parameter).
        calibration: conversations (lists of chat messages) to run for max calibration; default
            `DEFAULT_CALIBRATION` (see `load_calibration`).
        max_seq_len: tokens per calibration sample (longer ones are cut).
        max_shard_size: largest safetensors shard (transformers' `save_pretrained` syntax).

    Returns: the record of what was done (JSON-able): tool and version, config and the added
    rules, `exclude_modules` as exported, calibration (samples, tokens, sha256 of the token ids,
    source), MTP tensors kept, device, seconds, sha256 of `hf_quant_config.json`, the source's
    fingerprint. `out/manifest.json` is not written here.

    Raises:
        UsageError: unknown `fmt`, modelopt missing, `src` already quantized or unreadable,
            `device="cuda"` without a GPU, or `out` not empty.
        RuntimeError: the export lacks what the fleet needs (no NVFP4 config, MTP tensors lost):
            a modelopt/transformers combination this code was not verified with.
    """
    import torch

    if fmt not in QUANT_FORMATS:
        raise UsageError(f"--quantize {fmt!r}: supported formats are {', '.join(QUANT_FORMATS)}")
    version = modelopt_version()
    src, out = Path(src), Path(out)
    try:
        ckpt = read_checkpoint(src)
    except (FileNotFoundError, ValueError) as e:
        raise UsageError(f"{src}: {e}") from e
    if ckpt.is_quantized:
        raise UsageError(f"{src} is already quantized ({ckpt.quant_config}): quantize its bf16 checkpoint")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(f"--device {device}: no CUDA GPU is visible to torch here; use --device cpu")
    if out.exists() and any(out.iterdir()):
        raise UsageError(f"{out} is not empty: the export writes a new directory")
    say = log.info
    t0 = time.time()

    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint
    from transformers import AutoTokenizer

    mtp = _mtp_tensors(src, ckpt)
    tok = AutoTokenizer.from_pretrained(str(src))
    items = calibration
    if items is None:
        items, calibration_source = load_calibration(None)
    batches = _token_batches(tok, items, max_seq_len)
    calib_hash = hashlib.sha256(json.dumps(batches).encode()).hexdigest()

    model = _model_class(ckpt.config).from_pretrained(str(src), dtype=torch.bfloat16, device_map=device)
    model.eval()
    inner = getattr(model, "model", None)
    dropped_visual = inner is not None and getattr(inner, "visual", None) is not None
    if dropped_visual:  # text-only export: --language-model-only never builds the tower
        inner.visual = torch.nn.Module()
    say(f"loaded {src} on {device} in {time.time() - t0:.1f} s; calibrating on {len(batches)} samples")

    def forward_loop(m) -> None:
        with torch.no_grad():
            for ids in batches:
                m(input_ids=torch.tensor([ids], device=device))

    cfg = quant_config()
    model = mtq.quantize(model, cfg, forward_loop=forward_loop)
    if mtp:
        model._mtp_layer_prefixes = [MTP_PREFIX]  # export adds `mtp*` to exclude_modules / ignore
    out.mkdir(parents=True, exist_ok=True)
    export_hf_checkpoint(model, export_dir=out, extra_state_dict=mtp, max_shard_size=max_shard_size)
    del model
    for name in SIDE_FILES:
        if (src / name).is_file() and not (out / name).exists():
            shutil.copy2(src / name, out / name)

    hq = json.loads((out / "hf_quant_config.json").read_text())
    quant = hq.get("quantization", {})
    served = read_checkpoint(out)
    kept = sorted(n for n in served.tensors if n.startswith(MTP_PREFIX + "."))
    if str(quant.get("quant_algo", "")).upper() != "NVFP4":
        raise RuntimeError(
            f"{out}/hf_quant_config.json: quant_algo {quant.get('quant_algo')!r}, expected NVFP4"
        )
    if kept != sorted(mtp):
        raise RuntimeError(f"{out}: the export kept {len(kept)} of {len(mtp)} mtp.* tensors")
    if mtp:
        _keep_mtp_config(out, ckpt)
    record = {
        "format": "nvfp4",
        "tool": "nvidia-modelopt",
        "version": version,
        "config": BASE_CONFIG,
        "extra_disabled": list(EXTRA_DISABLED),
        "algorithm": cfg.get("algorithm"),
        "quant_algo": quant.get("quant_algo"),
        "group_size": quant.get("group_size"),
        "kv_cache_quant_algo": quant.get("kv_cache_quant_algo"),
        "exclude_modules": quant.get("exclude_modules", []),
        "calibration": {
            "source": calibration_source,
            "samples": len(batches),
            "tokens": sum(len(b) for b in batches),
            "max_seq_len": max_seq_len,
            "token_ids_sha256": calib_hash,
        },
        "mtp_tensors": len(kept),
        "visual": "dropped" if dropped_visual else "absent",
        "architecture": (served.config.get("architectures") or [None])[0],
        "device": device if device == "cpu" else torch.cuda.get_device_name(),
        "seconds": round(time.time() - t0, 2),
        "hf_quant_config_sha256": sha256_file(out / "hf_quant_config.json"),
        "source": {"path": str(src.resolve()), "fingerprint": base_fingerprint(str(src))},
    }
    say(
        f"exported NVFP4 ({len(quant.get('exclude_modules', []))} exclusions, {len(kept)} mtp.* tensors kept) "
        f"to {out} in {record['seconds']} s"
    )
    return record


def _keep_mtp_config(out: Path, src_ckpt) -> None:
    """`mtp_num_hidden_layers` must stay in the exported text config: vLLM's `qwen3_5_mtp` reads it."""
    p = out / "config.json"
    cfg = json.loads(p.read_text())
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    want = src_ckpt.text_config.get("mtp_num_hidden_layers", 1)
    if text.get("mtp_num_hidden_layers") != want:
        text["mtp_num_hidden_layers"] = want
        p.write_text(json.dumps(cfg, indent=2, sort_keys=True))
