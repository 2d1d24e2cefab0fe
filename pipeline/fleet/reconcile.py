"""Reconcile: bring every instance to the desired state (`sync`), and read what each serves (`status`)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from pipeline.artifacts.volume import VERSION_RE, verify_version, version_name
from pipeline.config import ProjectConfig
from pipeline.fleet.client import InstanceClient, InstanceError, Unreachable
from pipeline.fleet.instances import InstanceReport, each_instance, instance_path
from pipeline.fleet.rollout import point, probe_resolver, unload_old
from pipeline.fleet.state import FleetState, fleet_lock, load_state


# -- sync ----------------------------------------------------------------------------------------
def _reconcile(client: InstanceClient, cfg: ProjectConfig, state: FleetState, rep: InstanceReport) -> None:
    client.adapters()  # Unreachable first: that is the instance's state, whatever the volume holds
    for name, entry in sorted(state.adapters.items()):
        version = int(entry["version"])
        problems = verify_version(cfg.volume.path, name, version)  # before any instance is told to load it
        if problems:
            rep.errors.append(
                f"{name} v{version}: not loaded: {cfg.volume.path}/{version_name(name, version)} is missing "
                f"(pruned?) or fails its manifest (tampered?): {problems[0]}; publish it again or roll back"
            )
            continue
        try:
            if cfg.fleet.loading_mode == "resolver":
                probe_resolver(client, cfg, rep, name, version)
                continue
            point(client, cfg, rep, name, version, client.adapters())
            unload_old(client, cfg, rep, name, version)
        except Unreachable:
            raise
        except InstanceError as e:
            rep.errors.append(f"{name} v{version}: {e}")


def sync_locked(cfg: ProjectConfig) -> list[InstanceReport]:
    """`sync` for a caller already holding the fleet lock."""
    state = load_state(cfg.volume.path)
    return each_instance(cfg, lambda c, r: _reconcile(c, cfg, state, r))


def sync(cfg: ProjectConfig) -> list[InstanceReport]:
    """Bring every reachable instance to the desired state; idempotent (no request when in sync).


    Returns one report per instance (`ok` False: unreachable or an adapter failed to load or
    verify). Raises LockedError when another fleet operation holds the lock.
    """
    with fleet_lock(cfg.volume.path, cfg.fleet.lock_timeout_s):
        return sync_locked(cfg)


# -- status --------------------------------------------------------------------------------------
@dataclass
class StatusRow:
    """One instance x adapter: state is ok | missing | stale | unknown | unreachable | error."""

    instance: str
    adapter: str | None
    desired: int | None
    serving: str | None  # the version (as "vN") or the raw root path the instance serves
    state: str
    detail: str = ""


def _served_version(root: str | None) -> str | None:
    if root is None:
        return None
    m = VERSION_RE.match(os.path.basename(root.rstrip("/")))
    return f"v{m['version']}" if m else root


def status(cfg: ProjectConfig) -> list[StatusRow]:
    """What each instance serves against the desired state (read-only, no lock)."""
    state = load_state(cfg.volume.path)
    rows: list[StatusRow] = []

    def one(client: InstanceClient, rep: InstanceReport) -> None:
        try:
            loaded = client.adapters()
        except Unreachable as e:
            rows.append(StatusRow(client.name, None, None, None, "unreachable", str(e)))
            return
        known = set()
        for name, entry in sorted(state.adapters.items()):
            v = int(entry["version"])
            target = instance_path(cfg, name, v)
            served_name = version_name(name, v) if cfg.fleet.loading_mode == "resolver" else name
            known |= {name} | {n for n in loaded if (m := VERSION_RE.match(n)) and m["name"] == name}
            root = loaded.get(served_name)
            st = "missing" if root is None else ("ok" if root == target else "stale")
            detail = (
                "resolver loads it on first request (fleet sync warms it)"
                if (st == "missing" and cfg.fleet.loading_mode == "resolver")
                else ""
            )
            rows.append(StatusRow(client.name, name, v, _served_version(root), st, detail))
        for n in sorted(set(loaded) - known):
            rows.append(
                StatusRow(client.name, n, None, _served_version(loaded[n]), "unknown", "not in desired state")
            )

    reports = each_instance(cfg, one)
    for r in reports:
        if r.errors:
            rows.append(StatusRow(r.instance, None, None, None, "error", "; ".join(r.errors)))
    order = {i.name: k for k, i in enumerate(cfg.fleet.instances)}
    return sorted(rows, key=lambda r: (order.get(r.instance, 0), r.adapter or ""))
