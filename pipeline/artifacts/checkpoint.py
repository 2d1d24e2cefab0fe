"""Read a checkpoint's structure without loading its weights.

Only `config.json`, `model.safetensors.index.json`, `hf_quant_config.json` and the
safetensors headers (8-byte little-endian length + JSON) are read: validating against the
52 GB Qwen3.6-27B base reads ~15 headers of a few hundred KB each.

Module names are canonical and layout-free: `layers.{i}.{path}` for decoder layers
(e.g. `layers.3.self_attn.q_proj`), `embed_tokens`, `lm_head`, `mtp.*`, `visual.*`. Both the
text layout (`model.layers.N.`) and the vision-language layout of the real checkpoint
(`model.language_model.layers.N.`) map onto them, as do NVFP4 ModelOpt tensors
(`.weight` packed uint8 plus `.weight_scale`, `.weight_scale_2`, `.input_scale`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.artifacts.bounded import MIB, BoundsError, load_json_file
from pipeline.artifacts.safetensors import TensorInfo, read_safetensors_header

# Text-model prefixes, longest first. Order matters: VL before text.
MAX_CONFIG_BYTES = 64 * MIB  # config.json, the safetensors index (a 27B model: ~100 KB)
TEXT_PREFIXES = ("model.language_model.", "language_model.model.", "model.")
QUANT_SUFFIXES = (".weight_scale_2", ".weight_scale", ".input_scale", ".weight_packed", ".weight")


def canonical_module(tensor_name: str) -> tuple[str, str] | None:
    """Map a checkpoint tensor name to (canonical module, suffix), or None for non-module tensors.

    `model.language_model.layers.3.self_attn.q_proj.weight` -> (`layers.3.self_attn.q_proj`, `.weight`)
    `lm_head.weight` -> (`lm_head`, `.weight`); `mtp.fc.weight` -> (`mtp.fc`, `.weight`);
    `model.visual.blocks.0.attn.qkv.weight` -> (`visual.blocks.0.attn.qkv`, `.weight`).
    """
    suffix = next((s for s in QUANT_SUFFIXES if tensor_name.endswith(s)), None)
    if suffix is None:
        return None
    stem = tensor_name[: -len(suffix)]
    if stem.startswith("model.visual.") or stem.startswith("visual."):
        return stem[stem.index("visual.") :], suffix
    if stem.startswith("mtp.") or stem == "lm_head":
        return stem, suffix
    for p in TEXT_PREFIXES:
        if stem.startswith(p):
            return stem[len(p) :], suffix
    return stem, suffix


LAYER_RE = re.compile(r"layers\.(\d+)\.(.+)\Z")


@dataclass
class Checkpoint:
    """Structure of a checkpoint directory (no weights loaded)."""

    path: Path
    config: dict
    text_config: dict
    layout: str  # "text" | "vl"
    tensors: dict[str, TensorInfo]
    quant_config: dict | None = None
    # canonical module -> its `.weight` TensorInfo (2-D linears and others)
    modules: dict[str, TensorInfo] = field(default_factory=dict)

    @property
    def num_layers(self) -> int:
        return int(self.text_config.get("num_hidden_layers", 0))

    @property
    def layer_types(self) -> list[str]:
        lt = self.text_config.get("layer_types")
        if lt:
            return list(lt)
        interval = self.text_config.get("full_attention_interval")
        if interval:
            return [
                "full_attention" if (i + 1) % interval == 0 else "linear_attention"
                for i in range(self.num_layers)
            ]
        return ["full_attention"] * self.num_layers

    @property
    def is_quantized(self) -> bool:
        return self.quant_config is not None

    def linear_shape(self, module: str) -> tuple[int, int] | None:
        """[out_features, in_features] of a linear module from the bf16 weight, or None.

        For quantized checkpoints the packed weight shape is not the logical shape: use the
        bf16 base for shapes and the served checkpoint for module presence.
        """
        t = self.modules.get(module)
        if t is None or len(t.shape) != 2 or self.is_quantized and t.dtype in ("U8", "I8", "F4"):
            return None
        return t.shape[0], t.shape[1]

    def layer_modules(self, layer: int) -> set[str]:
        """Module paths within decoder layer `layer`, e.g. {'self_attn.q_proj', 'mlp.up_proj', ...}."""
        out = set()
        for m in self.modules:
            mm = LAYER_RE.match(m)
            if mm and int(mm.group(1)) == layer:
                out.add(mm.group(2))
        return out


def _load_json(path: Path) -> dict:
    try:
        return load_json_file(path, MAX_CONFIG_BYTES)
    except FileNotFoundError:
        raise
    except BoundsError:
        raise
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not a text file (byte {e.start} is not UTF-8)") from e
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from e


def read_checkpoint(path: Path) -> Checkpoint:
    """Read a checkpoint's config, index, quant config and every shard's header.

    Raises:
        FileNotFoundError: no config.json, or no safetensors weights.
        ValueError / HeaderError: unreadable JSON or a corrupt shard header (file named).
    """
    path = Path(path)
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{path}: no config.json: not a model checkpoint directory")
    config = _load_json(cfg_path)
    text_config = config.get("text_config") or config
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(_load_json(index).get("weight_map", {}).values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors weights and no model.safetensors.index.json")
    tensors: dict[str, TensorInfo] = {}
    for fname in files:
        tensors.update(read_safetensors_header(path / fname))
    quant = path / "hf_quant_config.json"
    quant_config = _load_json(quant) if quant.is_file() else None
    if quant_config is None and isinstance(config.get("quantization_config"), dict):
        quant_config = config["quantization_config"]
    layout = "vl" if any(n.startswith("model.language_model.") for n in tensors) else "text"
    modules: dict[str, TensorInfo] = {}
    for name, info in tensors.items():
        cm = canonical_module(name)
        if cm and cm[1] in (".weight", ".weight_packed"):
            modules[cm[0]] = info
    return Checkpoint(path, config, text_config, layout, tensors, quant_config, modules)


# -- quantized (served) checkpoints -------------------------------------------------------------
# Text geometry that must agree between the bf16 base and the served checkpoint (config.json).
GEOMETRY_KEYS = (
    "hidden_size",
    "num_hidden_layers",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "vocab_size",
    "layer_types",
)


def quant_algo(ckpt: Checkpoint) -> str | None:
    """The checkpoint's quantization algorithm (`NVFP4`, `FP8`, `MIXED_PRECISION`, ...), or None.

    ModelOpt writes `hf_quant_config.json` `{"quantization": {"quant_algo": ...}}`; newer exports
    also put `quantization_config` (`quant_method: modelopt`) into config.json.
    """
    q = ckpt.quant_config
    if not q:
        return None
    inner = q.get("quantization", q)
    algo = inner.get("quant_algo") or inner.get("quant_method")
    return str(algo).upper() if algo else "UNKNOWN"


def logical_linear_shape(ckpt: Checkpoint, module: str) -> tuple[int, int] | None:
    """[out_features, in_features] of a linear module, undoing quantized packing; None if absent.

    NVFP4 (ModelOpt): `.weight` is U8 [out, in/2] (two e2m1 values per byte) with a
    `.weight_scale` F8_E4M3 [out, in/16]; FP8: `.weight` F8_E4M3 [out, in]; bf16 (excluded
    modules): as stored. Source: NVIDIA TensorRT-Model-Optimizer HF export format.
    """
    t = ckpt.modules.get(module)
    if t is None or len(t.shape) != 2:
        return None
    out_f, in_f = t.shape
    if t.name.endswith(".weight_packed") and t.dtype == "I32":
        return out_f, in_f * 8  # compressed-tensors int4: eight values per int32
    if t.dtype in ("U8", "I8") and ckpt.is_quantized:
        return out_f, in_f * 2  # two 4-bit values per byte
    return out_f, in_f
