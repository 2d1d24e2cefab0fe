"""A PEFT LoRA adapter directory: its typed config, its tensors' names, and LoRA scaling.

Key forms (the only ones vLLM's name parser accepts: vllm/lora/utils.py `parse_fine_tuned_lora_name`,
docs/vllm.md), mapped to canonical modules as in `pipeline.artifacts.checkpoint`:
  base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight          (text layout)
  base_model.model.model.language_model.layers.3.mlp.up_proj.lora_B.weight (VL layout)
  base_model.model.lm_head.lora_A.weight
  base_model.model.model.embed_tokens.lora_embedding_A                     (embeddings)
Anything else that names a LoRA tensor (`lora_A.default.weight`, `lora_B.bias`, `lora_A` without
`.weight`) is refused by vLLM at load: `lora_key_form` says which rule it breaks.

adapter_config.json is parsed through one typed schema with the field types PEFT's `LoraConfig`
declares (peft/tuners/lora/config.py); every wrong field is reported, none raises a traceback.

Scaling (vllm/lora/peft_helper.py and peft's LoraLayer): `lora_alpha / r`, or
`lora_alpha / sqrt(r)` with `use_rslora`; `rank_pattern` / `alpha_pattern` override r and
alpha per module, matched like peft (`re.match(rf"(.*\\.)?{key}$", module)`).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError

from pipeline.artifacts.adapter_files import ADAPTER_FILES
from pipeline.artifacts.bounded import BoundsError, load_json_file
from pipeline.artifacts.checkpoint import TEXT_PREFIXES
from pipeline.artifacts.peft_match import peft_targets
from pipeline.artifacts.safetensors import TensorInfo, read_safetensors_header
from pipeline.errors import UsageError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_WEIGHTS = ("adapter_model.bin", "adapter_model.pt", "adapter_model.pth", "pytorch_model.bin")

# A tensor that names a LoRA factor, in any form (accepted or not): module, factor kind, the rest.
LORA_LIKE_RE = re.compile(
    r"(?P<module>.+?)\.(?P<kind>lora_embedding_A|lora_embedding_B|lora_A|lora_B)(?P<rest>(?:\.[^.]+)*)\Z"
)
# The rest vLLM accepts per factor kind (vllm/lora/utils.py parse_fine_tuned_lora_name).
ACCEPTED_REST = {"lora_A": ".weight", "lora_B": ".weight", "lora_embedding_A": "", "lora_embedding_B": ""}


@dataclass(frozen=True)
class LoraKey:
    tensor: str  # the key as stored
    module: str  # canonical, layout-free module, e.g. layers.3.self_attn.q_proj
    kind: str  # "A" or "B"
    embedding: bool
    peft_module: str = ""  # the module as PEFT names it (no `base_model.model.`): patterns match this
    layout: str | None = None  # "text" (model.layers.N), "vl" (model.language_model.layers.N), None otherwise


def lora_key_form(tensor: str) -> str | None:
    """Why vLLM's name parser refuses a LoRA-looking tensor name, or None if it accepts it (or it is no LoRA factor).

    `...lora_A.default.weight` (adapter name left in: saved with the adapter's state_dict instead of
    save_pretrained), `...lora_B.bias` (lora_bias), `...lora_A` without `.weight`, `lora_embedding_A.weight`.
    """
    name = tensor.removeprefix("base_model.model.")
    m = LORA_LIKE_RE.match(name)
    if not m or m.group("rest") == ACCEPTED_REST[m.group("kind")]:
        return None
    rest, kind = m.group("rest"), m.group("kind")
    if rest.endswith(".bias"):
        return f"a {kind} bias tensor (lora_bias): vLLM loads only LoRA weights"
    if rest.count(".") >= 2 or (rest and rest != ".weight" and kind.startswith("lora_embedding")):
        return f"{kind}{rest}: the adapter name is left in the key; vLLM expects {kind}{ACCEPTED_REST[kind]}"
    return f"{kind}{rest}: vLLM expects {kind}{ACCEPTED_REST[kind]}"


def parse_key(tensor: str) -> LoraKey | None:
    """Canonicalise a PEFT tensor key in a form vLLM accepts; None otherwise (see `lora_key_form`)."""
    name = tensor.removeprefix("base_model.model.")
    m = LORA_LIKE_RE.match(name)
    if not m or m.group("rest") != ACCEPTED_REST[m.group("kind")]:
        return None
    module = peft_module = m.group("module")
    layout = None
    for p in TEXT_PREFIXES:
        if module.startswith(p):
            module = module[len(p) :]
            layout = {"model.language_model.": "vl", "language_model.model.": "vl", "model.": "text"}[p]
            break
    if module.startswith("visual."):
        layout = None
    if not module.startswith("layers."):
        layout = None
    kind = m.group("kind")
    return LoraKey(
        tensor,
        module,
        "A" if kind.endswith("A") else "B",
        kind.startswith("lora_embedding"),
        peft_module,
        layout,
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


# -- the typed schema ---------------------------------------------------------------------------------------------
class LoraConfigSchema(BaseModel):
    """The adapter_config.json fields the pipeline and vLLM read, typed as PEFT's `LoraConfig` declares them.

    Strict: `"r": "eight"` or `"r": 8.5` is a wrong type, not coerced; NaN/Infinity are refused for
    every number. Unknown fields pass through (PEFT adds new ones every release); null is accepted everywhere (axolotl writes
    `fan_in_fan_out: null`, and peft loads it as the default).
    """

    model_config = ConfigDict(extra="allow", strict=True)

    peft_type: StrictStr | None = None
    base_model_name_or_path: StrictStr | None = None
    r: StrictInt | None = None
    lora_alpha: float | None = Field(None, allow_inf_nan=False)
    target_modules: list[StrictStr] | StrictStr | None = None
    exclude_modules: list[StrictStr] | StrictStr | None = None
    target_parameters: list[StrictStr] | None = None
    layers_to_transform: list[StrictInt] | StrictInt | None = None
    layers_pattern: list[StrictStr] | StrictStr | None = None
    rank_pattern: dict[str, StrictInt] | None = None
    alpha_pattern: dict[str, float] | None = None
    bias: Literal["none", "all", "lora_only"] | None = "none"
    use_rslora: StrictBool | None = False
    use_dora: StrictBool | None = False
    lora_bias: StrictBool | None = False
    fan_in_fan_out: StrictBool | None = False
    modules_to_save: list[StrictStr] | None = None
    init_lora_weights: StrictBool | StrictStr | None = True
    layer_replication: list[list[StrictInt]] | None = None
    alora_invocation_tokens: list[StrictInt] | None = None
    use_qalora: StrictBool | None = False


# How peft/tuners/lora/config.py declares each field (for messages).
PEFT_TYPES = {
    "peft_type": "str",
    "base_model_name_or_path": "str",
    "r": "int",
    "lora_alpha": "int (a float is accepted)",
    "target_modules": "list[str] | str",
    "exclude_modules": "list[str] | str",
    "target_parameters": "list[str]",
    "layers_to_transform": "list[int] | int",
    "layers_pattern": "list[str] | str",
    "rank_pattern": "dict[str, int]",
    "alpha_pattern": "dict[str, float]",
    "bias": 'Literal["none", "all", "lora_only"]',
    "use_rslora": "bool",
    "use_dora": "bool",
    "lora_bias": "bool",
    "fan_in_fan_out": "bool",
    "modules_to_save": "list[str]",
    "init_lora_weights": "bool | str",
    "layer_replication": "list[tuple[int, int]]",
    "alora_invocation_tokens": "list[int]",
    "use_qalora": "bool",
}


@dataclass(frozen=True)
class ConfigProblem:
    """One wrong field of adapter_config.json. kind: "type" | "nonfinite" | "regex"."""

    field: str
    kind: str
    message: str


def _nonfinite(v) -> bool:
    return isinstance(v, float) and not math.isfinite(v)


def config_problems(raw: dict) -> list[ConfigProblem]:
    """Every field of `raw` that breaks `LoraConfigSchema`, plus regexes PEFT/vLLM would fail to compile."""
    out: list[ConfigProblem] = []
    for k in ("r", "lora_alpha"):
        if _nonfinite(raw.get(k)):
            out.append(ConfigProblem(k, "nonfinite", f"{k} is {raw[k]}: must be a finite number"))
    for k in ("rank_pattern", "alpha_pattern"):
        for key, v in (raw.get(k) or {}).items() if isinstance(raw.get(k), dict) else ():
            if _nonfinite(v):
                out.append(ConfigProblem(f"{k}[{key}]", "nonfinite", f"{k}[{key!r}] is {v}: must be finite"))
    nonfinite_fields = {p.field.split("[")[0] for p in out}
    try:
        LoraConfigSchema.model_validate(raw)
    except ValidationError as e:
        for err in e.errors():
            loc = ".".join(str(x) for x in err["loc"][:2])
            top = str(err["loc"][0]) if err["loc"] else ""
            if top in nonfinite_fields:
                continue
            if any(p.field == loc for p in out if p.kind == "type"):
                continue
            want = PEFT_TYPES.get(top, "another type")
            value = raw.get(top)
            same = [p for p in out if p.kind == "type" and p.field.split(".")[0] == top]
            if same:  # a union's members or several entries of one field: one problem for the field
                out[out.index(same[0])] = ConfigProblem(
                    top, "type", f"{top} = {value!r:.80}: not what PEFT LoraConfig declares ({want})"
                )
                continue
            out.append(
                ConfigProblem(
                    loc, "type", f"{loc} = {value!r:.80}: {err['msg']} (PEFT LoraConfig declares {want})"
                )
            )
    for k, anchored in (("target_modules", "fullmatch"), ("exclude_modules", "fullmatch")):
        if isinstance(raw.get(k), str):
            try:
                re.compile(raw[k])
            except re.error as e:
                out.append(
                    ConfigProblem(
                        k, "regex", f"{k} {raw[k]!r} is not a valid regex ({e}); PEFT {anchored}es it"
                    )
                )
    for k in ("rank_pattern", "alpha_pattern"):
        if isinstance(raw.get(k), dict):
            for key in raw[k]:
                try:
                    re.compile(rf"(.*\.)?({key})$")
                except re.error as e:
                    out.append(
                        ConfigProblem(f"{k}[{key}]", "regex", f"{k} key {key!r} is not a valid regex ({e})")
                    )
    # LoraConfig.__post_init__ (peft/tuners/lora/config.py) refuses these combinations outright.
    if isinstance(raw.get("target_modules"), str):
        for k in ("layers_to_transform", "layers_pattern"):
            if raw.get(k) not in (None, [], ""):
                out.append(
                    ConfigProblem(
                        k,
                        "type",
                        f"{k} cannot be used when target_modules is a regex string "
                        "(PEFT's LoraConfig refuses it)",
                    )
                )
    elif raw.get("layers_pattern") not in (None, [], "") and raw.get("layers_to_transform") in (None, []):
        out.append(
            ConfigProblem(
                "layers_pattern",
                "type",
                "layers_pattern is set without layers_to_transform (PEFT's LoraConfig refuses it)",
            )
        )
    lp = raw.get("layers_pattern")
    for p in [lp] if isinstance(lp, str) else lp if isinstance(lp, list) else []:
        if isinstance(p, str):
            try:
                re.compile(p)
            except re.error as e:
                out.append(
                    ConfigProblem(
                        "layers_pattern", "regex", f"layers_pattern {p!r} is not a valid regex ({e})"
                    )
                )
    return out


class AdapterConfigError(UsageError, ValueError):
    """adapter_config.json is not JSON, not an object, or has fields of the wrong type."""

    def __init__(self, message: str, problems: list[ConfigProblem] | None = None):
        super().__init__(message)
        self.problems = problems or []


@dataclass
class AdapterConfig:
    raw: dict
    path: Path
    problems: list[ConfigProblem] = field(default_factory=list)

    @property
    def r(self) -> int:
        r = self.raw.get("r")
        return r if isinstance(r, int) and not isinstance(r, bool) else 0

    @property
    def lora_alpha(self) -> float:
        a = self.raw.get("lora_alpha", self.r)
        return float(a) if isinstance(a, (int, float)) and not isinstance(a, bool) else float(self.r)

    @property
    def use_rslora(self) -> bool:
        return self.raw.get("use_rslora") is True

    def rank_for(self, module: str) -> int:
        return int(pattern_value(self.raw.get("rank_pattern"), module, self.r))

    def alpha_for(self, module: str) -> float:
        return float(pattern_value(self.raw.get("alpha_pattern"), module, self.lora_alpha))

    def scale_for(self, module: str) -> float:
        """LoRA output scale for `module` (dimensionless) as PEFT applies it (patterns honoured); 0 for r <= 0."""
        r, a = self.rank_for(module), self.alpha_for(module)
        if r <= 0:
            return 0.0
        return a / math.sqrt(r) if self.use_rslora else a / r

    def global_scale(self) -> float:
        """The scale a vLLM that ignores rank_pattern/alpha_pattern applies to every module."""
        if self.r <= 0:
            return 0.0
        return self.lora_alpha / math.sqrt(self.r) if self.use_rslora else self.lora_alpha / self.r

    @property
    def target_modules(self) -> list[str]:
        """Declared targets as a list; a regex string (peft's other form) is returned as [regex]."""
        t = self.raw.get("target_modules") or []
        return [t] if isinstance(t, str) else list(t)

    def targets(self, module: str) -> bool:
        """Whether peft would target `module` (a PEFT module name): `pipeline.artifacts.peft_match`."""
        return peft_targets(self.raw, module)


def read_adapter_config(adapter_dir: Path) -> AdapterConfig:
    """Read `adapter_config.json` and type-check it; problems are listed on the result, not raised.

    Raises FileNotFoundError (absent, or not a regular file) or AdapterConfigError (not a JSON
    object), naming the file and line.
    """
    p = Path(adapter_dir) / CONFIG_FILE
    if p.is_symlink() or not p.is_file():
        raise FileNotFoundError(
            f"{p}: missing (or not a regular file); an adapter directory needs adapter_config.json "
            "(PEFT save_pretrained writes it)"
        )
    try:
        raw = load_json_file(p, ADAPTER_FILES[CONFIG_FILE])
    except BoundsError as e:
        raise AdapterConfigError(str(e)) from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        line = getattr(e, "lineno", None)
        raise AdapterConfigError(f"{p}:{line or 1}: not valid JSON ({getattr(e, 'msg', e)})") from e
    if not isinstance(raw, dict):
        raise AdapterConfigError(f"{p}: must be a JSON object")
    return AdapterConfig(raw, p, config_problems(raw))


def load_adapter_config(adapter_dir: Path) -> AdapterConfig:
    """Read `adapter_config.json`, refusing wrong field types.

    Raises FileNotFoundError (absent) or AdapterConfigError (a ValueError: not JSON, not an object,
    or fields of the wrong type, every one listed), naming the file and line.
    """
    cfg = read_adapter_config(adapter_dir)
    if cfg.problems:
        raise AdapterConfigError(
            f"{cfg.path}: "
            + "; ".join(p.message for p in cfg.problems)
            + ": fix the field or re-save with peft",
            cfg.problems,
        )
    return cfg


def adapter_tensors(adapter_dir: Path) -> dict[str, TensorInfo]:
    """Header of `adapter_model.safetensors` (no data read). Raises HeaderError / FileNotFoundError."""
    return read_safetensors_header(Path(adapter_dir) / WEIGHTS_FILE)
