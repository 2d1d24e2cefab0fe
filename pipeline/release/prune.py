"""`pipeline fleet prune`: delete old version directories from the volume, never one that is served."""

from __future__ import annotations

from pathlib import Path

from pipeline import registry
from pipeline.artifacts.atomic import rmtree
from pipeline.artifacts.names import check_name
from pipeline.artifacts.volume import os_failure, parse_version_name, version_name
from pipeline.config import ProjectConfig
from pipeline.errors import FleetError, UsageError
from pipeline.fleet.client import InstanceClient
from pipeline.fleet.instances import InstanceReport, each_instance, failure, instance_path
from pipeline.fleet.state import fleet_lock, load_state
from pipeline.release.transaction import adapter_transaction


def prune(cfg: ProjectConfig, name: str, keep: int, force: bool = False) -> list[Path]:
    """Delete `<volume>/<NAME>-v<K>` directories beyond the newest `keep`, never the desired or production version.


    Runs as a transaction on `name` (its lock, after finishing what a killed publish or rollback
    left), then under the fleet lock. Unloads the pruned version names from the instances first.
    Refuses (FleetError) when an instance still serves a version to prune or is unreachable
    (unless `force`). Returns the deleted directories.
    """
    check_name(name)
    if keep < 1:
        raise UsageError("--keep must be at least 1")
    vol = Path(cfg.volume.path)
    with adapter_transaction(cfg, name), fleet_lock(vol, cfg.fleet.lock_timeout_s):
        protected = {load_state(vol).version(name)}
        if registry.model_exists(cfg, name):
            protected.add(registry.alias_version(cfg, name, registry.ALIAS_PRODUCTION))
        versions = sorted(
            (
                parsed[1]
                for p in vol.iterdir()
                if p.is_dir() and (parsed := parse_version_name(p.name)) and parsed[0] == name
            ),
            reverse=True,
        )
        doomed = [v for v in versions[keep:] if v not in protected]
        if not doomed:
            return []
        doomed_paths = {instance_path(cfg, name, v) for v in doomed}

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

        reports = each_instance(cfg, unload) if cfg.fleet.instances else []
        if serving or (not force and not all(r.ok for r in reports)):
            raise failure(
                f"prune of {name} refused (nothing deleted; --force skips unreachable instances)", reports
            )
        removed = []
        for v in doomed:
            d = vol / version_name(name, v)
            try:
                rmtree(d)
                if d.exists():
                    raise PermissionError(13, "some files could not be removed")
            except OSError as e:
                raise os_failure(e, "cannot delete", d) from e
            removed.append(d)
        return removed
