"""`pipeline fleet prune`: delete old version directories from the volume, never one that is served, as a transaction.

A prune deletes several directories and unloads names from several instances; a kill part-way
must leave no version directory without its weights that `fleet status` would call fine. So:

1. under NAME's transaction lock (after finishing what a killed publish, rollback or prune left)
   and the fleet lock: the versions to delete (beyond the newest `keep`, never the desired or the
   `production` one), then the intent record `.txn/<NAME>.json` (op `prune`, the versions);
2. the instances unload those version names (refused, nothing deleted, when one still serves one
   or does not answer, unless `force`);
3. each directory is renamed into `.staging/<NAME>/` (one atomic step: the version directory is
   whole or gone), then deleted there; the record is removed.

On a volume too full for the record, the oldest version to delete goes first, without one
(`_record_or_make_room`): prune is what every "the filesystem is full" message tells the operator to run.

A prune killed at any point is finished by the next transaction on NAME
(`pipeline.release.transaction.recover`): what it had not yet moved is moved and deleted, except
a version that became desired or `production` meanwhile (the operator's latest intent).
"""

from __future__ import annotations

import errno
from pathlib import Path

from pipeline.artifacts.names import check_name
from pipeline.artifacts.volume import remove_version, version_dirs, version_name
from pipeline.config import ProjectConfig
from pipeline.errors import FleetError, UsageError, VolumeError
from pipeline.fleet.client import InstanceClient
from pipeline.fleet.instances import InstanceReport, each_instance, failure, instance_path
from pipeline.fleet.state import fleet_lock, load_state
from pipeline.release.transaction import (
    Intent,
    adapter_transaction,
    checkpoint,
    clear_intent,
    protected_versions,
    record_pruned,
    save_intent,
)


def _unload(cfg: ProjectConfig, name: str, doomed: list[int], force: bool) -> None:
    """Unload the doomed version names from every instance; FleetError (nothing deleted) if one serves one."""
    if not cfg.fleet.instances:
        return
    doomed_paths = {instance_path(cfg.fleet, name, v) for v in doomed}
    serving: list[str] = []

    def unload(client: InstanceClient, rep: InstanceReport) -> None:
        loaded = client.adapters()
        if loaded.get(name) in doomed_paths:
            serving.append(client.name)
            raise FleetError(
                f"{client.name}: still serves {name} from {loaded[name]}: run `pipeline fleet sync` first"
            )
        for v in doomed:
            if version_name(name, v) in loaded:
                client.unload(version_name(name, v))
                rep.actions.append(f"unloaded {version_name(name, v)}")

    reports = each_instance(cfg.fleet, unload)
    if serving or (not force and not all(r.ok for r in reports)):
        raise failure(
            f"prune of {name} refused (nothing deleted; --force skips unreachable instances)", reports
        )


def _doomed(cfg: ProjectConfig, name: str, keep: int) -> list[int]:
    protected = protected_versions(cfg, name)
    versions = version_dirs(Path(cfg.volume.path), name).get(name, [])
    return [v for v in versions[keep:] if v not in protected]


def prune_plan(cfg: ProjectConfig, name: str, keep: int) -> list[int]:
    """The versions `prune(cfg, name, keep)` would delete now, newest first; reads only (a dry run, or
    what to ask the operator). Raises UsageError as `prune` does."""
    check_name(name)
    if keep < 1:
        raise UsageError("--keep must be at least 1")
    return _doomed(cfg, name, keep)


def prune(
    cfg: ProjectConfig, name: str, keep: int, force: bool = False, only: set[int] | None = None
) -> list[Path]:
    """Delete `<volume>/<NAME>-v<K>` directories beyond the newest `keep`, never the desired or production version.

    Runs as a transaction on `name` (module doc). Unloads the pruned version names from the
    instances first. Raises UsageError (`keep` < 1, bad name), FleetError (an instance still
    serves a version to prune or is unreachable, unless `force`: nothing deleted), LockedError,
    VolumeError. Returns the deleted directories. `only`: delete no version outside this set (what
    the operator was shown and confirmed, `prune_plan`), even if more became prunable meanwhile.
    """
    check_name(name)
    if keep < 1:
        raise UsageError("--keep must be at least 1")
    vol = Path(cfg.volume.path)
    with adapter_transaction(cfg, name), fleet_lock(vol, cfg.fleet.lock_timeout_s):
        doomed = [v for v in _doomed(cfg, name, keep) if only is None or v in only]
        if not doomed:
            return []
        state = load_state(vol)
        intent = Intent(
            op="prune",
            name=name,
            version=state.version(name) or 0,
            from_version=None,
            production_before=None,
            previous_before=None,
            state_before=state.adapters.get(name),
            source="",
            doomed=doomed,
        )
        removed = _record_or_make_room(cfg, name, intent, force)
        checkpoint("after-intent")
        try:
            _unload(cfg, name, doomed, force)
        except FleetError:
            clear_intent(vol, name)  # nothing (more) deleted
            raise
        removed += [d for v in doomed if (d := remove_version(vol, name, v, intent.id, checkpoint))]
        record_pruned(cfg, intent, doomed)
        clear_intent(vol, name)
        return removed


def _record_or_make_room(cfg: ProjectConfig, name: str, intent: Intent, force: bool) -> list[Path]:
    """Write the prune's record; on a full volume, delete its oldest version first to make room.

    Every error on a full volume says "prune old versions", and the record is the first thing a
    prune writes: with no byte free it failed too, so the advice went round in a circle. The oldest
    version is deleted the safe way without a record (unloaded, then renamed out and removed: whole
    or gone however the process ends; what a kill leaves in `.staging/` is debris for the next
    publish), then the record of the rest is written. Returns the directory deleted first, if any.
    """
    vol = Path(cfg.volume.path)
    try:
        save_intent(vol, intent)
        return []
    except VolumeError as e:
        if getattr(e.__cause__, "errno", None) not in (errno.ENOSPC, errno.EDQUOT):
            raise
    oldest = intent.doomed[-1]  # newest first, as version_dirs lists them
    _unload(cfg, name, [oldest], force)
    first = remove_version(vol, name, oldest, intent.id, checkpoint)
    save_intent(vol, intent)
    return [first] if first else []
