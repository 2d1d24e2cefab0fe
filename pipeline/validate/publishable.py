"""What `pipeline publish` asks validation before a version goes onto the volume.

1. The verdict is bound to what it checked (`ValidationReport.bound`: weights, served checkpoint identity,
   the whole fleet profile the rules read (`FleetRules.profile()`: max rank, target modules, embedding
   targets, loading mode, served model, vLLM version...), rules version). When any of it differs now, the
   registered adapter is re-validated statically against the current config; a failure refuses the publish.
2. The fleet's vLLM version must lie in a known range (`pipeline.serving.versions`), unless the verdict was
   computed with `--allow serving.version_unknown`.
3. The staging copy is normalised for the served class and version (`normalise_for_serving`: keys renamed to
   the served layout, patterns folded into lora_B, safetensors `format` metadata), each step parity-proven.

Returns the record publish writes into the manifest (`normalised`, `revalidated`).
"""

from __future__ import annotations

from pathlib import Path

from pipeline.artifacts.bounded import loads_json
from pipeline.artifacts.checkpoint import read_checkpoint
from pipeline.artifacts.hashing import sha256_file
from pipeline.artifacts.normalise import ParityError, normalise_for_serving
from pipeline.errors import CheckFailed
from pipeline.serving.modules import serving_class
from pipeline.serving.versions import UnknownVllmVersion, rules_for
from pipeline.validate import default_base, validate_adapter
from pipeline.validate.report import FleetRules
from pipeline.validate.rules import rules_version


def _bound(tags: dict) -> dict:
    try:
        return (
            loads_json(tags.get("validation.report") or "{}", "the validation.report tag", 64 * 1024).get(
                "bound"
            )
            or {}
        )
    except (ValueError, AttributeError):  # not JSON or over the bounds (pipeline.artifacts.bounded)
        return {}


def current_binding(cfg) -> dict:
    """The served identity, fleet version and rules version publish would validate against now."""
    path = cfg.served.path
    cfg_file = Path(path) / "config.json" if path else None
    return {
        "served": {
            "revision": cfg.served.revision,
            "path": str(path) if path else None,
            "config_sha256": sha256_file(cfg_file) if cfg_file and cfg_file.is_file() else None,
        },
        "vllm_version": cfg.fleet.vllm_version,
        "fleet": FleetRules.from_config(cfg).profile(),
        "rules_version": rules_version(),
    }


def binding_differences(bound: dict, now: dict) -> list[str]:
    """What differs between the verdict's binding and now (empty: the verdict still holds)."""
    if not bound:
        return ["the verdict records no binding (validated by an older pipeline)"]
    out = []
    if bound.get("vllm_version") != now["vllm_version"]:
        out.append(f"fleet vLLM version {bound.get('vllm_version')} -> {now['vllm_version']}")
    if bound.get("rules_version") != now["rules_version"]:
        out.append(f"validation rules {bound.get('rules_version')} -> {now['rules_version']}")
    b, n = bound.get("served") or {}, now["served"]
    if (b.get("revision") or None) != (n["revision"] or None):
        out.append(f"served revision {b.get('revision')} -> {n['revision']}")
    if b.get("config_sha256") != n["config_sha256"]:
        out.append(f"served checkpoint {b.get('path')} -> {n['path']} (config.json sha256 differs)")
    fleet, fleet_now = bound.get("fleet"), now["fleet"]
    if fleet is None:
        out.append("the verdict records no fleet profile (validated by an older pipeline)")
        return out
    shown = {"vllm_version", "served_revision"}  # said above
    for key in sorted(set(fleet) | set(fleet_now)):
        if key not in shown and fleet.get(key) != fleet_now.get(key):
            out.append(f"fleet profile {key} {fleet.get(key)!r} -> {fleet_now.get(key)!r}")
    return out


def _serving_class(cfg, stage: Path, rng) -> str | None:
    """The class the fleet serves with: `served.path`'s `architectures`; without a served checkpoint, the only
    class the fleet's vLLM registers for a Qwen3.5 base (`serving_class`: 0.19-0.26 serve the VL class whatever the
    checkpoint, so text-layout keys must be renamed even when no served checkpoint is configured)."""
    if cfg.served.path:
        if not (Path(cfg.served.path) / "config.json").is_file():
            return None
        try:
            arch = read_checkpoint(Path(cfg.served.path)).config.get("architectures") or [None]
        except (FileNotFoundError, ValueError, OSError):
            return None
        return arch[0] if isinstance(arch, list) else None
    base = default_base(cfg, stage)
    try:
        bcfg = read_checkpoint(Path(base)).config if base else {}
    except (FileNotFoundError, ValueError, OSError):
        return None
    return serving_class(None, rng, (bcfg.get("text_config") or bcfg).get("model_type"))


def prepare_for_fleet(cfg, tags: dict, stage: Path) -> dict:
    """Re-check if needed, then normalise `stage` (the copy about to be published) in place.

    Returns {"normalised": {...}, "revalidated": {...}} (empty dicts dropped) for the manifest.
    Raises CheckFailed: re-validation failed, the fleet's vLLM version is unknown, or a normalisation
    would not be exact (the volume is untouched: the caller discards the staging copy).
    """
    bound = _bound(tags)
    record: dict = {}
    now = current_binding(cfg)
    diffs = binding_differences(bound, now)
    allow = set(bound.get("allowed") or [])
    if diffs:
        rep = validate_adapter(
            stage, default_base(cfg, stage), FleetRules.from_config(cfg), allow=allow, require_base=True
        )
        if not rep.passed:
            errors = sorted({c.id for c in rep.errors})
            shown = "\n  ".join(str(c) for c in rep.errors[:10])
            raise CheckFailed(
                f"the validation verdict was computed against something else ({'; '.join(diffs)}), and re-validating "
                f"against the current config fails ({', '.join(errors)}):\n  {shown}\nfix the adapter or the config, "
                "then `pipeline register` it again"
            )
        record["revalidated"] = {
            "because": diffs,
            "verdict": rep.verdict,
            "rules_version": now["rules_version"],
        }
    try:
        rng = rules_for(cfg.fleet.vllm_version)
    except UnknownVllmVersion as e:
        if "serving.version_unknown" not in allow:
            raise CheckFailed(f"{e}; nothing was published") from e
        return record
    try:
        normalised = normalise_for_serving(stage, _serving_class(cfg, stage, rng), rng)
    except ParityError as e:
        raise CheckFailed(
            f"{e}; the adapter cannot be served exactly as trained: nothing was published"
        ) from e
    if normalised:
        record["normalised"] = normalised
    return record
