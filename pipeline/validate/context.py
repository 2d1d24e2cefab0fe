"""The facts one validation establishes once and its checks share (read lazily, each at most once).

A property raises `Unavailable` when its fact cannot be established (no base given, unreadable
weights...): the check that needed it is skipped, and the missing fact itself is reported by the check
that owns it (`base.unreadable`, `weights.header`...). Only headers of the base and served
checkpoints are read; adapter tensors are read through one memory map.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from pipeline.artifacts.adapter import (
    CONFIG_FILE,
    PICKLE_WEIGHTS,
    WEIGHTS_FILE,
    AdapterConfig,
    AdapterConfigError,
    lora_key_form,
    parse_key,
    read_adapter_config,
)
from pipeline.artifacts.checkpoint import LAYER_RE, Checkpoint, read_checkpoint
from pipeline.artifacts.hashing import DirectoryScan, scan_directory, sha256_file
from pipeline.artifacts.manifest import MANIFEST, read_manifest
from pipeline.artifacts.safetensors import HeaderError, TensorInfo, file_metadata, read_safetensors_header
from pipeline.serving.versions import UnknownVllmVersion, VllmRange, rules_for
from pipeline.serving.vllm import ALLOWED_DTYPES, QWEN35_MODULES
from pipeline.validate import template
from pipeline.validate.chat import ChatTokenizer, TokenizerError, has_tokenizer
from pipeline.validate.lora_view import LoraView
from pipeline.validate.report import FleetRules, ValidationReport
from pipeline.validate.rules import Unavailable
from pipeline.validate.template import TemplateFacts


@dataclass
class Options:
    behaviour: bool = False
    fold_rslora: bool = False
    validation_files: list[Path] | None = None
    training_config: Path | None = None
    allow: frozenset[str] = frozenset()


@dataclass
class ModuleEntry:
    """One adapted module: its A/B (and bias) tensors as stored."""

    module: str  # canonical, layout-free (layers.3.self_attn.q_proj, lm_head, visual...)
    peft_module: str  # as PEFT names it (model.layers.3.self_attn.q_proj)
    layout: str | None
    a: TensorInfo | None = None
    b: TensorInfo | None = None

    @property
    def layer(self) -> int | None:
        m = LAYER_RE.match(self.module)
        return int(m.group(1)) if m else None

    @property
    def sub(self) -> str | None:
        m = LAYER_RE.match(self.module)
        return m.group(2) if m else None

    @property
    def head(self) -> str:
        return self.module.split(".")[0]

    @property
    def rank(self) -> int | None:
        return self.a.shape[0] if self.a is not None and len(self.a.shape) == 2 else None


@dataclass
class Context(TemplateFacts):
    adapter_dir: Path
    base_dir: Path | None
    rules: FleetRules
    served_dir: Path | None
    report: ValidationReport
    options: Options = field(default_factory=Options)
    rejected: set[str] = field(default_factory=set)  # modules a keys check refused: later checks skip them
    lora_source_kind = "adapter"

    @property
    def where_config(self) -> str:
        return str(self.adapter_dir / CONFIG_FILE)

    @property
    def wfile(self) -> Path:
        return self.adapter_dir / WEIGHTS_FILE

    # -- the directory ------------------------------------------------------------------------------------------
    @cached_property
    def scan(self) -> DirectoryScan:
        try:
            return scan_directory(self.adapter_dir)
        except OSError as e:
            raise Unavailable from e

    def _regular(self, name: str) -> bool:
        p = self.adapter_dir / name
        return p in self.scan.files

    # -- adapter_config.json ---------------------------------------------------------------------------------------
    @cached_property
    def _config(self) -> tuple[AdapterConfig | None, str | None, str | None]:
        """(config, error kind "missing"|"invalid", message)."""
        _ = self.scan
        try:
            return read_adapter_config(self.adapter_dir), None, None
        except FileNotFoundError as e:
            return None, "missing", str(e)
        except AdapterConfigError as e:
            return None, "invalid", str(e)
        except OSError as e:
            return None, "invalid", f"{self.where_config}: cannot be read ({e})"

    @property
    def cfg(self) -> AdapterConfig:
        """adapter_config.json as read (fields may have wrong types: see `typed_cfg`)."""
        cfg = self._config[0]
        if cfg is None:
            raise Unavailable
        return cfg

    @property
    def typed_cfg(self) -> AdapterConfig:
        """adapter_config.json when every field has PEFT's type (regexes compile, numbers finite)."""
        cfg = self.cfg
        if cfg.problems:
            raise Unavailable
        return cfg

    @property
    def lora(self) -> LoraView:
        return LoraView.from_adapter_config(self.typed_cfg)

    # -- fleet version -----------------------------------------------------------------------------------------------
    @cached_property
    def _vllm(self) -> tuple[VllmRange | None, str | None]:
        if not self.rules.vllm_version:
            return None, "fleet.vllm_version is empty: set it to what the instances run (`GET /version`)"
        try:
            return rules_for(self.rules.vllm_version), None
        except UnknownVllmVersion as e:
            return None, str(e)

    @property
    def vllm(self) -> VllmRange:
        rng = self._vllm[0]
        if rng is None:
            raise Unavailable
        return rng

    # -- the weights file --------------------------------------------------------------------------------------------
    @cached_property
    def weights_state(self) -> tuple[str, str]:
        """(state, detail): ok | missing | pickle | ambiguous | not_file | unreadable | header | empty."""
        w = self.wfile
        pickles = [p for p in PICKLE_WEIGHTS if (self.adapter_dir / p).exists()]
        if (w.exists() or w.is_symlink()) and not self._regular(WEIGHTS_FILE):
            kind = "a directory" if w.is_dir() and not w.is_symlink() else "a symlink or special file"
            return "not_file", kind
        if pickles and w.exists():
            return "ambiguous", pickles[0]
        if pickles:
            return "pickle", pickles[0]
        if not w.exists():
            return "missing", ""
        try:
            header = read_safetensors_header(w)
        except HeaderError as e:
            return "header", str(e)
        except OSError as e:
            return "unreadable", f"{w}: cannot be read ({e})"
        if not header:
            return "empty", ""
        self.__dict__["header"] = header
        return "ok", ""

    @property
    def header(self) -> dict[str, TensorInfo]:
        if self.weights_state[0] != "ok":
            raise Unavailable
        return self.__dict__["header"]

    @cached_property
    def weights_sha256(self) -> str:
        _ = self.header
        return sha256_file(self.wfile)

    @cached_property
    def metadata(self) -> dict | None:
        _ = self.header
        return file_metadata(self.wfile)

    # -- tensors by module -------------------------------------------------------------------------------------------
    @cached_property
    def unknown_tensors(self) -> list[str]:
        """Tensors that are no LoRA factor at all."""
        return [n for n in self.header if parse_key(n) is None and lora_key_form(n) is None]

    @cached_property
    def malformed_tensors(self) -> dict[str, str]:
        """LoRA-looking tensors in a form vLLM refuses: {tensor: why}."""
        return {n: why for n in self.header if (why := lora_key_form(n)) is not None}

    @cached_property
    def modules(self) -> list[ModuleEntry]:
        """Every module with at least one A/B tensor in an accepted key form, sorted."""
        out: dict[tuple[str, str], ModuleEntry] = {}
        for name, info in self.header.items():
            k = parse_key(name)
            if k is None:
                continue
            e = out.setdefault((k.module, k.peft_module), ModuleEntry(k.module, k.peft_module, k.layout))
            setattr(e, k.kind.lower(), info)
        return sorted(out.values(), key=lambda e: (e.module, e.peft_module))

    def live(self) -> list[ModuleEntry]:
        """Modules no keys check has refused yet."""
        return [m for m in self.modules if m.peft_module not in self.rejected]

    def reject(self, m: ModuleEntry) -> None:
        self.rejected.add(m.peft_module)

    # -- base and served checkpoints --------------------------------------------------------------------------------
    @cached_property
    def _base(self) -> tuple[Checkpoint | None, str | None]:
        if self.base_dir is None:
            return None, None
        try:
            return read_checkpoint(Path(self.base_dir)), None
        except (FileNotFoundError, ValueError, OSError) as e:
            return None, str(e)

    @property
    def base(self) -> Checkpoint:
        b = self._base[0]
        if b is None:
            raise Unavailable
        return b

    @cached_property
    def _served(self) -> tuple[Checkpoint | None, str | None]:
        if self.served_dir is None:
            return None, None
        try:
            return read_checkpoint(Path(self.served_dir)), None
        except (FileNotFoundError, ValueError, OSError) as e:
            return None, str(e)

    @property
    def served(self) -> Checkpoint:
        s = self._served[0]
        if s is None:
            raise Unavailable
        return s

    @property
    def served_architecture(self) -> str | None:
        arch = self.served.config.get("architectures") or [None]
        return arch[0]

    def allowed_modules(self, layer: int) -> set[str]:
        """Modules vLLM can patch on `layer` of the base (by layer type)."""
        types = self.base.layer_types
        lt = types[layer] if layer < len(types) else "full_attention"
        return QWEN35_MODULES.get(lt, set()) | QWEN35_MODULES["any"]

    # -- manifest ---------------------------------------------------------------------------------------------------
    @cached_property
    def _manifest(self) -> tuple[dict | None, str | None]:
        """(manifest, why it could not be read): (None, None) when there is none."""
        if (self.adapter_dir / MANIFEST) not in self.scan.files:  # never open a FIFO or follow a link
            return None, None
        try:
            return read_manifest(self.adapter_dir), None
        except (FileNotFoundError, ValueError, OSError) as e:
            return None, str(e)

    @property
    def manifest(self) -> dict | None:
        return self._manifest[0]

    @property
    def manifest_problem(self) -> str | None:
        """Why manifest.json could not be read (not JSON, wrong fields), or None."""
        return self._manifest[1]

    @property
    def published(self) -> bool:
        """The directory is a published version (what the fleet loads): fixable problems are errors here."""
        return bool(self.manifest and "published" in self.manifest)

    # -- tensor values ----------------------------------------------------------------------------------------------
    @cached_property
    def data(self):
        import numpy as np

        _ = self.header
        return np.memmap(self.wfile, dtype=np.uint8, mode="r")

    def values(self, info: TensorInfo):
        """A tensor's values as float32 numpy [shape] (bf16 widened exactly)."""
        import numpy as np

        raw = self.data[info.offset : info.offset + info.nbytes]
        if info.dtype == "BF16":  # bf16 is the top half of an fp32: write it there, zero the low half
            out = np.zeros(info.nbytes // 2, dtype=np.float32)
            out.view(np.uint16)[1::2] = raw.view(np.uint16)
        elif info.dtype == "F16":
            out = raw.view(np.float16).astype(np.float32)
        else:
            out = np.asarray(raw.view(np.float32))
        return out.reshape(info.shape)

    @cached_property
    def nonfinite(self) -> dict[str, int]:
        """{tensor: NaN/Inf count} over float tensors of an allowed dtype (raw bits: exponent all ones)."""
        import numpy as np

        out = {}
        for name, info in self.header.items():
            if info.dtype not in ALLOWED_DTYPES:
                continue
            raw = self.data[info.offset : info.offset + info.nbytes]
            if info.dtype == "F32":
                n = int(raw.view(np.float32).size - np.isfinite(raw.view(np.float32)).sum())
            else:
                u = raw.view(np.uint16)
                exp = 0x7F80 if info.dtype == "BF16" else 0x7C00
                n = int(np.count_nonzero((u & exp) == exp))
            if n:
                out[name] = n
        return out

    def configured_rank(self, m: ModuleEntry) -> int | None:
        """`r` (or its rank_pattern entry) for `m`, or None when the config cannot say."""
        try:
            return self.typed_cfg.rank_for(m.peft_module)
        except (Unavailable, TypeError, ValueError):
            return None

    def scale(self, m: ModuleEntry) -> float:
        """The scale PEFT trained `m` with (rank_pattern/alpha_pattern honoured)."""
        try:
            return self.typed_cfg.scale_for(m.peft_module)
        except Unavailable:
            return 1.0

    @cached_property
    def update_norms(self) -> dict[str, float]:
        """{peft module: ||scale * B @ A||_F} for complete, finite, 2-D pairs (computed from two r x r Grams)."""
        out = {}
        for m in self.live():
            if m.a is None or m.b is None or len(m.a.shape) != 2 or len(m.b.shape) != 2:
                continue
            if m.a.name in self.nonfinite or m.b.name in self.nonfinite:
                continue
            if (r := self.configured_rank(m)) is not None and r < 1:
                continue  # `r` <= 0: config.rank says so once; the scale (0) would call every module dead
            if (
                m.a.dtype not in ALLOWED_DTYPES
                or m.b.dtype not in ALLOWED_DTYPES
                or m.b.shape[1] != m.a.shape[0]
            ):
                continue
            a, b = self.values(m.a).astype("float64"), self.values(m.b).astype("float64")
            sq = float(((b.T @ b) * (a @ a.T)).sum())
            out[m.peft_module] = abs(self.scale(m)) * math.sqrt(max(sq, 0.0))
        return out

    # -- tokenizer and template (TemplateFacts) ---------------------------------------------------------------------
    @cached_property
    def adapter_tokenizer(self):
        """(ChatTokenizer | None, error | None) of tokenizer files shipped with the adapter."""
        if (
            not has_tokenizer(self.adapter_dir)
            or (self.adapter_dir / "tokenizer.json") not in self.scan.files
        ):
            return None, None
        try:
            return ChatTokenizer.load(self.adapter_dir), None
        except (TokenizerError, OSError) as e:
            return None, str(e)

    @property
    def training_where(self) -> str:
        return str(self.options.training_config or self.adapter_dir)

    def _training_side(self):
        side = template.training_side(self.adapter_dir, self.options.training_config, self.base_dir)
        return side, None, self.training_where

    def _added_tokens(self):
        atok, served = self.adapter_tokenizer[0], self.served_tokenizer[0]
        if atok is None or served is None:
            return [], ""
        s_added = served.added()
        added = sorted((t, i) for t, i in atok.added().items() if t not in s_added)
        return added, str(self.adapter_dir / "tokenizer.json")

    @property
    def template_unchecked(self) -> str | None:
        if self.training[0] is None and self.training[1] is None:
            return (
                "no training template found (no resolved axolotl config, no chat template or tokenizer files with "
                "the adapter): tokenizer and chat template not compared; pass --training-config"
            )
        if self.served_tokenizer[0] is None and self.served_tokenizer[1] is None:
            return "no served or base tokenizer available: tokenizer and chat template not compared"
        return None
