"""Normalise an rsLoRA adapter to plain LoRA scaling, proving the served scale is unchanged.

rsLoRA scales a module's update by `alpha / sqrt(r)`, plain LoRA by `alpha / r` (peft's
LoraLayer, vllm/lora/peft_helper.py). Folding sets `lora_alpha' = alpha * sqrt(r)` (and the
same per `alpha_pattern` / `rank_pattern` entry) and `use_rslora: false`, so every vLLM version
serves the adapter with the scale it was trained with. The weights are not touched.

The fold is checked module by module against the tensors' own module names: where patterns
overlap so that a rescaled pattern would give some module another scale, an exact
`alpha_pattern` entry for that module is put first (peft and vLLM take the first match).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.artifacts.adapter import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    AdapterConfig,
    adapter_tensors,
    load_adapter_config,
    parse_key,
    pattern_value,
)
from pipeline.artifacts.atomic import write_json_atomic
from pipeline.artifacts.manifest import MANIFEST, file_hashes, read_manifest

REL_TOL = 1e-9


class ParityError(RuntimeError):
    """Folding would change some module's effective scale; nothing was written."""


@dataclass
class FoldResult:
    folded: bool
    old: dict = field(default_factory=dict)  # lora_alpha / alpha_pattern / use_rslora before
    new: dict = field(default_factory=dict)
    parity: list[str] = field(default_factory=list)  # modules whose scale would change: must be empty
    modules: int = 0  # modules parity-checked


def module_names(adapter_dir: Path) -> list[str]:
    """PEFT module names of every LoRA pair in the weights file (header only)."""

    names = {k.peft_module for n in adapter_tensors(adapter_dir) if (k := parse_key(n))}
    return sorted(names)


def fold_config(raw: dict, modules: list[str]) -> tuple[dict, list[str]]:
    """The plain-LoRA equivalent of an rsLoRA config; returns (new config, modules failing parity)."""
    old = AdapterConfig(raw, Path(CONFIG_FILE))
    r, alpha = old.r, old.lora_alpha
    rank_pattern = raw.get("rank_pattern") or {}
    new_pattern: dict[str, float] = {}
    for key, a in (raw.get("alpha_pattern") or {}).items():
        new_pattern[key] = float(a) * math.sqrt(int(pattern_value(rank_pattern, key, r)))
    for key, rk in rank_pattern.items():
        new_pattern.setdefault(
            key, float(pattern_value(raw.get("alpha_pattern"), key, alpha)) * math.sqrt(int(rk))
        )
    new = dict(raw, use_rslora=False, lora_alpha=alpha * math.sqrt(r), alpha_pattern=new_pattern)
    # Exact per-module entries wherever overlapping patterns would change a module's scale.
    exact: dict[str, float] = {}
    for m in modules:
        want = old.scale_for(m)
        if not math.isclose(AdapterConfig(new, Path(CONFIG_FILE)).scale_for(m), want, rel_tol=REL_TOL):
            exact[re.escape(m)] = want * old.rank_for(m)
    if exact:
        new["alpha_pattern"] = exact | new_pattern
    newcfg = AdapterConfig(new, Path(CONFIG_FILE))
    bad = [m for m in modules if not math.isclose(newcfg.scale_for(m), old.scale_for(m), rel_tol=REL_TOL)]
    return new, bad


def fold_rslora(adapter_dir: Path) -> FoldResult:
    """Rewrite `adapter_config.json` in place with the rsLoRA scale folded into lora_alpha.

    Writes atomically; if the directory has a `manifest.json`, its file hashes are refreshed and
    the original values recorded under `normalised.rslora`. A no-op without `use_rslora`.

    Raises:
        FileNotFoundError / ValueError: unreadable adapter_config.json or weights header.
        ParityError: the parity check failed (nothing written).
    """

    adapter_dir = Path(adapter_dir)
    cfg = load_adapter_config(adapter_dir)
    if not cfg.use_rslora:
        return FoldResult(False)
    modules = module_names(adapter_dir) if (adapter_dir / WEIGHTS_FILE).exists() else []
    new, bad = fold_config(cfg.raw, modules)
    keys = ("use_rslora", "lora_alpha", "alpha_pattern")
    res = FoldResult(
        True, {k: cfg.raw.get(k) for k in keys}, {k: new.get(k) for k in keys}, bad, len(modules)
    )
    if bad:
        raise ParityError(f"{cfg.path}: folding rsLoRA would change the scale of {bad[:5]}: left unchanged")
    write_json_atomic(cfg.path, new)
    if (adapter_dir / MANIFEST).exists():
        man = read_manifest(adapter_dir)
        man["files"] = file_hashes(adapter_dir)
        man.setdefault("normalised", {})["rslora"] = {"before": res.old, "after": res.new}
        if isinstance(man.get("adapter"), dict):
            man["adapter"].update({k: new.get(k) for k in keys})
        write_json_atomic(adapter_dir / MANIFEST, man)
    return res


def scale_table(raw: dict, modules: list[str]) -> dict[str, float]:
    """{module: scale} under a config (for reports and tests)."""
    cfg = AdapterConfig(json.loads(json.dumps(raw)), Path(CONFIG_FILE))
    return {m: cfg.scale_for(m) for m in modules}
