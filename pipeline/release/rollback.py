"""`pipeline rollback`: make an earlier version production again, on the fleet and in the registry, as one transaction."""

from __future__ import annotations

from pipeline import registry
from pipeline.artifacts.manifest import read_adapter_manifest
from pipeline.artifacts.names import check_name
from pipeline.artifacts.volume import (
    check_fleet_access,
    check_own_version_dir,
    verify_version_dir,
    version_dir,
)
from pipeline.config import ProjectConfig
from pipeline.errors import LockedError, UsageError
from pipeline.fleet.instances import InstanceReport
from pipeline.fleet.state import FleetState, fleet_lock, load_state
from pipeline.release.origin import expected_origin, origin_problem
from pipeline.release.publish import PublishError
from pipeline.release.transaction import (
    Intent,
    adapter_transaction,
    checkpoint,
    commit,
    fleet_step,
    incomplete,
    save_intent,
)


class RolledBack(tuple):
    """(from_version, to_version, reports), plus `notes` for the user (what recovery did)."""

    notes: list[str]

    def __new__(cls, from_version: int, to_version: int, reports: list[InstanceReport], notes: list[str]):
        obj = super().__new__(cls, (from_version, to_version, reports))
        obj.notes = notes
        return obj


def rollback_target(state: FleetState, name: str, to: int | None, cur: int, prev: int | None) -> int:
    """The version a rollback from `cur` goes to: `to`, else the `previous` alias, else the version desired
    before the current one. UsageError when there is none."""
    target = to
    if target is None:
        target = prev if prev not in (None, cur) else state.previous(name)
    if target is None:
        raise UsageError(f"{name}: no earlier version to roll back to; pass --to N")
    return target


def check_rollback_dir(cfg: ProjectConfig, mv) -> None:
    """The version's directory is on the volume, matches its manifest and came from this registry entry.

    Raises UsageError (not on the volume: publish it instead), PublishError (tampered, or another origin)."""
    name, target = mv.name, int(mv.version)
    d = version_dir(cfg.volume.path, name, target)
    if not d.is_dir():
        raise UsageError(
            f"{d}: not on the volume (pruned?); publish it: pipeline publish {name} --version {target}"
        )
    check_own_version_dir(d)  # another user's, or writable by others: never trusted
    check_fleet_access(cfg.volume.path, d, cfg.volume.fleet_user)
    problems = verify_version_dir(d, cache=False)  # before any instance is told to load it
    if problems:
        raise PublishError(
            f"{d} differs from its manifest (tampered?); nothing changed. Move it away and publish "
            f"v{target} again:\n  " + "\n  ".join(problems)
        )
    why = origin_problem(read_adapter_manifest(d), expected_origin(cfg, mv), str(d))
    if why:
        raise PublishError(why)


def rollback(cfg: ProjectConfig, name: str, to: int | None = None) -> RolledBack:
    """Make `to` (default: the `previous` alias) production and desired, then sync the fleet.

    One transaction (`pipeline.release.transaction`): desired state -> `fleet sync` -> `production`
    = `to`, `previous` = the version rolled back from -> events `rollback` / `rolled_back`. The
    rollback stands even when an instance is down (`fleet sync` converges it later; the reports
    say which confirmed). Without `--to`, a rollback that waited for the lock while another one
    (or a publish) moved `production` is refused (LockedError, exit 3), so two operators rolling
    back at once go back one version, not two, and never forth again.

    Returns (from_version, to_version, reports) with `.notes`. Raises UsageError: bad name, unknown model or
    version, nothing in production, no earlier version, or the version's directory was pruned (publish it again instead). PublishError: the directory
    fails its manifest (tampered) or came from another registry entry.
    """
    check_name(name, served=cfg.served_base_names)
    vol = cfg.volume.path
    registry.versions(cfg, name)  # UsageError naming the registered models if `name` is unknown
    seen = registry.alias_version(cfg, name, registry.ALIAS_PRODUCTION)
    # what this rollback may go to: finishing a killed prune must not delete it first
    wanted = {to} if to is not None else {registry.alias_version(cfg, name, registry.ALIAS_PREVIOUS)}
    wanted |= {load_state(vol).previous(name)} if to is None else set()
    with adapter_transaction(cfg, name, prefer="undo", wanted=frozenset(v for v in wanted if v)) as tx:
        r = tx.recovered
        if r and r.outcome == "completed" and r.intent.op == "rollback":
            # A rollback killed earlier was just completed: if it is the one asked for again, it is done.
            if to == r.intent.version or (to is None and seen in (r.intent.from_version, r.intent.version)):
                return RolledBack(r.intent.from_version, r.intent.version, [], tx.notes)
        state = load_state(vol)
        prod = registry.alias_version(cfg, name, registry.ALIAS_PRODUCTION)
        prev = registry.alias_version(cfg, name, registry.ALIAS_PREVIOUS)
        cur = prod if prod is not None else state.version(name)
        if cur is None:
            raise UsageError(f"{name}: nothing is in production (no `production` alias, no desired state)")
        if to is None and prod != seen:
            raise LockedError(
                f"{name}: `production` moved from v{seen} to v{prod} while this rollback waited for the lock "
                f"(another rollback or publish); nothing changed. Run it again to roll back from v{prod}, "
                f"or give --to N"
            )
        target = rollback_target(state, name, to, cur, prev)
        mv = registry.resolve_version(cfg, name, version=target)  # UsageError listing the versions
        if prod == target and state.version(name) == target:
            return RolledBack(
                cur, target, [], [*tx.notes, f"{name} v{target} is already production and desired"]
            )
        check_rollback_dir(cfg, mv)
        intent = Intent(
            op="rollback",
            name=name,
            version=target,
            from_version=cur,
            production_before=prod,
            previous_before=prev,
            state_before=state.adapters.get(name),
            source=mv.source,
        )
        save_intent(vol, intent)
        checkpoint("after-intent")
        try:
            with fleet_lock(vol, cfg.fleet.lock_timeout_s):
                reports = fleet_step(cfg, intent)
                commit(cfg, intent)
        except Exception as e:
            raise incomplete(cfg, e, intent) from e
        return RolledBack(cur, target, reports, tx.notes)
