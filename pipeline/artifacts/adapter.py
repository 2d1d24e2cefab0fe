"""A PEFT LoRA adapter directory: its config, its tensors' names, and LoRA scaling.

PEFT key forms (peft/utils/save_and_load.py), all mapped to canonical modules as in
`pipeline.artifacts.checkpoint`:
  base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight          (text layout)
  base_model.model.model.language_model.layers.3.mlp.up_proj.lora_B.weight (VL layout)
  base_model.model.lm_head.lora_A.weight
  base_model.model.model.embed_tokens.lora_embedding_A                     (embeddings)

Scaling (vllm/lora/peft_helper.py and peft's LoraLayer): `lora_alpha / r`, or
`lora_alpha / sqrt(r)` with `use_rslora`; `rank_pattern` / `alpha_pattern` override r and
alpha per module, matched like peft (`re.match(rf"(.*\\.)?{key}$", module)`).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from pipeline.artifacts.checkpoint import TEXT_PREFIXES
from pipeline.artifacts.safetensors import TensorInfo, read_safetensors_header

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_WEIGHTS = ("adapter_model.bin", "adapter_model.pt", "adapter_model.pth", "pytorch_model.bin")

KEY_RE = re.compile(
    r"^(?P<module>.+?)\.(?P<kind>lora_A|lora_B|lora_embedding_A|lora_embedding_B)(?:\.(?P<adapter>[^.]+))?(?:\.weight)?$"
)


@dataclass(frozen=True)
class LoraKey:
    tensor: str  # the key as stored
    module: str  # canonical module, e.g. layers.3.self_attn.q_proj
    kind: str  # "A" or "B"
    embedding: bool
    peft_module: str = (
        ""  # the module as PEFT names it (no `base_model.model.`): rank/alpha patterns match this
    )


def parse_key(tensor: str) -> LoraKey | None:
    """Canonicalise a PEFT tensor key; None if it is not a LoRA A/B tensor."""
    name = tensor
    if name.startswith("base_model.model."):
        name = name[len("base_model.model.") :]
    m = KEY_RE.match(name)
    if not m:
        return None
    module = peft_module = m.group("module")
    for p in TEXT_PREFIXES:
        if module.startswith(p):
            module = module[len(p) :]
            break
    if module.startswith("model.visual."):
        module = module[len("model.") :]
    kind = m.group("kind")
    return LoraKey(
        tensor, module, "A" if kind.endswith("A") else "B", kind.startswith("lora_embedding"), peft_module
    )


def pattern_value(pattern: dict, module: str, default):
    r"""peft's per-module override lookup: the first pattern key matching a dotted suffix of `module`.

    Same rule as peft `get_pattern_key` and vLLM `PEFTHelper._match_pattern`
    (`re.match(rf"(.*\.)?({key})$", name)`); pass the PEFT module name (`LoraKey.peft_module`)
    so that keys written with a layout prefix (`model.layers.3.mlp.up_proj`) match too.
    """
    for key, value in (pattern or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


@dataclass
class AdapterConfig:
    raw: dict
    path: Path

    @property
    def r(self) -> int:
        return int(self.raw.get("r", 0))

    @property
    def lora_alpha(self) -> float:
        return float(self.raw.get("lora_alpha", self.r))

    @property
    def use_rslora(self) -> bool:
        return bool(self.raw.get("use_rslora"))

    def rank_for(self, module: str) -> int:
        return int(pattern_value(self.raw.get("rank_pattern"), module, self.r))

    def alpha_for(self, module: str) -> float:
        return float(pattern_value(self.raw.get("alpha_pattern"), module, self.lora_alpha))

    def scale_for(self, module: str) -> float:
        """LoRA output scale for `module` (dimensionless)."""
        r, a = self.rank_for(module), self.alpha_for(module)
        return a / math.sqrt(r) if self.use_rslora else a / r

    @property
    def target_modules(self) -> list[str]:
        """Declared targets as a list; a regex string (peft's other form) is returned as [regex]."""
        t = self.raw.get("target_modules") or []
        return [t] if isinstance(t, str) else list(t)

    def targets(self, module: str) -> bool:
        """Whether peft would target `module` (canonical or PEFT name).

        peft: a string is a regex that must match the whole name; a list matches exact names or
        dotted suffixes (peft/tuners/tuners_utils.py `check_target_module_exists`).
        """
        t = self.raw.get("target_modules")
        if isinstance(t, str):
            return t == "all-linear" or re.fullmatch(t, module) is not None
        return any(module == k or module.endswith("." + k) for k in t or [])


def load_adapter_config(adapter_dir: Path) -> AdapterConfig:
    """Read `adapter_config.json`.

    Raises FileNotFoundError (absent) or ValueError (not a JSON object), naming the file and line.
    """
    p = Path(adapter_dir) / CONFIG_FILE
    if not p.is_file():
        raise FileNotFoundError(
            f"{p}: missing; an adapter directory needs adapter_config.json (PEFT save_pretrained writes it)"
        )
    try:
        raw = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{p}:{e.lineno}: not valid JSON ({e.msg})") from e
    if not isinstance(raw, dict):
        raise ValueError(f"{p}: must be a JSON object")
    return AdapterConfig(raw, p)


def adapter_tensors(adapter_dir: Path) -> dict[str, TensorInfo]:
    """Header of `adapter_model.safetensors` (no data read). Raises HeaderError / FileNotFoundError."""
    return read_safetensors_header(Path(adapter_dir) / WEIGHTS_FILE)
