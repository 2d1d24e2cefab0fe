"""`pipeline fleet prune`: delete old version directories from the volume, never one that is served."""

from __future__ import annotations

from pathlib import Path

from pipeline.artifacts.atomic import rmtree
from pipeline.artifacts.volume import VERSION_RE, version_name
from pipeline.config import ProjectConfig
from pipeline.errors import FleetError, UsageError
from pipeline.fleet.client import InstanceClient
from pipeline.fleet.instances import InstanceReport, each_instance, failure, instance_path
from pipeline.fleet.state import fleet_lock, load_state


def prune(cfg: ProjectConfig, name: str, keep: int, force: bool = False) -> list[Path]:
    """Delete `<volume>/<NAME>-v<K>` directories beyond the newest `keep`, never the desired version.


    Unloads the pruned version names from the instances first. Refuses (FleetError) when an
    instance still serves a version to prune or is unreachable (unless `force`).
    Returns the deleted directories.
    """
    if keep < 1:
        raise UsageError("--keep must be at least 1")
    vol = Path(cfg.volume.path)
    with fleet_lock(vol, cfg.fleet.lock_timeout_s):
        desired = load_state(vol).version(name)
        versions = sorted(
            (
                int(m["version"])
                for p in vol.iterdir()
                if p.is_dir() and (m := VERSION_RE.match(p.name)) and m["name"] == name
            ),
            reverse=True,
        )
        doomed = [v for v in versions[keep:] if v != desired]
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
            rmtree(d)
            removed.append(d)
        return removed
