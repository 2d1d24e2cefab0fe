"""Publish a registered adapter version to the adapter volume and the fleet, as one transaction.

Layout: `<volume>/<NAME>-v<N>/` (one directory per version, never modified after creation:
vLLM's filesystem resolver never re-reads a loaded adapter, and an in-place reload from the
same path reuses stale prefix-cache KV; docs/vllm.md). `publish` (and `promote`, the follower,
`pipeline run`, `pipeline demo`) runs inside `pipeline.release.transaction`: one lock per
adapter, an intent record, recovery of a killed predecessor. Steps:

1. before anything is written: the name's grammar, the version's validation verdict for its
   weights and its canary (`pipeline.canary.gate`), a writable volume;
2. under the adapter lock: finish what a killed transaction left, read the aliases and the
   desired state, write the intent record;
3. `materialise`: download the artifact into `<state_dir>/tmp/` (local), verify every file against
   its manifest, then write the version directory through `pipeline.artifacts.volume.staged_version`
   (free space, `.staging/<NAME>/`, seal, fsync, `rename` into place: the version directory either
   does not exist or is complete) with the rewrites of `pipeline.artifacts.normalise` (served key
   layout, patterns, `base_model_name_or_path` = the fleet's `vllm serve` model string; originals
   kept in the manifest) and where it came from (`pipeline.release.origin`). An existing directory
   is verified against its manifest and its origin instead;
4. under the fleet lock: the rollout (every instance, or every instance put back and exit 4),
   then the desired state, `production` and `previous`, the publish event; the record is removed.

Staging debris of killed publishes is removed by the next publish of any adapter
(`pipeline.artifacts.volume.clear_debris`): an entry of `.staging/` whose adapter's lock nobody
holds belongs to no live publish.
"""

from __future__ import annotations

import datetime as dt
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from pipeline import registry
from pipeline.artifacts.adapter_files import copy_adapter
from pipeline.artifacts.manifest import (
    Origin,
    PublishRecord,
    file_hashes,
    read_adapter_manifest,
    verify_files,
    write_manifest,
)
from pipeline.artifacts.names import check_name
from pipeline.artifacts.normalise import rewrite_base_model
from pipeline.artifacts.volume import (
    STAGING,
    check_fleet_access,
    check_own_version_dir,
    check_writable,
    clear_debris,
    remove_version,
    staged_version,
    tree_size,
    verify_version_dir,
    version_dir,
)
from pipeline.canary import gate as canary_gate
from pipeline.config import ProjectConfig
from pipeline.errors import CheckFailed, FleetError, VolumeError
from pipeline.fleet.instances import InstanceReport
from pipeline.fleet.preflight import preflight
from pipeline.fleet.state import fleet_lock, load_state
from pipeline.registry.store import redact_uri
from pipeline.release.origin import expected_origin, origin_problem
from pipeline.release.transaction import (
    Intent,
    adapter_transaction,
    advance,
    checkpoint,
    clear_intent,
    commit,
    fleet_step,
    incomplete,
    save_intent,
)
from pipeline.validate.publishable import prepare_for_fleet


class PublishError(CheckFailed):
    """The artifact or a volume directory fails its manifest or its origin."""


@dataclass
class Published:
    name: str
    version: int
    path: Path
    created: bool  # False: the version was already on the volume (no-op)
    previous_production: int | None = None  # the version this one replaced (now `previous`)
    instances: list[str] = field(default_factory=list)  # fleet instances that confirmed
    warnings: list[str] = field(default_factory=list)  # e.g. the canary measured another served checkpoint
    reports: list[InstanceReport] = field(default_factory=list, repr=False)
    gate_overridden: bool = False  # a version `pipeline run` gated, shipped with --force (recorded)
    skipped: str | None = None  # follow: why nothing was published (the alias moved on meanwhile)


def gate_override(mv, force: bool, follow: bool) -> str | None:
    """The warning for shipping a version `pipeline run` gated, or None when it was not gated.

    Raises CheckFailed: it was gated and neither `force` (promote/publish --force) nor `follow` (someone moved
    `production` to it in the registry) says to ship it anyway."""
    tags = mv.tags or {}
    if tags.get(registry.GATE_VERDICT_TAG) != "gated":
        return None
    reason = tags.get(registry.GATE_REASON_TAG) or "no reason recorded"
    what = f"{mv.name} v{mv.version} is a candidate `pipeline run` gated ({reason})"
    if force:
        return f"{what}: shipped with --force (recorded on the version as a gate_override event)"
    if follow:
        return f"{what}: shipped because `production` was moved to it in the registry"
    raise CheckFailed(
        f"{what}; nothing was published. Ship it anyway with --force (the override is recorded on the version), "
        "or retrain"
    )


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


# -- the volume ---------------------------------------------------------------------------------------
def _clear_all_debris(cfg: ProjectConfig, volume: Path) -> Path:
    """`clear_debris` on the volume's staging area and the local download area; returns the latter."""
    tmp_root = Path(cfg.state_dir) / "tmp"
    clear_debris(volume / STAGING, volume)
    clear_debris(tmp_root, volume)
    return tmp_root


def materialise(cfg: ProjectConfig, mv, volume: Path, origin: Origin | None = None) -> tuple[Path, bool]:
    """Write `<volume>/<name>-v<N>/` from the registry; returns (path, created). Call holding the adapter lock.

    The policy of what goes onto the volume; how it is written is `staged_version`, what is
    changed in the adapter on the way is `pipeline.artifacts.normalise`.

    Raises PublishError (the artifact or an existing directory fails its manifest, or the existing
    directory came from another registry entry: `origin`), CheckFailed (not validated for these
    weights), VolumeError (read-only, full, permissions: nothing partial is left).
    """
    name, version = mv.name, int(mv.version)
    volume = Path(volume)
    target = version_dir(volume, name, version)
    if target.exists():
        check_own_version_dir(target)  # another user's, or writable by others: never trusted
        check_fleet_access(volume, target, cfg.volume.fleet_user)
        problems = verify_version_dir(target, cache=False)
        if problems:
            raise PublishError(
                f"{target} differs from its manifest (volume tampered?); move it away and publish again:\n  "
                + "\n  ".join(problems)
            )
        why = origin_problem(read_adapter_manifest(target), origin, str(target)) if origin else None
        if why:
            raise PublishError(why)
        try:  # debris goes with every successful publish, also one that copies nothing
            _clear_all_debris(cfg, volume)
        except VolumeError:
            pass  # a volume that cannot be written to still serves what is on it (rollback, promote)
        return target, False

    check_writable(volume)
    tmp_root = _clear_all_debris(cfg, volume)
    check_writable(tmp_root)
    with tempfile.TemporaryDirectory(prefix=f"{name}-v{version}.", dir=tmp_root) as td:
        src = registry.download_version(cfg, mv, Path(td) / "download")
        manifest = read_adapter_manifest(src)
        problems = verify_files(src, manifest.files)
        if problems:
            raise PublishError(
                f"{name} v{version}: registered artifact fails its manifest:\n  " + "\n  ".join(problems)
            )
        check_publishable(mv, manifest.weights_sha256)
        need, nfiles = tree_size(src)
        with staged_version(volume, name, version, need, nfiles, checkpoint) as st:
            copy_adapter(src, st.path)  # allowed names and sizes, no links, nothing secret
            checkpoint("after-copy")
            # re-validate if the verdict's binding changed; rename keys / fold patterns for the fleet's vLLM (parity proven)
            fleet = prepare_for_fleet(cfg, mv.tags or {}, st.path)
            if "normalised" in fleet:
                manifest.normalised = {**(manifest.normalised or {}), **fleet["normalised"]}
            if "revalidated" in fleet:
                manifest.revalidated = {**(manifest.revalidated or {}), **fleet["revalidated"]}
            original = rewrite_base_model(st.path, cfg.served.model)
            manifest.registered_files = manifest.files
            manifest.files = file_hashes(st.path)
            manifest.published = PublishRecord(
                name=name,
                version=version,
                original_base_model_name_or_path=original,
                base_model_name_or_path=cfg.served.model,
                registry=origin
                or Origin(tracking_uri=redact_uri(cfg.tracking_uri), source=mv.source, run_id=mv.run_id),
                time=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            )
            write_manifest(st.path, manifest)  # the manifest last
        if st.created:
            try:  # sealed 0555/0444 whatever the umask; proven here, so no version the fleet cannot read stays
                check_fleet_access(volume, st.target, cfg.volume.fleet_user)
            except VolumeError:
                remove_version(volume, name, version, "unreadable")
                raise
        return st.target, st.created


# -- the transaction -------------------------------------------------------------------------------
def _replaces(
    cfg: ProjectConfig, name: str, target: int, prod: int | None, desired: int | None
) -> int | None:
    """The version `target` replaces (it becomes `previous`).

    Normally `production`. When `production` already points at `target` (moved in the MLflow UI,
    and this publish ships it), the version shipped last before it according to the registry's
    publish/rollback events (the alias is the source of truth, and every move the pipeline made
    left an event), else the desired state.
    """
    if prod is not None and prod != target:
        return prod
    if prod is None:
        return desired
    before = [v for v in registry.ship_history(registry.versions(cfg, name)) if v != target]
    return before[-1] if before else (desired if desired != target else None)


def publish(
    cfg: ProjectConfig,
    name: str,
    version: int | None = None,
    alias: str | None = None,
    *,
    follow: bool = False,
    force: bool = False,
) -> Published:
    """Publish `name` at `version` or `alias` to the volume and the fleet; `production` follows.

    `follow`: called by the alias follower for a version someone made `production`; when the
    alias points elsewhere once the adapter's lock is held (e.g. recovery just completed an
    operator's killed publish), nothing is published (`Published.skipped` says why); if the alias
    moves again during the publish it is left where it was moved.
    `force`: ship a version `pipeline run` gated (`gate.verdict` = gated); the override is recorded on the
    version (a `gate_override` event with the gate's reason). Without it a gated version is refused.

    Raises:
        UsageError: bad name, unknown model, version or alias (nothing written).
        CheckFailed: the version did not pass validation for its weights, or its recorded canary
            failed / is missing while `canary.required` (`pipeline.canary.gate`), or `pipeline run`
            gated it and `force` is not set.
        PublishError: the artifact or an existing version directory fails its manifest or origin.
        VolumeError: the volume is read-only, full or not writable (nothing partial is left).
        StoreError: the registry cannot be used.
        LockedError (exit 3): another transaction on `name` held the lock past `fleet.lock_timeout_s`.
        FleetError (exit 4): an instance did not switch; every instance was put back, desired state
            and aliases unchanged.
    """
    check_name(name, served=cfg.served_base_names)  # the grammar and the base's served names
    mv = registry.resolve_version(cfg, name, version, alias)
    target = int(mv.version)
    warnings = canary_gate(cfg, mv)  # before anything is written
    override = gate_override(mv, force, follow)
    if override:
        warnings.append(override)
    if cfg.fleet.instances:
        preflight(
            cfg.fleet, cfg.served
        )  # every instance runs the configured vLLM and model: else exit 4, nothing written
    volume = Path(cfg.volume.path)
    check_writable(volume)  # created 0755 whatever the umask
    check_fleet_access(volume, volume, cfg.volume.fleet_user, tree=False)  # before anything is written
    with adapter_transaction(cfg, name, prefer="complete", wanted=frozenset({target})) as tx:
        warnings += tx.notes
        done = tx.completed("publish", target)
        if done is not None:  # this very publish, killed earlier, was just completed
            path = version_dir(volume, name, target)
            return Published(name, target, path, done.created, done.from_version, done.instances, warnings)
        if follow:
            # The follower saw `production` at `target` before it had the lock. Recovery may just have
            # completed an operator's killed publish, or someone moved the alias meanwhile: the alias as
            # it is now is the operator's latest intent, never to be reverted with what was read before.
            now = registry.alias_version(cfg, name, registry.ALIAS_PRODUCTION)
            if now != target:
                why = (
                    f"`production` of {name} is v{now} now, not v{target}: nothing published "
                    "(the latest move of the alias stands; the follower ships it next)"
                )
                return Published(
                    name, target, version_dir(volume, name, target), False, warnings=warnings, skipped=why
                )
        origin = expected_origin(cfg, mv)
        aliases = registry.aliases(cfg, name)  # one registry call for both
        prod, prev = aliases.get(registry.ALIAS_PRODUCTION), aliases.get(registry.ALIAS_PREVIOUS)
        state = load_state(volume)
        intent = Intent(
            op="publish",
            name=name,
            version=target,
            from_version=_replaces(cfg, name, target, prod, state.version(name)),
            production_before=prod,
            previous_before=prev,
            state_before=state.adapters.get(name),
            source=mv.source,
            follow=follow,
        )
        save_intent(volume, intent)
        checkpoint("after-intent")
        try:
            path, created = materialise(cfg, mv, volume, origin)
        except Exception:
            clear_intent(volume, name)  # nothing but (removed) staging was written
            raise
        intent.created = created
        advance(cfg, intent, "volume")
        checkpoint("after-volume")
        try:
            with fleet_lock(volume, cfg.fleet.lock_timeout_s):
                try:
                    reports = fleet_step(cfg, intent)
                except FleetError:
                    clear_intent(volume, name)  # the rollout put every instance back; nothing else moved
                    raise
                warnings += commit(cfg, intent)
        except FleetError:
            raise
        except Exception as e:
            raise incomplete(cfg, e, intent) from e
    warnings += [f"{r.instance}: {w}" for r in reports for w in r.warnings]
    if override and force:
        reason = (mv.tags or {}).get(registry.GATE_REASON_TAG) or ""
        registry.record_event(cfg, name, target, {"type": "gate_override", "reason": reason, "forced": True})
    return Published(
        name, target, path, created, intent.from_version, intent.instances, warnings, reports, bool(override)
    )
