"""Publish's fleet step: every instance serves the new adapter version, or every instance is put back.

`rollout(cfg, name, version, path)`, all instances concurrently (one thread each):
1. `mode.prepare`: the loading mode's checks on the volume directory (resolver layout rules);
2. preflight (`pipeline.fleet.preflight`): every instance's `GET /version` and base model must
   match the config, and enough instances must answer (`fleet.min_healthy`, default all);
   otherwise exit 4 and nothing was changed;
3. switch (`LoadingMode.switch`): api mode loads `<NAME>-v<N>` from `<volume_mount>/<NAME>-v<N>`
   (and re-points `<NAME>` in place under the `repoint` swap strategy), verifies `/v1/models`,
   and runs the canary (greedy output differs from the base's); resolver mode probes the version name;
4. decide: the rollout stands when no instance refused the version and at least
   `fleet.min_healthy` (default: every instance) confirmed it; instances that only did not answer
   (unreachable, hung) are then marked in the desired-state record and `fleet sync` brings them
   along. Otherwise every instance the switch touched and that answers is put back, instances
   whose serving became unknown (a load sent, no answer: a hung instance may apply it when it
   resumes) are marked, and `FleetError` says what to run;
5. desired state `name -> version` (`pipeline.fleet.state`), then old version names beyond
   `fleet.keep_versions` (by desired history) are unloaded.
Every request is bounded (`fleet.connect_timeout_s`, `timeout_s`, `load_timeout_s`). The whole
operation holds the volume's fleet lock so that a `fleet sync --watch` sidecar never reverts an
instance mid-publish.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pipeline.config import ProjectConfig
from pipeline.fleet.client import InstanceClient, InstanceError
from pipeline.fleet.instances import InstanceReport, client_for, each_instance, failure
from pipeline.fleet.modes import LoadingMode, loading_mode
from pipeline.fleet.preflight import check_served, needed, preflight
from pipeline.fleet.state import FleetState, fleet_lock, load_state, save_state


def kept_versions(state: FleetState, name: str, keep: int) -> set[int]:
    """The desired version and the `keep - 1` versions desired before it (by desired history)."""
    entry = state.adapters.get(name) or {}
    hist = [int(v) for v in entry.get("history", [])]
    cur = state.version(name)
    kept = [v for v in hist if v != cur][-(keep - 1) :] if keep > 1 else []
    return set(kept) | ({cur} if cur is not None else set())


def _undo_all(cfg: ProjectConfig, mode: LoadingMode, reports: list[InstanceReport]) -> None:
    """Put back every instance the switch touched and that still answers (concurrently)."""
    by_name = {i.name: i for i in cfg.fleet.instances}
    todo = [r for r in reports if r.touched and r.answered]

    def undo(rep: InstanceReport) -> None:
        try:
            with client_for(cfg.fleet, by_name[rep.instance]) as client:
                n_errors = len(rep.errors)
                mode.undo(client, rep)
                rep.restored = len(rep.errors) == n_errors
        except InstanceError as e:
            rep.unknown = rep.unknown or e.outcome_unknown
            rep.error("fleet.restore_failed", f"restore failed: {e}")

    with ThreadPoolExecutor(max_workers=max(1, len(todo))) as pool:
        list(pool.map(undo, todo))


def switch_all(cfg: ProjectConfig, mode: LoadingMode, name: str, version: int) -> list[InstanceReport]:
    """Steps 2-4 of the module doc: preflight, switch, decide, undo. Call while holding the fleet lock.

    Returns the reports when the rollout stands (some may be behind under `fleet.min_healthy`).
    Raises FleetError (exit 4) after putting every answering instance back; instances whose
    serving is unknown are marked in the desired-state record.
    """
    checked = preflight(cfg.fleet, cfg.served)
    answering = [r.instance for r in checked if r.ok]

    def switch(client: InstanceClient, rep: InstanceReport) -> None:
        # The version may have changed since the preflight: what the instance runs is part of the switch.
        if check_served(cfg.fleet, cfg.served, client, rep):
            mode.switch(client, rep, name, version)

    reports = {r.instance: r for r in checked}
    reports.update({r.instance: r for r in each_instance(cfg.fleet, switch, only=answering)})
    reports = [reports[i.name] for i in cfg.fleet.instances]
    confirmed = [r for r in reports if r.ok]
    refused = [r for r in reports if not r.ok and r.answered]
    state = load_state(cfg.volume.path)
    if not refused and len(confirmed) >= needed(cfg.fleet):
        for r in reports:
            if not r.ok:
                r.warn(
                    "fleet.behind",
                    f"{name} v{version} published without this instance (fleet.min_healthy="
                    f"{cfg.fleet.min_healthy}); it serves an older version, or v{version} if a pending "
                    f"load lands when it resumes: run `pipeline fleet sync` once it answers",
                )
                state.mark_unknown(
                    r.instance, f"publish of {name} v{version} completed without it: {r.errors[0]}"
                )
        if any(not r.ok for r in reports):
            save_state(cfg.volume.path, state)
        return reports
    _undo_all(cfg, mode, reports)
    marked = [r for r in reports if r.unknown]
    for r in marked:
        state.mark_unknown(
            r.instance,
            f"publish of {name} v{version} was undone, but a change sent to this instance got no answer and "
            f"may still apply: {r.errors[0]}",
        )
    if marked:
        save_state(cfg.volume.path, state)
    raise failure(
        f"rollout of {name} v{version} undone (instances put back, desired state and aliases unchanged)",
        reports,
    )


def cleanup_all(
    cfg: ProjectConfig, mode: LoadingMode, name: str, reports: list[InstanceReport], keep: set[int]
) -> None:
    """Unload `name`'s version names not in `keep` on every instance that confirmed; best effort
    (failures become `fleet.cleanup_failed` warnings in `reports`)."""
    answering = [r.instance for r in reports if r.ok]
    cleanup = each_instance(cfg.fleet, lambda c, r: mode.cleanup(c, r, name, keep), only=answering)
    by_name = {r.instance: r for r in reports}
    for extra in cleanup:
        by_name[extra.instance].actions += extra.actions
        for f in extra.findings:
            by_name[extra.instance].warn("fleet.cleanup_failed", f.message)


def rollout(cfg: ProjectConfig, name: str, version: int, path: Path) -> list[InstanceReport]:
    """Make every instance serve `<volume>/<NAME>-v<N>` (`path`), then record it as desired.

    Returns one report per instance (under `fleet.min_healthy`, instances that did not answer are
    reported `ok=False` with a `fleet.behind` warning). Raises:
        FleetError (exit 4): an instance runs another vLLM version or model (nothing changed); too
            few instances answer (nothing changed); an instance refused the version (load error,
            wrong root, canary equal to base) or did not answer while all must confirm: every
            answering instance is put back, the desired state is unchanged, instances whose serving
            is unknown are marked; the message holds the per-instance report and what to run.
        LockedError (exit 3): another fleet operation holds the lock past `fleet.lock_timeout_s`.
        UsageError: no instances configured, an API key variable unset, an unsafe swap strategy.
    """
    mode = loading_mode(cfg)
    mode.prepare(name, version, path)
    with fleet_lock(cfg.volume.path, cfg.fleet.lock_timeout_s):
        reports = switch_all(cfg, mode, name, version)
        for r in reports:
            for w in mode.warnings:
                r.warn("fleet.swap", w)
        state = load_state(cfg.volume.path)
        state.set(name, version)
        save_state(cfg.volume.path, state)
        cleanup_all(cfg, mode, name, reports, kept_versions(state, name, cfg.fleet.keep_versions))
    return reports
