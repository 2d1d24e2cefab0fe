"""`pipeline rollback`: make an earlier version desired again, on the fleet and in the registry."""

from __future__ import annotations

from pipeline import registry
from pipeline.artifacts.manifest import read_manifest, verify_files
from pipeline.artifacts.volume import version_dir
from pipeline.config import ProjectConfig
from pipeline.errors import UsageError
from pipeline.fleet.instances import InstanceReport
from pipeline.fleet.reconcile import sync_locked
from pipeline.fleet.state import fleet_lock, load_state, save_state


# -- rollback and prune -----------------------------------------------------------------------------
def rollback(cfg: ProjectConfig, name: str, to: int | None = None) -> tuple[int, int, list[InstanceReport]]:
    """Make `to` (default: the previously desired version) the desired version of `name` and sync.


    Moves MLflow alias `production` to it (`previous` to the version it replaces).
    Returns (from_version, to_version, reports). Raises UsageError: no desired state for `name`,
    no previous version, or the version directory was pruned (publish it again instead).
    """

    with fleet_lock(cfg.volume.path, cfg.fleet.lock_timeout_s):
        state = load_state(cfg.volume.path)
        # Without a fleet (or before its first rollout) the registry's aliases are the record.
        if state.version(name) is None:
            registry.versions(cfg, name)  # UsageError naming the registered models if `name` is unknown
        cur = state.version(name) or registry.alias_version(cfg, name, registry.ALIAS_PRODUCTION)
        if cur is None:
            raise UsageError(f"{name}: nothing is in production (no desired state, no `production` alias)")
        target = to if to is not None else (state.previous(name) if state.version(name) is not None else None)
        target = target or registry.alias_version(cfg, name, registry.ALIAS_PREVIOUS)
        if target is None:
            raise UsageError(f"{name}: no earlier version to roll back to; pass --to N")
        registry.resolve_version(cfg, name, version=target)  # UsageError listing the versions that exist
        d = version_dir(cfg.volume.path, name, target)
        if not d.is_dir():
            raise UsageError(
                f"{d}: not on the volume (pruned?); publish it: pipeline publish {name} --version {target}"
            )
        problems = verify_files(d, read_manifest(d)["files"])
        if problems:
            raise UsageError(f"{d} differs from its manifest:\n  " + "\n  ".join(problems))
        state.set(name, target)
        save_state(cfg.volume.path, state)
        reports = sync_locked(cfg) if cfg.fleet.instances else []
        # The alias follows the desired state even if an instance is down (sync converges it later);
        # the rollback event records which instances confirmed.
        confirmed = [r.instance for r in reports if r.ok]
        if registry.alias_version(cfg, name, registry.ALIAS_PRODUCTION) not in (None, target):
            registry.rollback_aliases(cfg, name, target, instances=confirmed)
        else:
            registry.set_alias(cfg, name, registry.ALIAS_PRODUCTION, target)
        return cur, target, reports
