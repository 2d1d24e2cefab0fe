"""Reconcile: bring every instance to the desired state (`sync`), and read what each serves (`status`).

`sync` asks each instance what it runs (`GET /version`, base model: an instance that differs from
the config is reported and left alone), then per desired adapter runs the loading mode's
`switch` (no request that changes anything when the instance already serves it) and unloads
version names no longer kept. It clears an instance's "unknown" mark in the desired-state
record once the instance answered and serves every desired version, and marks instances whose
serving became unknown (a change sent, no answer).

`status` is read-only and takes no lock. Row states:
ok | missing | stale | extra (loaded, not desired) | unknown (marked in the desired-state record:
run `fleet sync`) | hung (accepts connections, no answer) | unreachable | mismatch (vLLM version
or model differs from the config) | error.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

from pipeline.artifacts.volume import VERSION_RE, verify_version, version_name
from pipeline.config import ProjectConfig
from pipeline.fleet.client import Hung, InstanceClient, InstanceError, Unreachable
from pipeline.fleet.instances import InstanceReport, each_instance, instance_path
from pipeline.fleet.modes import LoadingMode, loaded_versions, loading_mode
from pipeline.fleet.preflight import check_served
from pipeline.fleet.rollout import kept_versions
from pipeline.fleet.state import FleetState, fleet_lock, load_state, save_state


# -- sync ----------------------------------------------------------------------------------------
def _reconcile(
    client: InstanceClient, cfg: ProjectConfig, mode: LoadingMode, state: FleetState, rep: InstanceReport
) -> None:
    if not check_served(
        cfg.fleet, cfg.served, client, rep
    ):  # Unreachable/Hung first: that is the instance's state
        return
    for name, entry in sorted(state.adapters.items()):
        version = int(entry["version"])
        problems = verify_version(cfg.volume.path, name, version)  # before any instance is told to load it
        if problems:
            rep.error(
                "fleet.volume_missing",
                f"{name} v{version}: not loaded: {cfg.volume.path}/{version_name(name, version)} is missing "
                f"(pruned?) or fails its manifest (tampered?): {problems[0]}; publish it again or roll back",
            )
            continue
        try:
            mode.switch(client, rep, name, version)
            mode.cleanup(client, rep, name, kept_versions(state, name, cfg.fleet.keep_versions))
        except Unreachable:
            raise
        except InstanceError as e:
            rep.unknown = rep.unknown or e.outcome_unknown
            rep.error(e.check or "fleet.request_failed", f"{name} v{version}: {e}")


def sync_locked(cfg: ProjectConfig) -> list[InstanceReport]:
    """`sync` for a caller already holding the fleet lock; updates the instances' marks."""
    state = load_state(cfg.volume.path)
    mode = loading_mode(cfg)
    reports = each_instance(cfg.fleet, lambda c, r: _reconcile(c, cfg, mode, state, r))
    changed = False
    for r in reports:
        if r.ok and state.clear_mark(r.instance):
            r.actions.append("cleared the 'unknown' mark in the desired-state record (verified)")
            changed = True
        elif r.unknown:
            state.mark_unknown(
                r.instance, f"fleet sync: a change got no answer and may still apply: {r.errors[0]}"
            )
            changed = True
    if changed:
        save_state(cfg.volume.path, state)
    return reports


def sync(cfg: ProjectConfig) -> list[InstanceReport]:
    """Bring every instance that answers to the desired state; idempotent (no load when in sync).

    Returns one report per instance (`ok` False: unreachable, hung, another vLLM/model, or an
    adapter failed to load or verify). Raises LockedError when another fleet operation holds the lock.
    """
    with fleet_lock(cfg.volume.path, cfg.fleet.lock_timeout_s):
        return sync_locked(cfg)


# -- status --------------------------------------------------------------------------------------
# What a status row can say: an instance x adapter, an instance, or (instance `-`) the volume and
# registry (`pipeline.release.desired.volume_rows`).
RowState = Literal[
    "ok",
    "missing",
    "stale",
    "extra",
    "unknown",
    "hung",
    "unreachable",
    "mismatch",
    "error",
    "drift",
    "corrupt",
    "absent",
]


@dataclass
class StatusRow:
    """One instance x adapter (or one row for the instance: adapter None). States: module doc."""

    instance: str
    adapter: str | None
    desired: int | None
    serving: str | None  # the version (as "vN") or the raw root path the instance serves
    state: RowState
    detail: str = ""
    vllm: str | None = None  # what `GET /version` reported


def _served_version(root: str | None) -> str | None:
    if root is None:
        return None
    m = VERSION_RE.match(os.path.basename(root.rstrip("/")))
    return f"v{m['version']}" if m else root


def _mark_detail(state: FleetState, instance: str) -> str:
    mark = state.instances.get(instance)
    return f"marked unknown since {mark.get('since')}: {mark.get('reason')}" if mark else ""


def status(cfg: ProjectConfig) -> list[StatusRow]:
    """What each instance serves against the desired state (read-only, no lock)."""
    state = load_state(cfg.volume.path)
    mode = loading_mode(cfg)
    rows: list[StatusRow] = []

    def one(client: InstanceClient, rep: InstanceReport) -> None:
        mark = _mark_detail(state, client.name)
        try:
            matches = check_served(cfg.fleet, cfg.served, client, rep)
            loaded = client.adapters()
        except Hung as e:
            rows.append(
                StatusRow(client.name, None, None, None, "hung", "; ".join(filter(None, [str(e), mark])))
            )
            return
        except Unreachable as e:
            rows.append(
                StatusRow(
                    client.name, None, None, None, "unreachable", "; ".join(filter(None, [str(e), mark]))
                )
            )
            return
        v = rep.vllm_version
        if not matches:
            rows.append(StatusRow(client.name, None, None, None, "mismatch", "; ".join(rep.errors), v))
        if mark:
            rows.append(
                StatusRow(client.name, None, None, None, "unknown", f"{mark}; run `pipeline fleet sync`", v)
            )
        known = set()
        for name, entry in sorted(state.adapters.items()):
            want = int(entry["version"])
            target = instance_path(cfg.fleet, name, want)
            served_name = mode.served_name(name, want)
            known |= {served_name} | set(loaded_versions(loaded, name).values())
            root = loaded.get(served_name)
            st = "missing" if root is None else ("ok" if root == target else "stale")
            detail = f"clients request {served_name!r}"
            if st == "missing" and mode.name == "resolver":
                detail += "; the resolver loads it on first request (fleet sync warms it)"
            rows.append(StatusRow(client.name, name, want, _served_version(root), st, detail, v))
        for n in sorted(set(loaded) - known):
            rows.append(
                StatusRow(client.name, n, None, _served_version(loaded[n]), "extra", "loaded, not desired", v)
            )

    reports = each_instance(cfg.fleet, one)
    for r in reports:
        if r.errors and not any(row.instance == r.instance for row in rows):
            rows.append(StatusRow(r.instance, None, None, None, "error", "; ".join(r.errors), r.vllm_version))
    order = {i.name: k for k, i in enumerate(cfg.fleet.instances)}
    return sorted(rows, key=lambda r: (order.get(r.instance, 0), r.adapter or ""))


CONVERGED = ("ok", "extra")
