"""Validate a LoRA adapter against the base it was trained on and the fleet that will serve it.

Every check is a registered rule (`pipeline.validate.rules`): a stable id (`area.what`), a
severity, a doc line and one small function, grouped by concern in `weights`, `config_checks`,
`fleet_checks`, `keys`, `values`, `served`, `template_checks`, `behaviour` and `train_checks`; `docs/validation.md`'s
table is generated from the rule table (`RULES`). Each finding says what is wrong, where (file, tensor, layer)
and how to fix it. The verdict is `pass` when no finding has severity `error`. Only headers of
the base and served checkpoints are read; adapter tensors are read through one memory map, and
neither torch nor transformers is imported unless `behaviour=True`.

Rules taken from vLLM (vllm/lora/peft_helper.py, vllm/lora/utils.py, vllm/config/lora.py,
vllm/model_executor/models/qwen3_5.py) live in `pipeline.serving`, keyed by vLLM version.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from pipeline.artifacts.hashing import sha256_file
from pipeline.artifacts.manifest import read_adapter_manifest
from pipeline.validate.context import Context, Options
from pipeline.validate.report import REPORT_FILE, FleetRules, ValidationReport
from pipeline.validate.rules import RULES, Unavailable, rules_version, run
from pipeline.validate.template import check_training_config

# The modules whose checks are registered by importing them (registration order = run order within an area).
CHECK_MODULES = tuple(
    importlib.import_module(f"pipeline.validate.{m}")
    for m in (
        "weights",
        "config_checks",
        "fleet_checks",
        "keys",
        "values",
        "served",
        "template_checks",
        "behaviour",
        "acceptance",
        "train_checks",
    )
)
__all__ = [
    "RULES",
    "REPORT_FILE",
    "FleetRules",
    "ValidationReport",
    "default_base",
    "validate_adapter",
    "validate_with_config",
]


def _stats(ctx: Context) -> None:
    try:
        header = ctx.header
    except Unavailable:
        return
    lora_params = sum(_numel(m.a.shape) + _numel(m.b.shape) for m in ctx.modules if m.a and m.b)
    ctx.report.stats.update(
        {
            "lora_modules": len(ctx.modules),
            "lora_parameters": lora_params,
            "weights_bytes": ctx.wfile.stat().st_size,
        }
    )
    ctx.report.weights_sha256 = ctx.weights_sha256
    _ = header


def _allowed(rep: ValidationReport, allow: frozenset[str]) -> None:
    """An error whose id `--allow` names is kept as info (the verdict records the allowed ids in `bound`)."""
    for f in rep.findings:
        if f.id in allow and f.severity == "error":
            f.severity = "info"
            f.message = f"allowed by --allow {f.id}: {f.message}"


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _bind(ctx: Context) -> dict:
    """What the verdict was computed against (publish re-checks when any of it differs)."""
    served = None
    try:
        s = ctx.served
        cfg_file = s.path / "config.json"
        served = {
            "checkpoint": ctx.rules.served_checkpoint,
            "revision": ctx.rules.served_revision,
            "path": str(s.path),
            "config_sha256": sha256_file(cfg_file) if cfg_file.is_file() else None,
        }
    except Unavailable:
        if ctx.served_dir is None:
            served = {
                "checkpoint": ctx.rules.served_checkpoint,
                "revision": ctx.rules.served_revision,
                "path": None,
            }
    return {
        "weights_sha256": ctx.report.weights_sha256,
        "served": served,
        "vllm_version": ctx.rules.vllm_version,
        "fleet": ctx.rules.profile(),
        "rules_version": rules_version(),
        "allowed": sorted(ctx.options.allow),
    }


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
    allow: set[str] | frozenset[str] = frozenset(),
    require_base: bool = False,
) -> ValidationReport:
    """Run every registered check. Never raises for a bad adapter: problems are findings in the report.

    Args:
        adapter_dir: the PEFT directory (adapter_config.json + adapter_model.safetensors).
        base_dir: the bf16 base checkpoint; only config.json, the index and headers are read.
        rules: the fleet's profile; defaults to vLLM's defaults (max rank 16, API loading, vLLM 0.19.2).
        served_dir: the served checkpoint (default `rules.served_path`); headers and tokenizer only.
        training_config: the resolved axolotl config (for the training chat template); default
            the `resolved_config` named in the adapter's manifest.json.
        behaviour: also load base + adapter with transformers/peft on CPU (tiny models) and
            compare eval loss and greedy canary outputs (`pipeline.validate.behaviour`).
        validation_files: chat JSONL for the behaviour eval (default: the manifest's validation files).
        fold_rslora: first rewrite an rsLoRA adapter_config.json in place to plain scaling
            (`pipeline.artifacts.normalise.fold_rslora`; warning `config.rslora_folded`, or error
            `config.rslora_parity` and nothing written if any module's scale would change).
        allow: finding ids (`pipeline.validate.catalogue`) whose refusal is overridden: their errors are kept as
            info and the ids are recorded in the verdict's `bound` (publish honours them when re-validating).
        require_base: no base is an error (`base.missing`).

    Raises UsageError only for a wrong option: a `training_config` given that is missing, not YAML
    or not a mapping.
    """
    adapter_dir = Path(adapter_dir)
    if training_config is not None:
        check_training_config(training_config)
    rules = rules or FleetRules()
    served_dir = served_dir or rules.served_path
    rep = ValidationReport(
        adapter=str(adapter_dir.resolve()), base=str(Path(base_dir).resolve()) if base_dir else None
    )
    options = Options(behaviour, fold_rslora, validation_files, training_config, frozenset(allow))
    ctx = Context(
        adapter_dir,
        Path(base_dir) if base_dir else None,
        rules,
        Path(served_dir) if served_dir else None,
        rep,
        options,
    )
    if not adapter_dir.is_dir():  # only say that: every other check would repeat it
        run(ctx, rep)
        rep.findings = [f for f in rep.findings if f.id == "adapter.missing"]
        rep.bound = _bind(ctx)
        return rep
    opts = [
        o
        for o, on in (("behaviour", behaviour), ("require_base", require_base), ("fold_rslora", fold_rslora))
        if on
    ]
    run(ctx, rep, options=opts)
    _allowed(rep, options.allow)
    _stats(ctx)
    rep.bound = _bind(ctx)
    return rep


def default_base(cfg, adapter_dir: Path) -> Path | None:
    """The base to validate against: config `base.path`, else a local `base_model` named in manifest.json."""
    if cfg.base.path:
        return cfg.base.path
    mp = Path(adapter_dir) / "manifest.json"
    if mp.is_symlink() or not mp.is_file():
        return None
    try:
        b = read_adapter_manifest(Path(adapter_dir)).base_model.id
    except (FileNotFoundError, ValueError, OSError):
        return None
    return Path(b) if b and Path(b).is_dir() else None


def validate_with_config(cfg, adapter_dir: Path, base_dir: Path | None = None, **kwargs) -> ValidationReport:
    """`validate_adapter` with the project config's base, served checkpoint and fleet rules.

    A missing base is an error finding (`base.missing`), not an exception: the report still
    records everything else (used by register/run, which store the report).
    """
    base_dir = base_dir or default_base(cfg, adapter_dir)
    return validate_adapter(adapter_dir, base_dir, FleetRules.from_config(cfg), require_base=True, **kwargs)
