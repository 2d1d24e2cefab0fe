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
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pipeline.adapter import (
    CONFIG_FILE,
    PICKLE_WEIGHTS,
    WEIGHTS_FILE,
    AdapterConfig,
    load_adapter_config,
    parse_key,
)
from pipeline.checkpoint import LAYER_RE, Checkpoint, HeaderError, read_checkpoint, read_safetensors_header
from pipeline.config import VLLM_LORA_RANKS
from pipeline.dataset import sha256_file

REPORT_FILE = "validation.json"

# Linear modules vLLM can apply LoRA to in Qwen3.5 / Qwen3.6 (vllm/model_executor/models/qwen3_5.py
# packed_modules_mapping + supported_lora_modules), by decoder layer type.
VLLM_QWEN35_MODULES = {
    "full_attention": {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"},
    "linear_attention": {
        "linear_attn.in_proj_qkv",
        "linear_attn.in_proj_z",
        "linear_attn.in_proj_b",
        "linear_attn.in_proj_a",
        "linear_attn.out_proj",
    },
    "any": {"mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"},
}
EMBEDDING_MODULES = {"embed_tokens", "lm_head"}
ALLOWED_DTYPES = {"BF16", "F16", "F32"}


@dataclass
class Check:
    id: str
    severity: str  # "error" | "warning" | "info"
    message: str
    where: str = ""


@dataclass
class ValidationReport:
    adapter: str
    base: str | None
    weights_sha256: str | None = None
    checks: list[Check] = field(default_factory=list)
    stats: dict = field(default_factory=dict)
    created: str = field(default_factory=lambda: dt.datetime.now(dt.UTC).isoformat(timespec="seconds"))

    @property
    def verdict(self) -> str:
        return "fail" if any(c.severity == "error" for c in self.checks) else "pass"

    @property
    def passed(self) -> bool:
        return self.verdict == "pass"

    def add(self, id: str, severity: str, message: str, where: str = "") -> None:
        self.checks.append(Check(id, severity, message, where))

    def to_dict(self) -> dict:
        d = asdict(self)
        d["verdict"] = self.verdict
        return d

    @classmethod
    def from_dict(cls, d: dict) -> ValidationReport:
        checks = [Check(**c) for c in d.get("checks", [])]
        return cls(d["adapter"], d.get("base"), d.get("weights_sha256"), checks, d.get("stats", {}), d.get("created", ""))

    def write(self, path: Path) -> None:
        from pipeline.manifest import write_json_atomic

        write_json_atomic(path, self.to_dict())


@dataclass
class FleetRules:
    """What the serving fleet accepts (from the project config's fleet section)."""

    max_lora_rank: int = 16
    lora_target_modules: list[str] | None = None
    allow_embedding_targets: bool = False


# -- adapter_config.json ----------------------------------------------------------------------------------------
def _check_config(cfg: AdapterConfig, rules: FleetRules, rep: ValidationReport) -> None:
    raw, where = cfg.raw, str(cfg.path)
    if raw.get("peft_type") != "LORA":
        rep.add("config.peft_type", "error", f"peft_type is {raw.get('peft_type')!r}; vLLM serves only LORA adapters", where)
    for key in ("r", "lora_alpha", "target_modules"):
        if raw.get(key) in (None, [], ""):
            rep.add("config.required", "error", f"{key} is missing; vLLM requires r, lora_alpha and target_modules", where)
    ranks = {"r": raw.get("r")} | {f"rank_pattern[{k}]": v for k, v in (raw.get("rank_pattern") or {}).items()}
    for what, r in ranks.items():
        if r is None:
            continue
        if r not in VLLM_LORA_RANKS:
            rep.add("config.rank", "error", f"{what} = {r} is not one of vLLM's ranks {VLLM_LORA_RANKS}: retrain with one", where)
        elif r > rules.max_lora_rank:
            rep.add(
                "config.rank",
                "error",
                f"{what} = {r} exceeds the fleet's --max-lora-rank {rules.max_lora_rank}: retrain with a smaller r "
                f"or raise max_lora_rank on every instance",
                where,
            )
    refused = {
        "use_dora": "DoRA",
        "lora_bias": "LoRA bias terms",
        "layer_replication": "layer_replication",
        "modules_to_save": "modules_to_save",
    }
    for key, what in refused.items():
        if raw.get(key):
            rep.add("config.unsupported", "error", f"{key} is set ({what}); vLLM refuses it: retrain without it", where)
    if raw.get("bias", "none") != "none":
        rep.add("config.unsupported", "error", f"bias = {raw['bias']!r}; vLLM needs bias 'none'", where)
    init = raw.get("init_lora_weights", True)
    if init not in (True, False, "gaussian"):
        rep.add("config.unsupported", "error", f"init_lora_weights = {init!r} (PiSSA/OLoRA/LoftQ/CorDA) is refused by vLLM", where)
    if raw.get("alora_invocation_tokens"):
        rep.add("config.unsupported", "error", "aLoRA (alora_invocation_tokens) is refused by vLLM", where)
    if raw.get("use_rslora"):
        rep.add(
            "config.rslora",
            "error",
            "use_rslora is set: scale alpha/sqrt(r) is served correctly only by vLLM versions that read it; "
            "normalise with `pipeline validate --fold-rslora` (folds the scale into lora_alpha)",
            where,
        )


# -- tensors -----------------------------------------------------------------------------------------------------
def _allowed_modules(base: Checkpoint, layer: int) -> set[str]:
    types = base.layer_types
    lt = types[layer] if layer < len(types) else "full_attention"
    return VLLM_QWEN35_MODULES.get(lt, set()) | VLLM_QWEN35_MODULES["any"]


def _check_tensors(adapter_dir: Path, cfg: AdapterConfig | None, base: Checkpoint | None, rules: FleetRules, rep: ValidationReport):
    wfile = adapter_dir / WEIGHTS_FILE
    pickles = [p for p in PICKLE_WEIGHTS if (adapter_dir / p).exists()]
    if pickles and wfile.exists():
        rep.add("weights.ambiguous", "error", f"both {WEIGHTS_FILE} and {pickles} present: remove the pickle file", str(adapter_dir))
    elif pickles:
        rep.add(
            "weights.pickle",
            "error",
            f"{pickles[0]} is a pickle file (unsafe, and the pipeline verifies safetensors only): "
            "re-save with save_pretrained(safe_serialization=True)",
            str(adapter_dir / pickles[0]),
        )
        return None
    if not wfile.exists():
        rep.add("weights.missing", "error", f"{WEIGHTS_FILE} is missing", str(adapter_dir))
        return None
    try:
        header = read_safetensors_header(wfile)
    except HeaderError as e:
        rep.add("weights.header", "error", str(e), str(wfile))
        return None
    rep.weights_sha256 = sha256_file(wfile)
    if not header:
        rep.add("weights.empty", "error", "no tensors in the weights file", str(wfile))
        return None

    pairs: dict[str, dict[str, tuple[str, tuple[int, ...]]]] = {}
    for name, info in header.items():
        if info.dtype not in ALLOWED_DTYPES:
            rep.add("weights.dtype", "error", f"dtype {info.dtype}; vLLM loads bf16/fp16/fp32 LoRA weights", f"{wfile}:{name}")
        key = parse_key(name)
        if key is None:
            rep.add("keys.unknown", "error", "not a LoRA A/B tensor name (expected ...<module>.lora_A.weight)", f"{wfile}:{name}")
            continue
        pairs.setdefault(key.module, {})[key.kind] = (name, info.shape)

    num_layers = base.num_layers if base else None
    modules_by_suffix: dict[str, set[int]] = {}
    lora_params = 0
    for module, ab in sorted(pairs.items()):
        where = f"{wfile}:{module}"
        if set(ab) != {"A", "B"}:
            missing = "lora_B" if "A" in ab else "lora_A"
            rep.add("keys.pair", "error", f"{missing} missing for {module}: the adapter is truncated or mis-saved", where)
            continue
        (a_name, a_shape), (b_name, b_shape) = ab["A"], ab["B"]
        lora_params += _numel(a_shape) + _numel(b_shape)
        head = module.split(".")[0]
        if head in EMBEDDING_MODULES:
            if not rules.allow_embedding_targets:
                rep.add("keys.embedding", "error", f"{module} LoRA: the fleet does not serve embedding/lm_head adapters", where)
            continue
        if head == "mtp":
            rep.add("keys.mtp", "error", f"{module}: vLLM's MTP drafter has no LoRA support; drop mtp.* targets", where)
            continue
        if head == "visual":
            rep.add("keys.visual", "error", f"{module}: vision-tower LoRA is not served by a text fleet", where)
            continue
        m = LAYER_RE.match(module)
        if not m:
            rep.add("keys.module", "error", f"{module} is not a decoder-layer module of the base", where)
            continue
        layer, sub = int(m.group(1)), m.group(2)
        if sub.endswith("conv1d"):
            rep.add("keys.conv1d", "error", f"{module}: vLLM accepts conv1d LoRA but applies nothing: drop it", where)
            continue
        modules_by_suffix.setdefault(sub, set()).add(layer)
        if num_layers is not None and layer >= num_layers:
            rep.add("keys.layer", "error", f"layer {layer} >= the base's {num_layers} layers: adapter is for another base", where)
            continue
        if base is not None:
            allowed = _allowed_modules(base, layer)
            if sub not in allowed:
                lt = base.layer_types[layer] if layer < len(base.layer_types) else "?"
                rep.add("keys.module", "error", f"{sub} does not exist on layer {layer} ({lt}) or vLLM cannot patch it", where)
                continue
            if rules.lora_target_modules is not None and sub.split(".")[-1] not in rules.lora_target_modules:
                rep.add(
                    "keys.fleet_targets",
                    "error",
                    f"{sub.split('.')[-1]} is outside the fleet's --lora-target-modules {rules.lora_target_modules}: "
                    "vLLM would silently not apply it",
                    where,
                )
            shape = base.linear_shape(module)
            if shape is None:
                rep.add("keys.module", "error", f"base has no 2-D weight for {module}", where)
                continue
            out_f, in_f = shape
            r_a = a_shape[0] if len(a_shape) == 2 else None
            if len(a_shape) != 2 or a_shape[1] != in_f:
                rep.add("keys.shape", "error", f"lora_A {list(a_shape)} does not fit base in_features {in_f}: adapter for another base", where)
                continue
            if len(b_shape) != 2 or b_shape[0] != out_f:
                rep.add("keys.shape", "error", f"lora_B {list(b_shape)} does not fit base out_features {out_f}: adapter for another base", where)
                continue
            if b_shape[1] != r_a:
                rep.add("keys.shape", "error", f"lora_A rank {r_a} != lora_B rank {b_shape[1]}", where)
                continue
            if cfg is not None and r_a != cfg.rank_for(module):
                rep.add(
                    "keys.rank",
                    "error",
                    f"tensor rank {r_a} != configured r {cfg.rank_for(module)} (rank_pattern honoured): vLLM would "
                    "serve it with the wrong scale; fix r in adapter_config.json",
                    where,
                )
    if cfg is not None and base is not None:
        _check_declared_targets(cfg, base, modules_by_suffix, rep)
    rep.stats.update({"lora_modules": len(pairs), "lora_parameters": lora_params, "weights_bytes": wfile.stat().st_size})
    return header


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _check_declared_targets(cfg: AdapterConfig, base: Checkpoint, present: dict[str, set[int]], rep: ValidationReport):
    """target_modules in the config vs the tensors: declared-but-absent and partial adapters."""
    declared = set(cfg.target_modules)
    present_names = {s.split(".")[-1] for s in present}
    for name in sorted(declared - present_names):
        # A declared module the base does not have at all (e.g. q_proj on a pure-DeltaNet stack) is harmless.
        layers_with = [i for i in range(base.num_layers) if any(m.split(".")[-1] == name for m in base.layer_modules(i))]
        if layers_with:
            rep.add("keys.declared_absent", "warning", f"target_modules lists {name} but no tensor adapts it", str(cfg.path))
    for sub, layers in sorted(present.items()):
        short = sub.split(".")[-1]
        expected = {i for i in range(base.num_layers) if sub in base.layer_modules(i)}
        missing = sorted(expected - layers)
        if missing and short in declared:
            rep.add(
                "keys.partial",
                "warning",
                f"{sub} adapted on {len(layers)} of {len(expected)} layers; missing on layers {missing}",
                str(cfg.path),
            )
    for name in sorted(present_names - declared):
        rep.add("keys.undeclared", "warning", f"tensors adapt {name} but target_modules does not list it", str(cfg.path))


def _check_values(adapter_dir: Path, header, rep: ValidationReport) -> None:
    """Finite values and lora_B not all zero; reads one tensor at a time."""
    import torch
    from safetensors import safe_open

    wfile = adapter_dir / WEIGHTS_FILE
    nonzero_b = 0
    b_count = 0
    norms = {}
    with safe_open(str(wfile), framework="pt") as f:
        for name in header:
            t = f.get_tensor(name)
            key = parse_key(name)
            if not torch.isfinite(t).all():
                bad = int((~torch.isfinite(t)).sum())
                rep.add(
                    "values.nonfinite",
                    "error",
                    f"{bad} NaN/Inf values: vLLM loads it and corrupts other tenants' requests; retrain or fix",
                    f"{wfile}:{name}",
                )
                continue
            if key and key.kind == "B":
                b_count += 1
                if bool(t.any()):
                    nonzero_b += 1
            norms[name] = float(t.float().norm())
    if b_count and nonzero_b == 0:
        rep.add("values.untrained", "error", "every lora_B is zero: the adapter is untrained (a no-op)", str(wfile))
    elif b_count and nonzero_b < b_count:
        rep.add("values.zero_b", "warning", f"{b_count - nonzero_b} of {b_count} lora_B tensors are all zero", str(wfile))
    rep.stats["max_tensor_norm"] = max(norms.values(), default=0.0)


def validate_adapter(adapter_dir: Path, base_dir: Path | None = None, rules: FleetRules | None = None) -> ValidationReport:
    """Run all static checks. Never raises for a bad adapter: problems are checks in the report.

    Args:
        adapter_dir: the PEFT directory (adapter_config.json + adapter_model.safetensors).
        base_dir: the bf16 base checkpoint; only config.json, the index and headers are read.
        rules: the fleet's limits; defaults to vLLM's defaults (max rank 16).
    """
    adapter_dir = Path(adapter_dir)
    rules = rules or FleetRules()
    rep = ValidationReport(str(adapter_dir.resolve()), str(Path(base_dir).resolve()) if base_dir else None)
    if not adapter_dir.is_dir():
        rep.add("adapter.missing", "error", "adapter directory not found", str(adapter_dir))
        return rep
    cfg = None
    try:
        cfg = load_adapter_config(adapter_dir)
        _check_config(cfg, rules, rep)
    except FileNotFoundError as e:
        rep.add("config.missing", "error", str(e), str(adapter_dir / CONFIG_FILE))
    except ValueError as e:
        rep.add("config.invalid", "error", str(e), str(adapter_dir / CONFIG_FILE))
    base = None
    if base_dir is not None:
        try:
            base = read_checkpoint(Path(base_dir))
        except (FileNotFoundError, ValueError) as e:
            rep.add("base.unreadable", "error", str(e), str(base_dir))
    header = _check_tensors(adapter_dir, cfg, base, rules, rep)
    if header:
        _check_values(adapter_dir, header, rep)
    return rep


def load_report(path: Path) -> ValidationReport:
    return ValidationReport.from_dict(json.loads(Path(path).read_text()))
