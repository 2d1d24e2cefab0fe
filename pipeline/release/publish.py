"""Publish a registered adapter version to the adapter volume, atomically and immutably.

Layout: `<volume>/<NAME>-v<N>/` (one directory per version, never modified after creation:
vLLM's filesystem resolver never re-reads a loaded adapter, and an in-place reload from the
same path reuses stale prefix-cache KV; docs/vllm.md). Steps:

1. refuse a version whose validation verdict is not `pass` for the same weights sha256;
2. download the artifact into `<volume>/.staging/<NAME>-v<N>.<random>/` (same filesystem);
3. verify every file against the artifact's manifest;
4. rewrite `base_model_name_or_path` to the fleet's `vllm serve` model string (the original
   is kept in the manifest), write the updated manifest;
5. fsync files and directories, `rename` into place (atomic: the version directory either
   does not exist or is complete).

A crash leaves only `.staging/` debris, which the next publish removes.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from pipeline import registry
from pipeline.artifacts.atomic import fsync_dir, rmtree, seal_tree, write_json_atomic
from pipeline.artifacts.manifest import MANIFEST, file_hashes, read_manifest, verify_files
from pipeline.artifacts.volume import STAGING, version_dir
from pipeline.canary import gate as canary_gate
from pipeline.config import ProjectConfig
from pipeline.errors import CheckFailed
from pipeline.fleet.preflight import preflight
from pipeline.fleet.rollout import rollout
from pipeline.validate.publishable import prepare_for_fleet


class PublishError(CheckFailed):
    """The artifact or a volume directory fails its manifest, or the volume cannot be written."""


@dataclass
class Published:
    name: str
    version: int
    path: Path
    created: bool  # False: the version was already on the volume (no-op)
    previous_production: int | None = None
    instances: list[str] = field(default_factory=list)  # fleet instances that confirmed
    warnings: list[str] = field(default_factory=list)  # e.g. the canary measured another served checkpoint


def check_publishable(mv, weights_sha256: str) -> None:
    """Refuse unless the version's validation passed for exactly these weights."""
    tags = mv.tags or {}
    verdict = tags.get("validation.verdict")
    if verdict != "pass":
        raise CheckFailed(
            f"{mv.name} v{mv.version}: validation verdict is {verdict!r}; only a passing version is published "
            f"(see `pipeline validate` and the version's validation.report tag)"
        )
    if tags.get("validation.weights_sha256") != weights_sha256:
        raise CheckFailed(
            f"{mv.name} v{mv.version}: the passing validation report is for weights "
            f"{tags.get('validation.weights_sha256')}, but the artifact's weights are {weights_sha256}: re-validate"
        )


def materialise(cfg: ProjectConfig, mv, volume: Path) -> tuple[Path, bool]:
    """Write `<volume>/<name>-v<N>/` from the registry; returns (path, created)."""

    name, version = mv.name, int(mv.version)
    target = version_dir(volume, name, version)
    if target.exists():
        man = target / MANIFEST
        if not man.exists():
            raise PublishError(
                f"{target} exists without {MANIFEST}: not written by the pipeline; move it away"
            )
        problems = verify_files(target, read_manifest(target)["files"])
        if problems:
            raise PublishError(
                f"{target} differs from its manifest (volume tampered?):\n  " + "\n  ".join(problems)
            )
        return target, False

    staging_root = Path(volume) / STAGING
    staging_root.mkdir(parents=True, exist_ok=True)
    _clear_stale_staging(staging_root)
    work = Path(tempfile.mkdtemp(prefix=f"{name}-v{version}.", dir=staging_root))
    try:
        src = registry.download_version(cfg, mv, work / "download")
        manifest = read_manifest(src)
        problems = verify_files(src, manifest["files"])
        if problems:
            raise PublishError(
                f"{name} v{version}: registered artifact fails its manifest:\n  " + "\n  ".join(problems)
            )
        check_publishable(mv, manifest["files"].get("adapter_model.safetensors", ""))
        stage = work / "adapter"
        shutil.copytree(src, stage)
        # re-validate if the verdict's binding changed; rename keys / fold patterns for the fleet's vLLM (parity proven)
        for key, value in prepare_for_fleet(cfg, mv.tags or {}, stage).items():
            manifest[key] = {**manifest.get(key, {}), **value}
        acfg_path = stage / "adapter_config.json"
        acfg = json.loads(acfg_path.read_text())
        original = acfg.get("base_model_name_or_path")
        acfg["base_model_name_or_path"] = cfg.served.model
        acfg_path.write_text(json.dumps(acfg, indent=2, sort_keys=True) + "\n")
        manifest["registered_files"] = manifest["files"]
        manifest["files"] = file_hashes(stage)
        manifest["published"] = {
            "name": name,
            "version": version,
            "original_base_model_name_or_path": original,
            "base_model_name_or_path": cfg.served.model,
            "registry": {"tracking_uri": _redact(cfg.tracking_uri), "source": mv.source, "run_id": mv.run_id},
            "time": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        }
        # The manifest goes in last, then the whole directory appears at once.
        write_json_atomic(stage / MANIFEST, manifest)
        seal_tree(stage)
        try:
            os.rename(stage, target)
        except OSError as e:
            if target.exists():  # a concurrent publish of the same version won the race
                return target, False
            raise PublishError(f"cannot move {stage} to {target}: {e}") from e
        os.chmod(target, 0o555)
        fsync_dir(Path(volume))
        return target, True
    finally:
        rmtree(work)
        try:
            staging_root.rmdir()  # only when empty: a concurrent publish may be staging
        except OSError:
            pass


STALE_STAGING_S = 3600


def _clear_stale_staging(staging_root: Path) -> None:
    """Remove staging debris of publishes killed mid-way (untouched for an hour: no live publish
    of an adapter takes that long, and a live one keeps writing)."""
    import time

    for p in staging_root.iterdir():
        try:
            if time.time() - p.stat().st_mtime > STALE_STAGING_S:
                rmtree(p)
        except FileNotFoundError:
            pass


def _redact(uri: str) -> str:
    """Drop credentials from a URI before it lands in a manifest."""
    if "@" in uri and "://" in uri:
        scheme, rest = uri.split("://", 1)
        return f"{scheme}://***@{rest.split('@', 1)[1]}"
    return uri


def publish(cfg: ProjectConfig, name: str, version: int | None = None, alias: str | None = None) -> Published:
    """Publish `name` at `version` or `alias` to the volume and move alias `production` to it.

    Raises:
        UsageError: unknown model, version or alias (the volume is untouched).
        CheckFailed: the version did not pass validation for its weights, or its recorded canary
            failed / is missing while `canary.required` (`pipeline.canary.gate`).
        PublishError: the artifact or an existing version directory fails its manifest.
        FleetError: with `fleet.instances` configured, an instance did not switch to the new
            version (all restored; aliases and the fleet's desired state unchanged).
    """

    mv = registry.resolve_version(cfg, name, version, alias)

    warnings = canary_gate(cfg, mv)  # before anything is written
    if cfg.fleet.instances:
        preflight(cfg)  # every instance runs the configured vLLM and model: else exit 4, nothing written
    volume = cfg.volume.path
    volume.mkdir(parents=True, exist_ok=True)
    path, created = materialise(cfg, mv, volume)
    instances: list[str] = []
    if cfg.fleet.instances:  # every instance serves it (or all are restored) before any alias moves
        reports = rollout(cfg, name, int(mv.version), path)
        instances = [r.instance for r in reports if r.ok]
        warnings += [f"{r.instance}: {w}" for r in reports for w in r.warnings]
    prev = registry.set_alias(cfg, name, registry.ALIAS_PRODUCTION, int(mv.version))
    if prev is not None and prev != int(mv.version):
        registry.set_alias(cfg, name, registry.ALIAS_PREVIOUS, prev)
    # also sets the summary tags published.path / published.time / published.instances
    registry.record_event(
        cfg,
        name,
        int(mv.version),
        {
            "type": "publish",
            "path": str(path),
            "created": created,
            "from_version": prev,
            "instances": instances,
        },
    )
    return Published(name, int(mv.version), path, created, prev, instances, warnings)
