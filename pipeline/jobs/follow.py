"""Ship a version by moving an alias: poll the registry (and optionally take MLflow webhooks).

`follow_alias(cfg, "production", 30)` checks every registered model each `interval_s` seconds;
when the alias points at a version that is not on the volume yet, that version is published.
Moving `production` in the MLflow UI therefore ships it. Polling is the source of truth:
MLflow's webhooks are fire-and-forget (3 retries, no queue; docs/mlflow.md), so a
webhook only wakes the poll loop early and never carries state itself.

The webhook receiver (`--webhook-port`) is `pipeline.jobs.webhook`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from pipeline import registry
from pipeline.artifacts.volume import version_dir
from pipeline.config import ProjectConfig
from pipeline.errors import (
    CheckFailed,
    FleetError,
    LockedError,
    PipelineError,
    StoreError,
    UsageError,
    VolumeError,
)
from pipeline.fleet.state import load_state
from pipeline.release.publish import publish
from pipeline.release.transaction import recover_pending

log = logging.getLogger(__name__)

# Failures of the environment, not of the version: retried at the next poll (StoreError and
# VolumeError are UsageErrors, so they are caught before the permanent ones).
TRANSIENT = (StoreError, VolumeError, LockedError, FleetError)


def _ship_history(cfg: ProjectConfig, name: str) -> list[int]:
    """Versions of `name` in the order they were shipped (publish/rollback events), oldest first."""

    return registry.ship_history(registry.versions(cfg, name))


def _already_shipped(cfg: ProjectConfig, name: str, version: int) -> bool:
    """`version` is what the fleet was told to serve (desired state) and is on the volume.

    A volume written by an older pipeline may lack the desired-state entry: then the last version
    shipped according to the registry's events counts.
    """
    if not version_dir(cfg.volume.path, name, version).is_dir():
        return False
    desired = load_state(cfg.volume.path).version(name)
    if desired is not None:
        return desired == version
    history = _ship_history(cfg, name)
    return bool(history) and history[-1] == version


def follow_plan(cfg: ProjectConfig, alias: str, names: list[str] | None = None) -> list[dict]:
    """What one `follow_alias` pass would do now, changing nothing (`pipeline follow-alias --dry-run`).

    Per model: {"name", "alias_version" (None: the alias is not set), "action": "publish" (not on the volume or
    not desired yet), "none" (already shipped) or "unset"}. Killed transactions a real pass would first complete
    are not listed (their recovery writes); `fleet sync --dry-run` shows the fleet's side.
    Raises StoreError when the registry cannot be read."""
    rows = []
    for name in names or registry.model_names(cfg):
        v = registry.alias_version(cfg, name, alias)
        action = "unset" if v is None else ("none" if _already_shipped(cfg, name, v) else "publish")
        rows.append({"name": name, "alias_version": v, "action": action})
    return rows


def ship(cfg: ProjectConfig, name: str, version: int, alias: str):
    """Publish `name` v`version` because `alias` points at it; returns `publish.Published`.

    One publish transaction (`pipeline.release.publish.publish`: volume, fleet, desired state,
    aliases, event, all under the adapter's lock). Following `production`, the alias already
    points at `version`, so `previous` becomes the version the fleet served before (the desired
    state); if the alias moves again while this publish runs, it is left where it was moved and
    the next poll ships that version.
    """
    return publish(cfg, name, version=version, follow=alias == registry.ALIAS_PRODUCTION)


def follow_alias(
    cfg: ProjectConfig,
    alias: str,
    interval_s: float,
    once: bool = False,
    *,
    names: list[str] | None = None,
    on_publish: Callable | None = None,
    on_poll: Callable[[], None] | None = None,
    stop: threading.Event | None = None,
    wake: threading.Event | None = None,
) -> list:
    """Publish each model's `alias` version when it moves; poll every `interval_s` seconds.

    Args:
        alias: the alias to follow (normally `production`).
        interval_s: seconds between polls (a publish happens at most one interval after the move).
        once: poll once and return (for cron or a fleet sync step).
        names: registered models to follow (default: all, re-listed at every poll).
        on_publish: called with each `publish.Published`.
        on_poll: called after each poll (a heartbeat).
        stop: set it to end the loop (checked at least every 0.2 s).
        wake: set it to poll now (the webhook receiver does).

    A version the desired state already names counts as shipped (no re-publish); so the follower
    also repairs drift between `production` and `fleet-state.json`. A version that fails its
    checks (validation not passed, unknown) is reported once and skipped until the alias moves
    again; other errors (registry unreachable, volume full, fleet not converged) are reported and
    retried next poll, and with `once` raised after the pass (a one-shot job must fail).
    Every pass first completes or undoes the transactions killed commands left
    (`transaction.recover_pending`; a warning each, and with `once` an error for one it cannot finish).
    Returns the list of `Published` (useful with `once=True`). Messages go to this module's
    logger (`pipeline.jobs.follow`); a publish's own warnings (a recovered transaction) too.
    """

    if interval_s <= 0:
        raise UsageError(f"--interval must be > 0 seconds (got {interval_s})")
    stop = stop or threading.Event()
    wake = wake or threading.Event()
    seen: dict[str, int] = {}
    shipped: list = []
    while not stop.is_set():
        wake.clear()
        failed: list[BaseException] = []  # transient failures of this pass
        # a killed publish whose desired state already matches the alias would be skipped below as
        # shipped, its `previous`, event and record left wrong forever: finish every record first
        notes, stuck = recover_pending(cfg, names)
        for n in notes:
            log.warning("follow %s: %s", alias, n)
        for e in stuck:
            log.warning("follow %s: %s", alias, e)
        failed += stuck
        try:
            todo = names or registry.model_names(cfg)
        except Exception as e:  # registry unreachable: try again next poll
            log.warning("follow %s: cannot list models: %s", alias, e)
            failed.append(e)
            todo = []
        for name in todo:
            try:
                v = registry.alias_version(cfg, name, alias)
            except Exception as e:
                log.warning("follow %s: %s: cannot read alias: %s", alias, name, e)
                failed.append(e)
                continue
            if v is None or seen.get(name) == v:
                continue
            if _already_shipped(cfg, name, v):
                seen[name] = v
                continue
            try:
                pub = ship(cfg, name, v, alias)
            except TRANSIENT as e:
                log.warning("follow %s: %s v%s: publish failed, retrying next poll: %s", alias, name, v, e)
                failed.append(e)
                continue
            except (CheckFailed, UsageError) as e:
                log.warning("follow %s: %s v%s not published: %s", alias, name, v, e)
                seen[name] = v  # permanent for this version: wait for the alias to move again
                continue
            except (PipelineError, Exception) as e:  # noqa: B014 - transient: retry next poll
                log.warning("follow %s: %s v%s: publish failed, retrying next poll: %s", alias, name, v, e)
                failed.append(e)
                continue
            if pub.skipped:  # the alias moved on (or a killed publish was completed): read it again next poll
                for w in pub.warnings:
                    log.warning("follow %s: %s: %s", alias, name, w)
                log.info("follow %s: %s v%s: %s", alias, name, v, pub.skipped)
                continue
            seen[name] = v
            shipped.append(pub)
            for w in pub.warnings:
                log.warning("follow %s: %s v%s: %s", alias, name, v, w)
            log.info("follow %s: published %s v%s -> %s", alias, name, v, pub.path)
            if on_publish is not None:
                on_publish(pub)
        if on_poll is not None:
            on_poll()
        if once:
            if failed:  # one pass (cron, a CI step): a registry or fleet failure is the job's failure
                raise failed[0]
            break
        deadline = time.monotonic() + interval_s
        while not stop.is_set() and not wake.is_set() and time.monotonic() < deadline:
            wake.wait(min(0.2, max(0.0, deadline - time.monotonic())))
    return shipped
