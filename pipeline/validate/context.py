"""The facts one validation of an adapter directory establishes once and its checks share (read lazily,
each at most once): `Context` provides `pipeline.validate.facts.AdapterFacts`.

A property raises `Unavailable` when its fact cannot be established (no base given, unreadable
weights...): the check that needed it is skipped, and the missing fact itself is reported by the check
that owns it (`base.unreadable`, `weights.header`...). Only headers of the base and served
checkpoints are read; adapter tensors are read through one memory map.
"""

from __future__ import annotations

import math
import os
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
from pipeline.artifacts.bounded import load_json_file
from pipeline.artifacts.checkpoint import GEOMETRY_KEYS, LAYER_RE
from pipeline.artifacts.hashing import DirectoryScan, scan_directory, sha256_file
from pipeline.artifacts.manifest import MANIFEST, AdapterManifest, read_adapter_manifest
from pipeline.artifacts.normalise import FoldResult, ParityError, fold_rslora
from pipeline.artifacts.peft_match import peft_targets
from pipeline.artifacts.safetensors import (
    DTYPE_BYTES,
    HeaderError,
    TensorInfo,
    file_metadata,
    raw_header,
    read_safetensors_header,
)
from pipeline.errors import PipelineError
from pipeline.serving.vllm import ALLOWED_DTYPES, BASE_EMBEDDING_SUFFIXES, QWEN35_MODULES
from pipeline.validate import behaviour as behaviour_eval
from pipeline.validate import template
from pipeline.validate.chat import SPECIAL_KEYS, ChatTokenizer, TokenizerError, has_tokenizer
from pipeline.validate.facts import CheckpointFacts, Fact, Unavailable
from pipeline.validate.lora_view import LoraView
from pipeline.validate.report import FleetRules, ValidationReport
from pipeline.validate.template import AddedTokens, TemplateFacts


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


# Machine epsilon (gap between 1 and the next value) of the dtypes the engine computes in.
EFFECT_EPS = {"bfloat16": 2.0**-7, "float16": 2.0**-10, "float32": 2.0**-23}
BASE_SAMPLE_ROWS = 8
PEAK_EXACT_ABOVE = 1024.0  # below every dtype's largest value (fp16: 65504): a bound under it is exact enough


def sampled_frobenius(path: Path, info: TensorInfo, rows: int = BASE_SAMPLE_ROWS) -> float | None:
    """||W||_F of a 2-D bf16/fp16/fp32 tensor estimated from `rows` rows spread evenly over it (one `pread`
    each: a memory map of a 27B shard costs ~70 ms per module in page-fault read-ahead, measured)."""
    import numpy as np

    out_f, in_f = info.shape
    per = {"BF16": 2, "F16": 2, "F32": 4}[info.dtype]
    picks = sorted({int(i) for i in np.linspace(0, out_f - 1, min(rows, out_f))})
    sq = 0.0
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        for i in picks:
            raw = os.pread(fd, in_f * per, info.offset + i * in_f * per)
            if len(raw) != in_f * per:
                return None
            if info.dtype == "BF16":  # bf16 is the top half of an fp32
                v = (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
            else:
                v = np.frombuffer(raw, dtype="<f2" if info.dtype == "F16" else "<f4").astype(np.float32)
            sq += float(np.dot(v, v))
    except OSError:
        return None
    finally:
        os.close(fd)
    if not picks or not math.isfinite(sq):  # a non-finite base weight: no norm to compare with
        return None
    return (sq / len(picks) * out_f) ** 0.5


def _row(data, info: TensorInfo, i: int):
    """Row `i` of a 2-D float tensor of the memory-mapped weights file, as float32."""
    import numpy as np

    per = {"BF16": 2, "F16": 2, "F32": 4}[info.dtype]
    n = info.shape[1] * per
    return _floats(np.asarray(data[info.offset + i * n : info.offset + (i + 1) * n]).tobytes(), info.dtype)


def _pread_row(path: Path, info: TensorInfo, i: int):
    per = {"BF16": 2, "F16": 2, "F32": 4}[info.dtype]
    n = info.shape[1] * per
    try:
        with open(path, "rb") as f:
            raw = os.pread(f.fileno(), n, info.offset + i * n)
    except OSError:
        return None
    return _floats(raw, info.dtype) if len(raw) == n else None


def _floats(raw: bytes, dtype: str):
    import numpy as np

    if dtype == "BF16":
        return (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
    return np.frombuffer(raw, dtype="<f2" if dtype == "F16" else "<f4").astype(np.float32)


def _round_to(v, dtype: str):
    """float32 values rounded to `dtype` (round to nearest even), back in float32."""
    import numpy as np

    if v is None or dtype == "F32":
        return v
    if dtype == "F16":
        return v.astype(np.float16).astype(np.float32)
    u = v.view(np.uint32)
    return (((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16).astype(np.uint32).view(np.float32)


def config_tokens(d: Path, regular=None) -> dict[str, list[str]]:
    """{file: token strings} that transformers adds to a tokenizer from the files next to tokenizer.json:
    `added_tokens.json` {token: id}, `special_tokens_map.json` values (additional_special_tokens included),
    tokenizer_config.json's special tokens (`eos_token`, `pad_token`...), `extra_special_tokens` and
    `added_tokens_decoder` (transformers 5 adds each one missing from the vocabulary: tokenization_utils_base.py
    `from_pretrained`). `regular(path)` says which files may be read (default: regular files, no links)."""

    regular = regular or (lambda p: p.is_file() and not p.is_symlink())
    out: dict[str, list[str]] = {}
    for name in ("added_tokens.json", "special_tokens_map.json", "tokenizer_config.json"):
        p = Path(d) / name
        if not regular(p):
            continue
        try:  # within size, depth and number bounds (a BoundsError is a ValueError)
            data = load_json_file(p, 16 << 20)
        except (OSError, ValueError):
            continue
        if not isinstance(data, dict):
            continue
        if name == "added_tokens.json":
            values = list(data)
        elif name == "special_tokens_map.json":
            values = list(data.values())
        else:
            extra, decoder = data.get("extra_special_tokens"), data.get("added_tokens_decoder")
            values = [data.get(k) for k in SPECIAL_KEYS]
            values += list(extra.values()) if isinstance(extra, dict) else [extra]
            values += list(decoder.values()) if isinstance(decoder, dict) else []
        tokens: list[str] = []
        for v in values:
            for x in v if isinstance(v, list) else [v]:
                text = x.get("content") if isinstance(x, dict) else x
                if isinstance(text, str):
                    tokens.append(text)
        out[name] = tokens
    return out


@dataclass(frozen=True)
class WeightsState:
    """The weights file: state ok | missing | pickle | ambiguous | not_file | unreadable | header | empty."""

    state: str
    detail: str = ""


@dataclass
class Context(CheckpointFacts, TemplateFacts):
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
    def config_fact(self) -> Fact[AdapterConfig]:
        """adapter_config.json, or why not (reason "missing" | "invalid")."""
        _ = self.scan
        try:
            return Fact(read_adapter_config(self.adapter_dir))
        except FileNotFoundError as e:
            return Fact(None, str(e), "missing")
        except AdapterConfigError as e:
            return Fact(None, str(e), "invalid")
        except OSError as e:
            return Fact(None, f"{self.where_config}: cannot be read ({e})", "invalid")

    @property
    def cfg(self) -> AdapterConfig:
        """adapter_config.json as read (fields may have wrong types: see `typed_cfg`)."""
        return self.config_fact.get()

    @property
    def lora_problems(self) -> list:
        """Fields whose type or value PEFT's LoraConfig refuses (artifacts.adapter.config_problems)."""
        return self.cfg.problems

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

    @property
    def stats(self) -> dict:
        return self.report.stats

    # -- the weights file --------------------------------------------------------------------------------------------
    @cached_property
    def _header_fact(self) -> tuple[WeightsState, dict[str, TensorInfo] | None]:
        w = self.wfile
        pickles = [p for p in PICKLE_WEIGHTS if (self.adapter_dir / p).exists()]
        if (w.exists() or w.is_symlink()) and not self._regular(WEIGHTS_FILE):
            kind = "a directory" if w.is_dir() and not w.is_symlink() else "a symlink or special file"
            return WeightsState("not_file", kind), None
        if pickles and w.exists():
            return WeightsState("ambiguous", pickles[0]), None
        if pickles:
            return WeightsState("pickle", pickles[0]), None
        if not w.exists():
            return WeightsState("missing"), None
        try:
            header = read_safetensors_header(w)
        except HeaderError as e:
            return WeightsState("header", str(e)), None
        except OSError as e:
            return WeightsState("unreadable", f"{w}: cannot be read ({e})"), None
        if not header:
            return WeightsState("empty"), None
        return WeightsState("ok"), header

    @property
    def weights_state(self) -> WeightsState:
        return self._header_fact[0]

    @property
    def header(self) -> dict[str, TensorInfo]:
        header = self._header_fact[1]
        if header is None:
            raise Unavailable
        return header

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
        """Tensors that are no LoRA factor at all (nor a base embedding copy vLLM skips: `base_copies`)."""
        return [
            n
            for n in self.header
            if parse_key(n) is None and lora_key_form(n) is None and n not in self.base_copies
        ]

    @cached_property
    def base_copies(self) -> dict[str, TensorInfo]:
        """peft's copies of the base embed_tokens / lm_head weight (`...embed_tokens.base_layer.weight`), which vLLM
        skips at load (vllm/lora/utils.py is_base_embedding_weights): {tensor: info}."""
        return {n: i for n, i in self.header.items() if n.endswith(BASE_EMBEDDING_SUFFIXES)}

    def base_copy_difference(self, name: str) -> str | None:
        """How a base copy differs from the base's own weight (shape, or values in sampled rows compared in the
        coarser of the two dtypes), or None when it is the base's weight. Unavailable without a base."""
        import numpy as np

        info = self.header[name]
        module = "embed_tokens" if name.endswith(".embed_tokens.base_layer.weight") else "lm_head"
        base = self.base
        w = base.modules.get(module) or (base.modules.get("embed_tokens") if module == "lm_head" else None)
        if w is None:
            return f"the base has no {module} weight"
        if list(info.shape) != list(w.shape):
            return f"shape {list(info.shape)} vs the base's {module} {list(w.shape)}"
        if info.dtype not in ALLOWED_DTYPES or w.dtype not in ALLOWED_DTYPES or len(w.shape) != 2:
            return None if info.dtype == w.dtype else f"dtype {info.dtype} vs the base's {w.dtype}"
        rows, cols = w.shape
        picks = sorted({int(i) for i in np.linspace(0, rows - 1, min(BASE_SAMPLE_ROWS * 4, rows))})
        coarse = min((info.dtype, w.dtype), key=lambda d: {"BF16": 0, "F16": 1, "F32": 2}[d])
        for i in picks:
            mine = _round_to(_row(self.data, info, i), coarse)
            theirs = _round_to(_pread_row(base.path / w.file, w, i), coarse)
            if theirs is None:
                return None  # the base cannot be read here: base.unreadable says so
            if not np.array_equal(mine, theirs, equal_nan=True):
                return f"row {i} differs from the base's {module} (first of the sampled rows that do)"
        return None

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

    # -- base and served checkpoints (CheckpointFacts) ---------------------------------------------------------------
    @property
    def modules_or_none(self) -> list[ModuleEntry] | None:
        return self.modules

    @cached_property
    def served_geometry_diffs(self) -> list[str]:
        """Text geometry keys (hidden size, layers, heads...) in which the served checkpoint differs from the base."""
        base, served = self.base, self.served
        return [
            f"{k}: base {base.text_config.get(k)!r} vs served {served.text_config.get(k)!r}"
            for k in GEOMETRY_KEYS
            if k in base.text_config
            and k in served.text_config
            and base.text_config[k] != served.text_config[k]
        ]

    @cached_property
    def base_layer_modules(self) -> list[set[str]]:
        """Module paths within each decoder layer of the base (`Checkpoint.layer_modules` for every layer, in one
        pass over its modules)."""
        base = self.base
        out: list[set[str]] = [set() for _ in range(base.num_layers)]
        for name in base.modules:
            mm = LAYER_RE.match(name)
            if mm and int(mm.group(1)) < base.num_layers:
                out[int(mm.group(1))].add(mm.group(2))
        return out

    def allowed_modules(self, layer: int) -> set[str]:
        """Modules vLLM can patch on `layer` of the base (by layer type)."""
        types = self.base.layer_types
        lt = types[layer] if layer < len(types) else "full_attention"
        return QWEN35_MODULES.get(lt, set()) | QWEN35_MODULES["any"]

    # -- manifest ---------------------------------------------------------------------------------------------------
    @cached_property
    def manifest_fact(self) -> Fact[AdapterManifest]:
        """manifest.json, or why it could not be read; an empty fact when there is none."""
        if (self.adapter_dir / MANIFEST) not in self.scan.files:  # never open a FIFO or follow a link
            return Fact()
        return Fact.of(
            lambda: read_adapter_manifest(self.adapter_dir), FileNotFoundError, ValueError, OSError
        )

    @property
    def manifest(self) -> AdapterManifest | None:
        return self.manifest_fact.value

    @property
    def manifest_problem(self) -> str | None:
        """Why manifest.json could not be read (not JSON, wrong fields), or None."""
        return self.manifest_fact.missing

    @property
    def published(self) -> bool:
        """The directory is a published version (what the fleet loads): fixable problems are errors here."""
        return self.manifest is not None and self.manifest.published is not None

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
        if info.dtype == "BF16":  # bf16 is the top half of an fp32: shift it there, zero the low half
            out = (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)
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
    def module_values(self) -> tuple[dict[str, float], dict[str, float]]:
        """({peft module: ||scale * B @ A||_F}, {peft module: the largest magnitude vLLM stores for it, max |A| and
        max |B| x |scale| (lora/lora_weights.py optimize() folds the scale into B): exact from PEAK_EXACT_ABOVE up,
        below it an upper bound from the Grams' diagonals}) for complete, finite, 2-D pairs; the norm from two
        r x r Grams. One read of each tensor."""
        norms, peaks = {}, {}
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
            a, b = self.values(m.a), self.values(m.b)  # float32: the Grams are r x r
            scale = abs(self.scale(m))
            ga, gb = a @ a.T, b.T @ b
            sq = float((gb * ga).sum())
            if not math.isfinite(sq):  # float32 overflow on huge (finite) values: redo in float64
                a, b = a.astype("float64"), b.astype("float64")
                ga, gb = a @ a.T, b.T @ b
                sq = float((gb * ga).sum())
            norms[m.peft_module] = scale * math.sqrt(max(sq, 0.0))
            if a.size and b.size:
                # a row norm of A (a column norm of B) bounds its largest element: read the Grams' diagonals,
                # and the elements themselves only when the bound comes near a dtype's range
                peaks[m.peft_module] = bound = max(
                    math.sqrt(max(float(ga.diagonal().max()), 0.0)),
                    math.sqrt(max(float(gb.diagonal().max()), 0.0)) * scale,
                )
                if not bound < PEAK_EXACT_ABOVE:
                    peaks[m.peft_module] = max(
                        float(a.max()), -float(a.min()), max(float(b.max()), -float(b.min())) * scale
                    )
        return norms, peaks

    @property
    def update_norms(self) -> dict[str, float]:
        """{peft module: ||scale * B @ A||_F} (`module_values`)."""
        return self.module_values[0]

    @property
    def value_peaks(self) -> dict[str, float]:
        """{peft module: max |A| and max |scale x B| (an upper bound when below PEAK_EXACT_ABOVE): `module_values`."""
        return self.module_values[1]

    @cached_property
    def expected_weights(self) -> tuple[int | None, int]:
        """(bytes the weights file should hold, LoRA parameters) from r (+rank_pattern), PEFT's matching of
        target_modules and the base's shapes, in the file's dominant dtype; (None, 0) when `r` says nothing."""
        cfg, base, header = self.typed_cfg, self.base, self.header
        if not cfg.r or cfg.r < 1:  # config.rank reports it; no size follows from it
            return None, 0
        dtypes = [t.dtype for t in header.values()]
        per = DTYPE_BYTES.get(max(set(dtypes), key=dtypes.count), 2) if dtypes else 2
        layouts = {m.layout for m in self.modules if m.layout}
        prefix = "model.language_model." if layouts == {"vl"} else "model."
        params = 0
        for i in range(base.num_layers):
            for sub in self.base_layer_modules[i] & self.allowed_modules(i):
                name = f"{prefix}layers.{i}.{sub}"
                if peft_targets(cfg.raw, name) and (shape := base.linear_shape(f"layers.{i}.{sub}")):
                    params += cfg.rank_for(name) * (shape[0] + shape[1])
        return params * per + raw_header(self.wfile)[0], params

    @property
    def expected_weights_bytes(self) -> int | None:
        expected, params = self.expected_weights
        return expected if params else None

    @cached_property
    def serving_dtype(self) -> str:
        """The dtype the engine computes module outputs in: the served (else base) checkpoint's `torch_dtype`
        / `dtype` (vLLM --dtype auto; NVFP4 checkpoints compute in bf16), bfloat16 when neither says."""
        for ck in (self.served_fact.value, self.base_fact.value):
            if ck is not None:
                d = (
                    ck.config.get("torch_dtype")
                    or ck.config.get("dtype")
                    or ck.text_config.get("torch_dtype")
                )
                if isinstance(d, str) and d in EFFECT_EPS:
                    return d
        return "bfloat16"

    @cached_property
    def relative_effect(self) -> dict[str, float]:
        """{peft module: ||scale * B @ A||_F / ||W||_F} against the bf16 base weight W of the module.

        ||W||_F is estimated from `BASE_SAMPLE_ROWS` rows spread over W ([out, in], row RMS x sqrt(out)):
        a few hundred KB per module instead of the whole base. Modules whose base weight is not a readable
        float matrix, or is all zero, are left out."""
        out = {}
        base = self.base
        for m in self.live():
            n = self.update_norms.get(m.peft_module)
            info = base.modules.get(m.module)
            if n is None or info is None or len(info.shape) != 2 or info.dtype not in ALLOWED_DTYPES:
                continue
            w = sampled_frobenius(base.path / info.file, info)
            if w:
                out[m.peft_module] = n / w
        return out

    # -- tokenizer and template (TemplateFacts) ---------------------------------------------------------------------
    @cached_property
    def adapter_tokenizer(self) -> Fact[ChatTokenizer]:
        """The tokenizer files shipped with the adapter (an empty fact when there are none)."""
        if (
            not has_tokenizer(self.adapter_dir)
            or (self.adapter_dir / "tokenizer.json") not in self.scan.files
        ):
            return Fact()
        return Fact.of(lambda: ChatTokenizer.load(self.adapter_dir), TokenizerError, OSError)

    @property
    def training_where(self) -> str:
        return str(self.options.training_config or self.adapter_dir)

    def _training_side(self):
        return template.training_side(self.adapter_dir, self.options.training_config, self.base_dir)

    def _added_tokens(self) -> AddedTokens:
        """Tokens the adapter's tokenizer files add that the served tokenizer lacks: tokenizer.json's
        added_tokens, and what transformers also adds when it loads the tokenizer: `added_tokens.json` {token: id},
        `special_tokens_map.json` values and additional_special_tokens, tokenizer_config.json's special tokens
        (`eos_token`, `pad_token`...), `extra_special_tokens` and `added_tokens_decoder` (transformers 5 adds each
        one missing from the vocabulary: tokenization_utils_base.py `from_pretrained`)."""
        atok, served = self.adapter_tokenizer.value, self.served_tokenizer.value
        if served is None:
            return AddedTokens([], "")
        s_added, s_vocab = served.added(), served.vocab()
        # what transformers adds to the served tokenizer from the same kind of files (vLLM loads it with transformers)
        s_vocab = set(s_vocab) | {t for ts in config_tokens(served.path).values() for t in ts}
        added, where = [], ""
        if atok is not None:
            added = sorted((t, i) for t, i in atok.added().items() if t not in s_added)
            where = str(self.adapter_dir / "tokenizer.json") if added else ""
        for name, tokens in self._slow_tokenizer_tokens().items():
            new = sorted({t for t in tokens if t not in s_vocab and t not in {a for a, _ in added}})
            if new:
                added += [(t, None) for t in new]
                where = where or str(self.adapter_dir / name)
        return AddedTokens(added, where)

    def _slow_tokenizer_tokens(self) -> dict[str, list[str]]:
        """{file: token strings} transformers adds from the adapter's tokenizer files besides tokenizer.json
        (`config_tokens`; regular files only: an unreadable one is tokenizer.unreadable's finding when
        tokenizer.json loads it)."""
        return config_tokens(self.adapter_dir, lambda p: p in self.scan.files)

    @property
    def template_unchecked(self) -> str | None:
        if self.training.value is None and self.training.missing is None:
            return (
                "no training template found (no resolved axolotl config, no chat template or tokenizer files with "
                "the adapter): tokenizer and chat template not compared; pass --training-config"
            )
        if self.served_tokenizer.value is None and self.served_tokenizer.missing is None:
            return "no served or base tokenizer available: tokenizer and chat template not compared"
        return None

    # -- what the optional steps established ------------------------------------------------------------------------
    @cached_property
    def fold(self) -> Fact[FoldResult]:
        """`--fold-rslora`: the fold (done once, before anything reads adapter_config.json), or why not.

        reason "parity": folding would change a module's scale (nothing written); an unreadable config or
        weights file is an empty fact (its own checks report it)."""
        try:
            return Fact(fold_rslora(self.adapter_dir))
        except ParityError as e:
            return Fact(None, str(e), "parity")
        except (FileNotFoundError, ValueError, OSError, PipelineError):
            return Fact()

    @cached_property
    def behaviour(self) -> Fact[dict]:
        """`--behaviour`'s measurements (`behaviour.evaluate`), or why not: reason "skip" (no base), "static"
        (static checks failed first), "load" (transformers/peft could not load base + adapter)."""
        if self.base_dir is None:
            return Fact(None, "--behaviour needs the bf16 base: pass --base DIR", "skip")
        if not self.report.passed:
            return Fact(None, None, "static")
        try:
            return Fact(
                behaviour_eval.evaluate(self.adapter_dir, self.base_dir, self.options.validation_files)
            )
        except behaviour_eval.BehaviourUnavailable as e:
            return Fact(None, str(e), "load")
