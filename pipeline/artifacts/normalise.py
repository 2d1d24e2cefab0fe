"""Every rewrite of an adapter's files: what is changed in an adapter on its way to the fleet, and how it is proven.

Publish changes the staging copy (never the registered artifact) with `normalise_for_serving` (keys renamed
to the served layout, rank_pattern/alpha_pattern folded into lora_B for a vLLM that ignores them, safetensors
`format` metadata; each parity-proven) and `rewrite_base_model` (`base_model_name_or_path` set to the fleet's
`vllm serve` model string; the original is kept in the manifest). `fold_rslora` is `pipeline validate
--fold-rslora`. The rsLoRA fold:

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
import os
import re
from collections.abc import Callable
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
    read_adapter_config,
)
from pipeline.artifacts.atomic import write_json_atomic
from pipeline.artifacts.manifest import MANIFEST, file_hashes, read_adapter_manifest, write_manifest
from pipeline.artifacts.peft_match import ALL_LINEAR
from pipeline.artifacts.safetensors import file_metadata, read_safetensors_header, write_safetensors
from pipeline.errors import CheckFailed
from pipeline.serving.modules import runtime_target, served_key_prefix

REL_TOL = 1e-9


class ParityError(CheckFailed, RuntimeError):
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
        man = read_adapter_manifest(adapter_dir)
        man.files = file_hashes(adapter_dir)
        man.normalised = {**(man.normalised or {}), "rslora": {"before": res.old, "after": res.new}}
        man.adapter = man.adapter.model_copy(update={k: new.get(k) for k in keys})
        write_manifest(adapter_dir, man)
    return res


def scale_table(raw: dict, modules: list[str]) -> dict[str, float]:
    """{module: scale} under a config (for reports and tests)."""
    cfg = AdapterConfig(json.loads(json.dumps(raw)), Path(CONFIG_FILE))
    return {m: cfg.scale_for(m) for m in modules}


# -- normalising for the served vLLM version (publish) ---------------------------------------------------------------
def _read_tensors(wfile: Path) -> tuple[dict, dict]:
    """({name: (dtype, shape, bytes)} in file order, __metadata__ or {}). Raises HeaderError/OSError."""
    header = read_safetensors_header(wfile)
    data = wfile.read_bytes()
    return {n: (i.dtype, i.shape, data[i.offset : i.offset + i.nbytes]) for n, i in header.items()}, (
        file_metadata(wfile) or {}
    )


def _rename_key(tensor: str, old: str, new: str) -> str:
    stem = tensor.removeprefix("base_model.model.")
    head = tensor[: len(tensor) - len(stem)]
    return head + new + stem[len(old) :] if stem.startswith(old) else tensor


def _same_scale(old_cfg: AdapterConfig, old: str, new_cfg: AdapterConfig, new: str) -> bool:
    return old_cfg.rank_for(old) == new_cfg.rank_for(new) and math.isclose(
        old_cfg.scale_for(old), new_cfg.scale_for(new), rel_tol=REL_TOL
    )


def rename_layout(adapter_dir: Path, architecture: str, rng) -> dict | None:
    """Rename decoder-layer keys the served class never applies into its layout (`model.layers.N` ->
    `model.language_model.layers.N` for `Qwen3_5ForConditionalGeneration`), in place.

    Parity: every tensor's bytes are unchanged, every module keeps its rank and scale (pattern keys naming
    the old prefix are renamed too, escaped or not; a module whose pattern value a renamed key would still
    change gets an exact entry of its own, first) and PEFT's matching targets the same modules
    (`target_modules` / `exclude_modules` list entries renamed; a regex `target_modules` or `exclude_modules`,
    matched against the whole name, becomes the exact list of the adapter's modules). Returns the manifest
    record, or None when nothing needed renaming. Raises ParityError (nothing written).
    """
    adapter_dir = Path(adapter_dir)
    want = served_key_prefix(architecture)
    if want is None:
        return None
    old_prefix = {
        "model.language_model.layers.": "model.layers.",
        "model.layers.": "model.language_model.layers.",
    }[want]
    wfile = adapter_dir / WEIGHTS_FILE
    tensors, meta = _read_tensors(wfile)
    renames = {}
    for name in tensors:
        k = parse_key(name)
        if (
            k
            and k.peft_module.startswith(old_prefix)
            and runtime_target(k.peft_module, architecture, rng).status != "applied"
        ):
            renames[name] = _rename_key(name, old_prefix, want)
    if not renames:
        return None
    new_names = [renames.get(n, n) for n in tensors]
    if len(set(new_names)) != len(new_names):
        raise ParityError(f"{wfile}: renaming {old_prefix}N to {want}N would collide with keys already there")
    cfg = load_adapter_config(adapter_dir)
    raw = json.loads(json.dumps(cfg.raw))

    def moved(text: str) -> str:  # a name or a regex naming the old prefix (escaped or not)
        return text.replace(old_prefix, want).replace(re.escape(old_prefix), re.escape(want))

    # every module of the adapter: its PEFT name before -> after (unrenamed modules keep theirs)
    pairs = {
        parse_key(n).peft_module: parse_key(renames.get(n, n)).peft_module for n in tensors if parse_key(n)
    }
    for field_name in ("rank_pattern", "alpha_pattern"):
        if isinstance(raw.get(field_name), dict):
            raw[field_name] = {moved(k): v for k, v in raw[field_name].items()}
    targets_before = raw.get("target_modules")
    if isinstance(targets_before, list):
        raw["target_modules"] = [moved(t) for t in targets_before]
    if isinstance(raw.get("exclude_modules"), list):
        raw["exclude_modules"] = [moved(t) for t in raw["exclude_modules"]]
    if (isinstance(targets_before, str) and targets_before != ALL_LINEAR) or isinstance(
        raw.get("exclude_modules"), str
    ):
        # A regex (target_modules or exclude_modules) is matched against the whole name: written for one class,
        # it may match nothing, or everything, in the other. The exact equivalent for this adapter is the list of
        # its modules' new names (PEFT: an exact name targets that module); exclude_modules then has nothing
        # left to exclude.
        raw["target_modules"] = sorted(new for old, new in pairs.items() if cfg.targets(old))
        raw.pop("exclude_modules", None)
    new_cfg = AdapterConfig(raw, cfg.path)
    off = [old for old, new in pairs.items() if not _same_scale(cfg, old, new_cfg, new)]
    if off:
        # A pattern key `moved` cannot rewrite (`model[.]layers[.]3`, a class of prefixes...): exact entries for
        # each module whose rank or alpha would change, first (peft and vLLM take the first matching key).
        for field_name, value in (("rank_pattern", cfg.rank_for), ("alpha_pattern", cfg.alpha_for)):
            if isinstance(raw.get(field_name), dict):
                exact = {re.escape(pairs[old]): value(old) for old in off}
                raw[field_name] = exact | {k: v for k, v in raw[field_name].items() if k not in exact}
        new_cfg = AdapterConfig(raw, cfg.path)
    bad = [
        old
        for old, new in pairs.items()
        if not _same_scale(cfg, old, new_cfg, new) or cfg.targets(old) != new_cfg.targets(new)
    ]
    if bad:
        raise ParityError(
            f"{cfg.path}: renaming changes the scale or targeting of {sorted(set(bad))[:5]}: left unchanged"
        )
    out = {renames.get(n, n): v for n, v in tensors.items()}

    def verify(written, check: bytes) -> None:
        for name, (_, _, data) in tensors.items():
            info = written[renames.get(name, name)]
            if check[info.offset : info.offset + info.nbytes] != data:
                raise ParityError(f"{wfile}: tensor {name} changed while renaming: left unchanged")

    _rewrite(wfile, out, {**meta, "format": "pt"}, verify)
    if raw != cfg.raw:
        write_json_atomic(cfg.path, raw)
    modules = sorted({parse_key(n).peft_module for n in renames})
    return {
        "from": f"{old_prefix}N",
        "to": f"{want}N",
        **(
            {"target_modules": {"before": targets_before, "after": raw["target_modules"]}}
            if raw.get("target_modules") != targets_before
            else {}
        ),
        "architecture": architecture,
        "vllm": rng.name,
        "modules": len(modules),
        "tensors": len(renames),
        "parity": "tensor bytes identical; scale and PEFT targeting identical per module",
    }


def fold_patterns(adapter_dir: Path, rng) -> dict | None:
    """Fold rank_pattern/alpha_pattern scales into lora_B for a vLLM that ignores the patterns, in place.

    vLLM 0.19-0.25 scale every module by the global alpha/r (docs/vllm.md); PEFT trained module m with
    s(m) = alpha_pattern(m)/rank_pattern(m). Folding writes B' = B x s(m)/(alpha/r) (float32) and replaces
    alpha_pattern with exact per-module entries alpha'(m) = (alpha/r) x rank(m), so a version that honours
    the patterns (0.32+, PEFT) and one that ignores them both apply alpha/r x B' = s(m) x B. Parity is
    checked per module on the written file (max |s_new x B' - s(m) x B| <= 1e-6 x max |s(m) x B|).
    Returns the manifest record, or None when no module's scale differs. Raises ParityError.
    """
    import numpy as np

    adapter_dir = Path(adapter_dir)
    if rng.honours_patterns:
        return None
    cfg = load_adapter_config(adapter_dir)
    if not cfg.r or not (cfg.raw.get("rank_pattern") or cfg.raw.get("alpha_pattern")):
        return None
    glob = cfg.global_scale()
    wfile = adapter_dir / WEIGHTS_FILE
    tensors, meta = _read_tensors(wfile)
    modules = sorted({k.peft_module for n in tensors if (k := parse_key(n))})
    factors = {m: cfg.scale_for(m) / glob for m in modules}
    changed = {m: f for m, f in factors.items() if not math.isclose(f, 1.0, rel_tol=REL_TOL)}
    if not changed or glob == 0:
        return None
    out = dict(tensors)
    for name, (dtype, shape, data) in tensors.items():
        k = parse_key(name)
        if k and k.kind == "B" and k.peft_module in changed:
            b = _to_f32(data, dtype) * np.float64(changed[k.peft_module])
            out[name] = ("F32", shape, b.astype("<f4").tobytes())
    raw = json.loads(json.dumps(cfg.raw))
    root = math.sqrt if cfg.use_rslora else (lambda x: x)
    raw["alpha_pattern"] = {
        re.escape(m): glob * root(cfg.rank_for(m)) for m in modules if cfg.rank_for(m) != cfg.r
    }
    new_cfg = AdapterConfig(raw, cfg.path)
    bad = [m for m in modules if not math.isclose(new_cfg.scale_for(m), glob, rel_tol=REL_TOL)]
    if bad:
        raise ParityError(f"{cfg.path}: folding patterns leaves {bad[:5]} with another scale: left unchanged")

    def verify(written, blob: bytes) -> None:
        for name, (dtype, _, data) in tensors.items():
            k = parse_key(name)
            if not (k and k.kind == "B"):
                continue
            info = written[name]
            new_b = _to_f32(blob[info.offset : info.offset + info.nbytes], info.dtype) * glob
            old_b = _to_f32(data, dtype) * cfg.scale_for(k.peft_module)
            tol = 1e-6 * max(float(np.abs(old_b).max()), 1e-30)
            if not float(np.abs(new_b - old_b).max()) <= tol:  # a NaN proves no parity (nan > tol is False)
                raise ParityError(f"{wfile}: folded {name} differs from the trained delta: left unchanged")

    _rewrite(wfile, out, {**meta, "format": "pt"}, verify)
    write_json_atomic(cfg.path, raw)
    return {
        "vllm": rng.name,
        "reason": "the fleet's vLLM ignores rank_pattern/alpha_pattern (global alpha/r)",
        "global_scale": glob,
        "modules": {m: round(f, 9) for m, f in sorted(changed.items())},
        "before": {
            "rank_pattern": cfg.raw.get("rank_pattern"),
            "alpha_pattern": cfg.raw.get("alpha_pattern"),
        },
        "after": {"alpha_pattern": raw["alpha_pattern"]},
        "parity": "per module: alpha/r x B' equals the trained scale x B (rel 1e-6); lora_A unchanged",
    }


def ensure_format_metadata(adapter_dir: Path) -> dict | None:
    """Write `__metadata__ {"format": "pt"}` into the weights file when missing (tensor bytes unchanged)."""
    wfile = Path(adapter_dir) / WEIGHTS_FILE
    meta = file_metadata(wfile)
    if (meta or {}).get("format") == "pt":
        return None
    tensors, meta = _read_tensors(wfile)
    write_safetensors(wfile, tensors, {**meta, "format": "pt"})
    return {"before": meta or None, "after": {**meta, "format": "pt"}}


def _rewrite(wfile: Path, tensors: dict, meta: dict, verify: Callable[[dict, bytes], None]) -> None:
    """Replace `wfile` with `tensors` only once `verify(header, bytes)` of the written copy passes.

    The copy is a sibling file renamed over `wfile`; when `verify` raises (ParityError) or the write
    fails, the copy is removed and `wfile` is as it was.
    """
    tmp = wfile.with_name(f".{wfile.name}.{os.getpid()}.rewrite")
    try:
        write_safetensors(tmp, tensors, meta)
        verify(read_safetensors_header(tmp), tmp.read_bytes())
        os.replace(tmp, wfile)
    finally:
        tmp.unlink(missing_ok=True)


def _to_f32(data: bytes, dtype: str):
    import numpy as np

    raw = np.frombuffer(data, dtype=np.uint8)
    if dtype == "BF16":
        out = np.zeros(len(data) // 2, dtype=np.float32)
        out.view(np.uint16)[1::2] = raw.view(np.uint16)
        return out.astype(np.float64)
    if dtype == "F16":
        return raw.view(np.float16).astype(np.float64)
    return raw.view(np.float32).astype(np.float64)


# The rewrites `normalise_for_serving` can do, by manifest key (tests cover each: every directory publish
# writes passes validate).
NORMALISE_STEPS = ("layout", "patterns", "safetensors_metadata")


def normalise_for_serving(adapter_dir: Path, architecture: str | None, rng) -> dict:
    """Make `adapter_dir` (a staging copy) serve exactly as trained on `rng` with `architecture`, in place.

    Steps, each only when needed, each parity-proven: `layout` (`rename_layout`), `patterns`
    (`fold_patterns`), `safetensors_metadata` (`ensure_format_metadata`). Returns {step: record} for
    the manifest's `normalised`. Raises ParityError (the caller refuses to publish).
    """
    out = {}
    if architecture is not None and (rec := rename_layout(adapter_dir, architecture, rng)):
        out["layout"] = rec
    if rec := fold_patterns(adapter_dir, rng):
        out["patterns"] = rec
    if rec := ensure_format_metadata(adapter_dir):
        out["safetensors_metadata"] = rec
    return out


def rewrite_base_model(adapter_dir: Path, served_model: str) -> str | None:
    """Set `base_model_name_or_path` in `adapter_config.json` to `served_model` (the string given to
    `vllm serve`, which vLLM compares it with); returns the original value. No weights are touched.

    Raises OSError / ValueError for an unreadable config (the caller's copy was verified before).
    """
    path = Path(adapter_dir) / CONFIG_FILE
    acfg = read_adapter_config(adapter_dir).raw
    original = acfg.get("base_model_name_or_path")
    path.write_text(
        json.dumps({**acfg, "base_model_name_or_path": served_model}, indent=2, sort_keys=True) + "\n"
    )
    return original
