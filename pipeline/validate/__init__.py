"""Validate a LoRA adapter against the base it was trained on and the fleet that will serve it.

Each check has a stable id (`area.what`), a severity and a message saying what is wrong,
where (file, tensor, layer) and how to fix it. The verdict is `pass` when no check has
severity `error`. Only headers of the base are read; adapter tensors (at most a few hundred
MB) are read one at a time for the value checks.

Rules taken from vLLM (vllm/lora/peft_helper.py, vllm/lora/models.py, vllm/config/lora.py):
allowed ranks, refused PEFT variants, and which modules of Qwen3.5 it can patch.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.artifacts.adapter import (
    CONFIG_FILE,
    PICKLE_WEIGHTS,
    WEIGHTS_FILE,
    AdapterConfig,
    load_adapter_config,
    parse_key,
)
from pipeline.artifacts.atomic import write_json_atomic
from pipeline.artifacts.checkpoint import (
    GEOMETRY_KEYS,
    LAYER_RE,
    Checkpoint,
    logical_linear_shape,
    quant_algo,
    read_checkpoint,
)
from pipeline.artifacts.hashing import sha256_file
from pipeline.artifacts.manifest import read_manifest
from pipeline.artifacts.safetensors import DTYPE_BYTES, HeaderError, raw_header, read_safetensors_header
from pipeline.findings import Finding, Report
from pipeline.serving.vllm import (
    ALLOWED_DTYPES,
    EMBEDDING_MODULES,
    KNOWN_QUANT,
    LORA_RANKS,
    PLAIN_INITS,
    QWEN35_MODULES,
    REFUSED_CONFIG_KEYS,
    fleet_applies,
)
from pipeline.validate import behaviour as beh
from pipeline.validate import template as template_check
from pipeline.validate.normalise import ParityError, fold_rslora

REPORT_FILE = "validation.json"

NORM_OUTLIER = 10.0  # x the median update norm of the same module type
SIZE_BAND = (0.5, 2.0)  # weights file / expected bytes


Check = Finding  # a validation finding; the report's JSON calls them "checks"


@dataclass
class ValidationReport(Report):
    """Findings of one validation, with what was validated and summary stats.

    JSON (`validation.json`, the registry's `validation.report` tag): adapter, base,
    weights_sha256, checks [{id, severity, message, where}], stats, created, verdict.
    """

    adapter: str = ""
    base: str | None = None
    weights_sha256: str | None = None
    stats: dict = field(default_factory=dict)
    created: str = field(default_factory=lambda: dt.datetime.now(dt.UTC).isoformat(timespec="seconds"))

    @property
    def checks(self) -> list[Finding]:
        return self.findings

    @property
    def verdict(self) -> str:
        return "pass" if self.ok else "fail"

    @property
    def passed(self) -> bool:
        return self.ok

    def to_dict(self) -> dict:
        return {
            "adapter": self.adapter,
            "base": self.base,
            "weights_sha256": self.weights_sha256,
            "checks": [c.to_dict() for c in self.findings],
            "stats": self.stats,
            "created": self.created,
            "verdict": self.verdict,
        }

    @classmethod
    def from_dict(cls, d: dict) -> ValidationReport:
        return cls(
            findings=[Finding(**c) for c in d.get("checks", [])],
            adapter=d["adapter"],
            base=d.get("base"),
            weights_sha256=d.get("weights_sha256"),
            stats=d.get("stats", {}),
            created=d.get("created", ""),
        )

    def write(self, path: Path) -> None:
        write_json_atomic(path, self.to_dict())


@dataclass
class FleetRules:
    """What the serving fleet accepts (the project config's `fleet` and `served` sections).

    `lora_target_modules` is vLLM's `--lora-target-modules`; `served_model` the exact model
    string given to `vllm serve` (what the filesystem resolver compares with
    `base_model_name_or_path`); `served_path` a local copy of the served checkpoint (config,
    index, headers and tokenizer only are read).
    """

    max_lora_rank: int = 16
    lora_target_modules: list[str] | None = None
    allow_embedding_targets: bool = False
    loading_mode: str = "api"
    served_model: str | None = None
    served_path: Path | None = None
    served_checkpoint: str | None = None
    served_revision: str | None = None
    vllm_version: str | None = None

    @classmethod
    def from_config(cls, cfg) -> FleetRules:
        """From a `ProjectConfig`."""
        return cls(
            cfg.fleet.max_lora_rank,
            cfg.fleet.lora_target_modules,
            cfg.fleet.allow_embedding_targets,
            cfg.fleet.loading_mode,
            cfg.served.model,
            cfg.served.path,
            cfg.served.checkpoint,
            cfg.served.revision,
            cfg.fleet.vllm_version,
        )


# -- adapter_config.json ----------------------------------------------------------------------------------------
def _check_config(cfg: AdapterConfig, rules: FleetRules, rep: ValidationReport) -> None:
    raw, where = cfg.raw, str(cfg.path)
    if raw.get("peft_type") != "LORA":
        rep.add(
            "config.peft_type",
            "error",
            f"peft_type is {raw.get('peft_type')!r}; vLLM serves only LORA "
            "adapters: save a LoRA (peft LoraConfig) adapter",
            where,
        )
    for key in ("r", "lora_alpha", "target_modules"):
        if raw.get(key) in (None, [], ""):
            rep.add(
                "config.required",
                "error",
                f"{key} is missing; vLLM requires r, lora_alpha and target_modules: "
                "re-save the adapter with peft",
                where,
            )
    ranks = {"r": raw.get("r")} | {
        f"rank_pattern[{k}]": v for k, v in (raw.get("rank_pattern") or {}).items()
    }
    for what, r in ranks.items():
        if r is None:
            continue
        if r not in LORA_RANKS:
            rep.add(
                "config.rank",
                "error",
                f"{what} = {r} is not one of vLLM's ranks {LORA_RANKS}: retrain "
                "with one of them (lora_r in the axolotl config)",
                where,
            )
        elif r > rules.max_lora_rank:
            rep.add(
                "config.rank",
                "error",
                f"{what} = {r} exceeds the fleet's --max-lora-rank {rules.max_lora_rank}: retrain with a smaller r "
                f"or raise fleet.max_lora_rank (and --max-lora-rank on every instance)",
                where,
            )
    for key, what in REFUSED_CONFIG_KEYS.items():
        if raw.get(key):
            rep.add(
                "config.unsupported",
                "error",
                f"{key} is set ({what}); vLLM refuses it: retrain without it",
                where,
            )
    if raw.get("bias", "none") != "none":
        rep.add(
            "config.unsupported",
            "error",
            f"bias = {raw['bias']!r}; vLLM needs bias 'none': retrain with bias='none'",
            where,
        )
    init = raw.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower() not in PLAIN_INITS:
        rep.add(
            "config.unsupported",
            "error",
            f"init_lora_weights = {init!r} (PiSSA/OLoRA/LoftQ/CorDA change the "
            "base weights) is refused by vLLM: convert it to a plain LoRA with peft's "
            "path_initial_model_for_weight_conversion",
            where,
        )
    if raw.get("alora_invocation_tokens"):
        rep.add(
            "config.unsupported",
            "error",
            "aLoRA (alora_invocation_tokens) is refused by vLLM: retrain as plain LoRA",
            where,
        )
    if raw.get("use_rslora"):
        rep.add(
            "config.rslora",
            "error",
            "use_rslora is set (scale alpha/sqrt(r)); the fleet serves plain alpha/r: normalise with "
            "`pipeline validate --fold-rslora` (folds the scale into lora_alpha, weights unchanged) or retrain "
            "without peft_use_rslora",
            where,
        )
    _check_resolver(cfg, rules, rep)


def _check_resolver(cfg: AdapterConfig, rules: FleetRules, rep: ValidationReport) -> None:
    """vLLM's filesystem resolver loads a directory only if base_model_name_or_path == the `vllm serve` model."""
    if rules.loading_mode != "resolver":
        return
    have, want = cfg.raw.get("base_model_name_or_path"), rules.served_model
    if not want:
        rep.add(
            "fleet.resolver_base",
            "error",
            "fleet.loading_mode is resolver but served.model is empty: set it to "
            "the exact model string given to `vllm serve`",
            "pipeline.yaml: served.model",
        )
        return
    if have == want:
        return
    adapter_dir = cfg.path.parent
    try:
        man = read_manifest(adapter_dir)
    except (FileNotFoundError, ValueError):
        man = None
    if man is not None and "published" not in man:
        rep.add(
            "fleet.resolver_base",
            "info",
            f"base_model_name_or_path {have!r} will be rewritten to {want!r} by "
            "`pipeline publish` (the resolver needs the exact `vllm serve` model string)",
            str(cfg.path),
        )
    else:
        rep.add(
            "fleet.resolver_base",
            "error",
            f"base_model_name_or_path is {have!r} but the fleet's resolver only "
            f"loads adapters whose base is exactly {want!r} (served.model): it would answer 404. Publish it with "
            "`pipeline publish` (which rewrites it) or fix adapter_config.json",
            str(cfg.path),
        )


# -- tensors -----------------------------------------------------------------------------------------------------
def _allowed_modules(base: Checkpoint, layer: int) -> set[str]:
    types = base.layer_types
    lt = types[layer] if layer < len(types) else "full_attention"
    return QWEN35_MODULES.get(lt, set()) | QWEN35_MODULES["any"]


@dataclass
class AdaptedModule:
    """One complete, well-formed LoRA pair of a decoder-layer module."""

    module: str  # canonical, layers.{i}.{sub}
    peft_module: str
    layer: int
    sub: str
    rank: int
    out_features: int
    in_features: int
    a_tensor: str
    b_tensor: str


def _check_tensors(
    adapter_dir: Path,
    cfg: AdapterConfig | None,
    base: Checkpoint | None,
    rules: FleetRules,
    rep: ValidationReport,
):
    """Weight file, key, shape and rank checks (header only). Returns (header, adapted modules) or (None, [])."""
    wfile = adapter_dir / WEIGHTS_FILE
    pickles = [p for p in PICKLE_WEIGHTS if (adapter_dir / p).exists()]
    if pickles and wfile.exists():
        rep.add(
            "weights.ambiguous",
            "error",
            f"both {WEIGHTS_FILE} and {pickles} present: which one loads depends on "
            "the loader; delete the pickle file",
            str(adapter_dir),
        )
    elif pickles:
        rep.add(
            "weights.pickle",
            "error",
            f"{pickles[0]} is a pickle file (can run code on load; the pipeline verifies safetensors only): "
            "re-save with save_pretrained(safe_serialization=True)",
            str(adapter_dir / pickles[0]),
        )
        return None, []
    if not wfile.exists():
        rep.add(
            "weights.missing",
            "error",
            f"{WEIGHTS_FILE} is missing: copy it from the training output_dir",
            str(adapter_dir),
        )
        return None, []
    try:
        header = read_safetensors_header(wfile)
    except HeaderError as e:
        rep.add("weights.header", "error", f"{e}; re-copy the file from the training output", str(wfile))
        return None, []
    rep.weights_sha256 = sha256_file(wfile)
    if not header:
        rep.add("weights.empty", "error", "no tensors in the weights file: re-save the adapter", str(wfile))
        return None, []

    pairs: dict[str, dict[str, tuple[str, tuple[int, ...]]]] = {}
    peft_names: dict[str, str] = {}
    for name, info in header.items():
        if info.dtype not in ALLOWED_DTYPES:
            rep.add(
                "weights.dtype",
                "error",
                f"dtype {info.dtype}; vLLM loads bf16/fp16/fp32 LoRA weights: re-save in bf16",
                f"{wfile}:{name}",
            )
        key = parse_key(name)
        if key is None:
            rep.add(
                "keys.unknown",
                "error",
                "not a LoRA A/B tensor name (expected ...<module>.lora_A.weight): remove "
                "it or re-save with peft",
                f"{wfile}:{name}",
            )
            continue
        pairs.setdefault(key.module, {})[key.kind] = (name, info.shape)
        peft_names[key.module] = key.peft_module

    num_layers = base.num_layers if base else None
    modules_by_suffix: dict[str, set[int]] = {}
    adapted: list[AdaptedModule] = []
    lora_params = 0
    outside_fleet: dict[str, list[int]] = {}
    for module, ab in sorted(pairs.items()):
        where = f"{wfile}:{module}"
        if set(ab) != {"A", "B"}:
            missing = "lora_B" if "A" in ab else "lora_A"
            rep.add(
                "keys.pair",
                "error",
                f"{missing} missing for {module}: the adapter is truncated or mis-saved; "
                "re-save it from the training output",
                where,
            )
            continue
        (a_name, a_shape), (b_name, b_shape) = ab["A"], ab["B"]
        lora_params += _numel(a_shape) + _numel(b_shape)
        head = module.split(".")[0]
        if head in EMBEDDING_MODULES:
            if not rules.allow_embedding_targets:
                rep.add(
                    "keys.embedding",
                    "error",
                    f"{module} LoRA: the fleet does not serve embedding/lm_head adapters "
                    "(fleet.allow_embedding_targets): retrain without it in lora_target_modules",
                    where,
                )
            continue
        if head == "mtp":
            rep.add(
                "keys.mtp",
                "error",
                f"{module}: vLLM's MTP drafter has no LoRA support; drop mtp.* from the targets and retrain",
                where,
            )
            continue
        if head == "visual":
            rep.add(
                "keys.visual",
                "error",
                f"{module}: vision-tower LoRA is not served by a text fleet: restrict "
                "lora_target_modules to language-model modules",
                where,
            )
            continue
        m = LAYER_RE.match(module)
        if not m:
            rep.add(
                "keys.module",
                "error",
                f"{module} is not a decoder-layer module of the base: remove it from the targets",
                where,
            )
            continue
        layer, sub = int(m.group(1)), m.group(2)
        if sub.endswith("conv1d"):
            rep.add(
                "keys.conv1d",
                "error",
                f"{module}: vLLM accepts conv1d LoRA but applies nothing: drop conv1d "
                "from lora_target_modules and retrain",
                where,
            )
            continue
        modules_by_suffix.setdefault(sub, set()).add(layer)
        if num_layers is not None and layer >= num_layers:
            rep.add(
                "keys.layer",
                "error",
                f"layer {layer} >= the base's {num_layers} layers: the adapter is for "
                "another base; retrain on this one",
                where,
            )
            continue
        short = sub.split(".")[-1]
        if not fleet_applies(short, rules.lora_target_modules):
            outside_fleet.setdefault(short, []).append(layer)
        if base is None:
            continue
        allowed = _allowed_modules(base, layer)
        if sub not in allowed:
            lt = base.layer_types[layer] if layer < len(base.layer_types) else "?"
            rep.add(
                "keys.module",
                "error",
                f"{sub} does not exist on layer {layer} ({lt}) or vLLM cannot patch it; "
                f"modules on {lt} layers: {sorted(allowed)}",
                where,
            )
            continue
        shape = base.linear_shape(module)
        if shape is None:
            rep.add(
                "keys.module",
                "error",
                f"base has no 2-D weight for {module}: the adapter is for another base",
                where,
            )
            continue
        out_f, in_f = shape
        r_a = a_shape[0] if len(a_shape) == 2 else None
        if len(a_shape) != 2 or a_shape[1] != in_f:
            rep.add(
                "keys.shape",
                "error",
                f"lora_A {list(a_shape)} does not fit base in_features {in_f} (expected "
                f"[r, {in_f}]): adapter for another base; retrain on this base",
                where,
            )
            continue
        if len(b_shape) != 2 or b_shape[0] != out_f:
            rep.add(
                "keys.shape",
                "error",
                f"lora_B {list(b_shape)} does not fit base out_features {out_f} (expected "
                f"[{out_f}, r]): adapter for another base; retrain on this base",
                where,
            )
            continue
        if b_shape[1] != r_a:
            rep.add(
                "keys.shape",
                "error",
                f"lora_A rank {r_a} != lora_B rank {b_shape[1]}: mis-saved adapter",
                where,
            )
            continue
        if cfg is not None and r_a != cfg.rank_for(peft_names[module]):
            rep.add(
                "keys.rank",
                "error",
                f"tensor rank {r_a} != configured r {cfg.rank_for(peft_names[module])} (rank_pattern honoured): vLLM "
                "would serve it with the wrong scale; set r (or rank_pattern) in adapter_config.json to the tensors' rank",
                where,
            )
            continue
        adapted.append(
            AdaptedModule(module, peft_names[module], layer, sub, r_a, out_f, in_f, a_name, b_name)
        )
    for short, layers in sorted(outside_fleet.items()):
        rep.add(
            "keys.fleet_targets",
            "error",
            f"{short} (layers {_ranges(layers)}) is outside the fleet's --lora-target-modules "
            f"{rules.lora_target_modules}: vLLM would silently not apply it; add {short} to fleet.lora_target_modules "
            "(and the instances' flags) or retrain without it",
            str(wfile),
        )
    if cfg is not None and base is not None:
        _check_declared_targets(cfg, base, modules_by_suffix, rep)
    rep.stats.update(
        {"lora_modules": len(pairs), "lora_parameters": lora_params, "weights_bytes": wfile.stat().st_size}
    )
    return header, adapted


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _ranges(xs) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    xs = sorted(set(xs))
    out, i = [], 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        out.append(str(xs[i]) if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ", ".join(out)


def _layers_to_transform(cfg: AdapterConfig, n: int) -> set[int]:
    ltt = cfg.raw.get("layers_to_transform")
    if ltt is None:
        return set(range(n))
    return {ltt} if isinstance(ltt, int) else set(ltt)


def _check_declared_targets(
    cfg: AdapterConfig, base: Checkpoint, present: dict[str, set[int]], rep: ValidationReport
):
    """target_modules in the config vs the tensors: declared-but-absent, partial and undeclared modules."""
    layers_ok = _layers_to_transform(cfg, base.num_layers)
    expected: dict[str, set[int]] = {}  # sub -> layers where peft would have put a LoRA
    for i in range(base.num_layers):
        if i not in layers_ok:
            continue
        for sub in base.layer_modules(i) & _allowed_modules(base, i):
            if cfg.targets(f"layers.{i}.{sub}") or cfg.targets(f"model.layers.{i}.{sub}"):
                expected.setdefault(sub, set()).add(i)
    for sub in sorted(set(expected) - set(present)):
        rep.add(
            "keys.declared_absent",
            "warning",
            f"target_modules covers {sub} (layers {_ranges(expected[sub])}) but "
            "no tensor adapts it: the adapter was mis-saved or target_modules is wrong",
            str(cfg.path),
        )
    for sub, layers in sorted(present.items()):
        if sub not in expected:
            rep.add(
                "keys.undeclared",
                "warning",
                f"tensors adapt {sub} but target_modules does not list it: fix "
                "target_modules in adapter_config.json",
                str(cfg.path),
            )
            continue
        missing = sorted(expected[sub] - layers)
        if missing:
            rep.add(
                "keys.partial",
                "warning",
                f"partial adapter: {sub} adapted on {len(layers & expected[sub])} of {len(expected[sub])} layers; "
                f"missing on layers {_ranges(missing)}: re-save from the training output or set layers_to_transform",
                str(cfg.path),
            )


# -- values -------------------------------------------------------------------------------------------------------
def _check_values(
    adapter_dir: Path, header, adapted: list[AdaptedModule], cfg: AdapterConfig | None, rep: ValidationReport
) -> None:
    """Finite values, lora_B not all zero, per-module update norms (outliers warned).

    Reads the file through a read-only memory map with numpy (no torch): non-finite and zero
    tests work on the raw bits (bf16/fp16 exponent all ones = Inf/NaN), which is ~50x faster
    than torch.isfinite on bf16. The norm of a module's update `scale * B @ A` ([out, in]) is
    computed without forming it: ||BA||_F^2 = sum((B^T B) * (A A^T)), two r x r Gram matrices.
    """
    import numpy as np

    wfile = adapter_dir / WEIGHTS_FILE
    data = np.memmap(wfile, dtype=np.uint8, mode="r")
    nonzero_b = b_count = 0
    bad: set[str] = set()
    for name, info in header.items():
        if info.dtype not in ALLOWED_DTYPES:
            bad.add(name)  # reported by weights.dtype
            continue
        raw = data[info.offset : info.offset + info.nbytes]
        if info.dtype == "F32":
            v = raw.view(np.float32)
            nonfinite = v.size - int(np.isfinite(v).sum())
            nonzero = bool(np.any(v))
        else:
            u = raw.view(np.uint16)
            exp = 0x7F80 if info.dtype == "BF16" else 0x7C00
            nonfinite = int(np.count_nonzero((u & exp) == exp))
            nonzero = bool(np.any(u & 0x7FFF))
        if nonfinite:
            bad.add(name)
            rep.add(
                "values.nonfinite",
                "error",
                f"{nonfinite} NaN/Inf values of {_numel(info.shape)}: vLLM loads it and corrupts other tenants' "
                "requests; retrain (lower the learning rate, check for fp16 overflow)",
                f"{wfile}:{name}",
            )
            continue
        key = parse_key(name)
        if key and key.kind == "B":
            b_count += 1
            nonzero_b += nonzero
    if b_count and nonzero_b == 0:
        rep.add(
            "values.untrained",
            "error",
            "every lora_B is zero: the adapter is untrained (a no-op); check that "
            "training ran steps and saved the final adapter",
            str(wfile),
        )
    elif b_count and nonzero_b < b_count:
        rep.add(
            "values.zero_b",
            "warning",
            f"{b_count - nonzero_b} of {b_count} lora_B tensors are all zero: those modules were never trained",
            str(wfile),
        )
    norms: dict[str, float] = {}
    for m in adapted:
        if m.a_tensor in bad or m.b_tensor in bad:
            continue
        a = _as_f32(data, header[m.a_tensor]).reshape(header[m.a_tensor].shape)
        b = _as_f32(data, header[m.b_tensor]).reshape(header[m.b_tensor].shape)
        sq = float(((b.T @ b) * (a @ a.T)).sum())
        scale = cfg.scale_for(m.peft_module) if cfg is not None and cfg.r else 1.0
        norms[m.module] = scale * max(sq, 0.0) ** 0.5
    _norm_outliers(norms, wfile, rep)


def _as_f32(data, info):
    """A tensor's values as float32 (numpy), from the memory map."""
    import numpy as np

    raw = data[info.offset : info.offset + info.nbytes]
    if info.dtype == "BF16":  # bf16 is the top half of an fp32: write it there, zero the low half
        out = np.zeros(info.nbytes // 2, dtype=np.float32)
        out.view(np.uint16)[1::2] = raw.view(np.uint16)
        return out
    if info.dtype == "F16":
        return raw.view(np.float16).astype(np.float32)
    return np.asarray(raw.view(np.float32))


def _norm_outliers(norms: dict[str, float], wfile: Path, rep: ValidationReport) -> None:
    """Warn on modules whose update norm is > NORM_OUTLIER x the median of the same module type."""
    import statistics

    groups: dict[str, list[tuple[str, float]]] = {}
    for module, n in norms.items():
        groups.setdefault(module.split(".", 2)[-1], []).append((module, n))
    medians = {}
    for sub, items in sorted(groups.items()):
        med = statistics.median(n for _, n in items)
        medians[sub] = med
        if len(items) < 3 or med <= 0:
            continue
        for module, n in items:
            if n > NORM_OUTLIER * med:
                rep.add(
                    "values.norm_outlier",
                    "warning",
                    f"update norm ||scale*B@A|| = {n:.4g} is {n / med:.0f}x the "
                    f"median {med:.4g} of {sub} over {len(items)} layers: check for a diverged layer (lower the "
                    "learning rate, clip gradients)",
                    f"{wfile}:{module}",
                )
    rep.stats["update_norm_median"] = {k: round(v, 6) for k, v in medians.items()}
    rep.stats["max_update_norm"] = max(norms.values(), default=0.0)


def _check_size(
    adapter_dir: Path, header, cfg: AdapterConfig, base: Checkpoint, rep: ValidationReport
) -> None:
    """File size vs the band implied by r (rank_pattern), target_modules and the base's shapes."""
    wfile = adapter_dir / WEIGHTS_FILE
    dtypes = [t.dtype for t in header.values()]
    per = DTYPE_BYTES.get(max(set(dtypes), key=dtypes.count), 2) if dtypes else 2
    layers_ok = _layers_to_transform(cfg, base.num_layers)
    params = 0
    for i in sorted(layers_ok):
        if i >= base.num_layers:
            continue
        for sub in base.layer_modules(i) & _allowed_modules(base, i):
            peft_name = f"model.layers.{i}.{sub}"
            if not cfg.targets(peft_name):
                continue
            shape = base.linear_shape(f"layers.{i}.{sub}")
            if shape:
                params += cfg.rank_for(peft_name) * (shape[0] + shape[1])
    expected = params * per + raw_header(wfile)[0]
    actual = wfile.stat().st_size
    rep.stats["expected_weights_bytes"] = expected
    if params == 0:
        return
    ratio = actual / expected
    if not SIZE_BAND[0] <= ratio <= SIZE_BAND[1]:
        rep.add(
            "values.size_band",
            "error",
            f"{actual:,} bytes is {ratio:.2f}x the {expected:,} bytes implied by r, "
            f"target_modules and the base's shapes (band {SIZE_BAND[0]}-{SIZE_BAND[1]}x): tensors missing or "
            "extra data; re-save the adapter or fix adapter_config.json",
            str(wfile),
        )


# -- served checkpoint ----------------------------------------------------------------------------------------------
def _check_served(
    served_dir: Path,
    base: Checkpoint | None,
    adapted: list[AdaptedModule],
    rules: FleetRules,
    rep: ValidationReport,
) -> Checkpoint | None:
    """Module names and logical shapes against the served (e.g. NVFP4 ModelOpt) checkpoint."""
    try:
        served = read_checkpoint(Path(served_dir))
    except (FileNotFoundError, ValueError) as e:
        rep.add(
            "served.unreadable",
            "error",
            f"{e}: set served.path to a local copy of the served checkpoint (config, index, headers)",
            str(served_dir),
        )
        return None
    algo = quant_algo(served)
    qfile = served.path / "hf_quant_config.json"
    rep.stats["served"] = {
        "path": str(served.path),
        "checkpoint": rules.served_checkpoint,
        "revision": rules.served_revision,
        "quant_algo": algo,
        "layout": served.layout,
        "quant_config_sha256": sha256_file(qfile) if qfile.is_file() else None,
    }
    if algo is None:
        rep.add(
            "served.not_quantized",
            "info",
            "served checkpoint has no hf_quant_config.json or quantization_config: treated as unquantized",
            str(served.path),
        )
    elif algo not in KNOWN_QUANT:
        rep.add(
            "served.quant_unknown",
            "warning",
            f"quantization {algo!r} is not one the pipeline knows "
            f"({sorted(KNOWN_QUANT)}): module shapes are read as stored",
            str(qfile),
        )
    if base is not None:
        diffs = [
            f"{k}: base {base.text_config.get(k)!r} vs served {served.text_config.get(k)!r}"
            for k in GEOMETRY_KEYS
            if k in base.text_config
            and k in served.text_config
            and base.text_config[k] != served.text_config[k]
        ]
        if diffs:
            rep.add(
                "served.geometry",
                "error",
                "the served checkpoint is not a quantisation of this base ("
                + "; ".join(diffs)
                + "): point served.path at the fleet's checkpoint or retrain on its bf16 base",
                str(served.path / "config.json"),
            )
            return served
    missing: dict[str, list[int]] = {}
    for m in adapted:
        shape = logical_linear_shape(served, m.module)
        if shape is None:
            missing.setdefault(m.sub, []).append(m.layer)
        elif shape != (m.out_features, m.in_features):
            rep.add(
                "served.shape",
                "error",
                f"served {m.module} is [out, in] = {list(shape)} (unpacked from "
                f"{served.modules[m.module].dtype} {list(served.modules[m.module].shape)}) but the adapter is "
                f"for [{m.out_features}, {m.in_features}]: the served checkpoint is another model",
                str(served.path),
            )
    for sub, layers in sorted(missing.items()):
        rep.add(
            "served.module_missing",
            "error",
            f"{sub} on layers {_ranges(layers)} does not exist in the served "
            f"checkpoint ({served.layout} layout, names mapped from tensor names): vLLM cannot apply it there; "
            "retrain without it or fix served.path",
            str(served.path),
        )
    return served


def _fold(adapter_dir: Path, rep: ValidationReport) -> None:

    try:
        res = fold_rslora(adapter_dir)
    except ParityError as e:
        rep.add(
            "config.rslora_parity",
            "error",
            f"{e}: fold by hand with exact alpha_pattern entries or retrain without rsLoRA",
            str(adapter_dir / CONFIG_FILE),
        )
        return
    except (FileNotFoundError, ValueError, HeaderError, OSError):
        return  # reported by the config / weights checks that follow
    if res.folded:
        rep.add(
            "config.rslora_folded",
            "warning",
            f"rsLoRA folded into lora_alpha in place (effective scale "
            f"alpha/sqrt(r) -> alpha'/r, unchanged on all {res.modules} modules; weights untouched): {res.old} -> "
            f"{res.new}; register this directory, not the original",
            str(adapter_dir / CONFIG_FILE),
        )


# -- entry point -------------------------------------------------------------------------------------------------------
def validate_adapter(
    adapter_dir: Path,
    base_dir: Path | None = None,
    rules: FleetRules | None = None,
    *,
    served_dir: Path | None = None,
    training_config: Path | None = None,
    behaviour: bool = False,
    validation_files: list[Path] | None = None,
    fold_rslora: bool = False,
) -> ValidationReport:
    """Run the checks. Never raises for a bad adapter: problems are checks in the report.

    Args:
        adapter_dir: the PEFT directory (adapter_config.json + adapter_model.safetensors).
        base_dir: the bf16 base checkpoint; only config.json, the index and headers are read.
        rules: the fleet's profile; defaults to vLLM's defaults (max rank 16, API loading).
        served_dir: the served checkpoint (default `rules.served_path`); headers and tokenizer only.
        training_config: the resolved axolotl config (for the training chat template); default
            the `resolved_config` named in the adapter's manifest.json.
        behaviour: also load base + adapter with transformers/peft on CPU (tiny models) and
            compare eval loss and greedy canary outputs (`pipeline.validate.behaviour`).
        validation_files: chat JSONL for the behaviour eval (default: the manifest's validation files).
        fold_rslora: first rewrite an rsLoRA adapter_config.json in place to plain scaling
            (`pipeline.validate.normalise.fold_rslora`; warning `config.rslora_folded`, or error
            `config.rslora_parity` and nothing written if any module's scale would change).
    """
    adapter_dir = Path(adapter_dir)
    rules = rules or FleetRules()
    served_dir = served_dir or rules.served_path
    rep = ValidationReport(
        adapter=str(adapter_dir.resolve()), base=str(Path(base_dir).resolve()) if base_dir else None
    )
    if not adapter_dir.is_dir():
        rep.add("adapter.missing", "error", "adapter directory not found: check the path", str(adapter_dir))
        return rep
    if fold_rslora:
        _fold(adapter_dir, rep)
    cfg = None
    try:
        cfg = load_adapter_config(adapter_dir)
        _check_config(cfg, rules, rep)
    except FileNotFoundError as e:
        rep.add("config.missing", "error", str(e), str(adapter_dir / CONFIG_FILE))
    except ValueError as e:
        rep.add(
            "config.invalid",
            "error",
            f"{e}: fix the JSON or re-save with peft",
            str(adapter_dir / CONFIG_FILE),
        )
    base = None
    if base_dir is not None:
        try:
            base = read_checkpoint(Path(base_dir))
        except (FileNotFoundError, ValueError) as e:
            rep.add(
                "base.unreadable",
                "error",
                f"{e}: pass --base with the bf16 checkpoint directory",
                str(base_dir),
            )
    header, adapted = _check_tensors(adapter_dir, cfg, base, rules, rep)
    if header:
        _check_values(adapter_dir, header, adapted, cfg, rep)
        if cfg is not None and base is not None and cfg.r:
            _check_size(adapter_dir, header, cfg, base, rep)
    served = None
    if served_dir is not None:
        served = _check_served(Path(served_dir), base, adapted, rules, rep)
    else:
        rep.add(
            "served.unchecked",
            "warning",
            "no served checkpoint given: module names and shapes were not checked "
            "against what the fleet serves; set served.path in pipeline.yaml or pass --served",
            "",
        )

    template_check.run(adapter_dir, base, served, rep, training_config=training_config)
    if behaviour:
        beh.run(adapter_dir, base_dir, rep, validation_files=validation_files)
    return rep


def default_base(cfg, adapter_dir: Path) -> Path | None:
    """The base to validate against: config `base.path`, else a local `base_model` named in manifest.json."""
    if cfg.base.path:
        return cfg.base.path
    try:
        b = read_manifest(Path(adapter_dir))["base_model"]["id"]
        return Path(b) if Path(b).is_dir() else None
    except (FileNotFoundError, KeyError, ValueError):
        return None


def validate_with_config(cfg, adapter_dir: Path, base_dir: Path | None = None, **kwargs) -> ValidationReport:
    """`validate_adapter` with the project config's base, served checkpoint and fleet rules.

    A missing base is an error check (`base.missing`), not an exception: the report still
    records everything else (used by register/run, which store the report).
    """
    base_dir = base_dir or default_base(cfg, adapter_dir)
    rep = validate_adapter(adapter_dir, base_dir, FleetRules.from_config(cfg), **kwargs)
    if base_dir is None:
        rep.add(
            "base.missing",
            "error",
            "no base checkpoint to validate against: pass --base DIR or set base.path in pipeline.yaml",
            str(adapter_dir),
        )
    return rep
