"""Events on a model version (publish, rollout, rollback...), stored as version tags."""

from __future__ import annotations

import json

from pipeline.artifacts.bounded import loads_json
from pipeline.config import ProjectConfig
from pipeline.errors import UsageError
from pipeline.registry.presentation import refresh as refresh_ui
from pipeline.registry.store import mlflow_for
from pipeline.registry.versions import (
    ALIAS_PREVIOUS,
    ALIAS_PRODUCTION,
    alias_version,
    model_exists,
    resolve_version,
    set_alias,
    set_version_tags,
)

# -- events: publish, rollout, rollback ------------------------------------------------------------
EVENT_TAG_PREFIX = "event."
MAX_TAG_BYTES = 64 * 1024  # MLflow keeps tag values to 8,000 characters


# Summary-tag prefix per event type; other types use their own name (`rollout.instances`, ...).
_SUMMARY_PREFIX = {"publish": "published"}


_SUMMARY_FIELDS = ("time", "path", "instances", "from_version", "to_version")


def record_event(cfg: ProjectConfig, name: str, version: int, event: dict, txn: str | None = None) -> dict:
    """Record what happened to version `version` of `name` (publish, rollout, rollback...).


    `event`: a JSON-able dict with `type` (lower-case word: `publish`, `rollout`, `rollback`,
    `rolled_back`, ...) and any facts, by convention `instances` (names of the fleet instances
    that confirmed, list of str), `path` (the published directory), `from_version` /
    `to_version` (ints). `time` (UTC ISO-8601) is added when absent.


    Stored as model-version tags, so the version page shows them and `search_model_versions`
    can filter on them:
      - `event.<UTC yyyymmddThhmmss.ffffff>Z.<type>`: the whole event as JSON, one tag per event
        (unique key: concurrent callers never overwrite each other; keys sort by time);
      - `<type>.<field>` for time/path/instances/from_version/to_version (latest of that type;
        type `publish` uses `published.`, matching `pipeline.release.publish`). Lists are joined with ",".


    `txn`: the id of the transaction recording it (`pipeline.release.transaction`); stored as the
    event's `txn`, and an event of the same type and `txn` already on the version is not recorded
    again (a transaction completed after a crash records each event once).

    Returns the stored event. Raises UsageError: no `type`, or the version does not exist.
    """
    import datetime as dt
    import re

    from mlflow.exceptions import MlflowException

    etype = str(event.get("type") or "")
    if not re.fullmatch(r"[a-z][a-z0-9_]{0,40}", etype):
        raise UsageError(f"record_event: event needs a 'type' like 'publish' or 'rollout' (got {etype!r})")
    now = dt.datetime.now(dt.UTC)
    stored = {"time": now.isoformat(timespec="seconds"), **event}
    if txn:
        stored["txn"] = txn
    client = mlflow_for(cfg).MlflowClient()
    try:
        mv = client.get_model_version(name, str(version))
    except MlflowException as e:
        raise UsageError(f"record_event: {name} version {version} not found in {cfg.tracking_uri}") from e
    prefix = _SUMMARY_PREFIX.get(etype, etype)
    if txn:
        recorded = events(mv)  # oldest first
        for i, e in enumerate(recorded):
            if e.get("txn") == txn and e.get("type") == etype:
                # recorded by a run killed before (or, by an older pipeline, after) the summary tags:
                # write them, unless a later event of this type owns them now
                if not any(x.get("type") == etype for x in recorded[i + 1 :]):
                    _set_summary(cfg, name, version, prefix, e, mv.tags or {})
                return e
    stamp = now.strftime("%Y%m%dT%H%M%S.%f")
    # the summary tags first, the event last: the event tag is what says "recorded" (a re-run with
    # the same `txn` finds it), so a process killed between the writes leaves no event without them
    _set_summary(cfg, name, version, prefix, stored, {})
    set_version_tags(
        cfg,
        name,
        version,
        {f"{EVENT_TAG_PREFIX}{stamp}Z.{etype}": json.dumps(stored, sort_keys=True, default=str)},
    )
    return stored


def _set_summary(cfg: ProjectConfig, name: str, version: int, prefix: str, event: dict, have: dict) -> None:
    """The `<prefix>.<field>` tags of `event` (only those that differ from `have`)."""
    tags = {}
    for f in _SUMMARY_FIELDS:
        if f in event:
            v = event[f]
            tags[f"{prefix}.{f}"] = ",".join(map(str, v)) if isinstance(v, (list, tuple)) else str(v)
    todo = {k: v for k, v in tags.items() if have.get(k) != v}
    if todo:
        set_version_tags(cfg, name, version, todo)


def events(mv) -> list[dict]:
    """The events recorded on a ModelVersion, oldest first."""
    out = []
    for k in sorted(mv.tags or {}):
        if k.startswith(EVENT_TAG_PREFIX):
            try:
                e = loads_json(mv.tags[k], f"version tag {k}", MAX_TAG_BYTES)
                out.append(e if isinstance(e, dict) else {"type": k.rsplit(".", 1)[-1], "raw": mv.tags[k]})
            except ValueError:  # not JSON, or over the bounds: shown raw
                out.append({"type": k.rsplit(".", 1)[-1], "raw": mv.tags[k]})
    return out


def rollback_aliases(
    cfg: ProjectConfig, name: str, to_version: int | None = None, **facts
) -> tuple[int, int]:
    """Move `production` back to `to_version` (default: the `previous` alias); record the events.


    Only the registry: the volume's desired state and the fleet do not move, so `pipeline fleet
    status` reports drift until they do. The `pipeline rollback` command is
    `pipeline.release.rollback.rollback`, one transaction over all of them. `previous` then points at the
    version rolled back from, so `previous` is always "what production replaced". Events:
    `rollback` on the target (`from_version`, plus `facts`, e.g. `instances=[...]` that
    confirmed) and `rolled_back` on the version it replaced (`to_version`).


    Returns (from_version, to_version). Raises UsageError: unknown model, no production
    version, no target, or the target is already production.
    """
    if not model_exists(cfg, name):
        raise UsageError(f"registered model {name!r} not found in {cfg.tracking_uri}")
    current = alias_version(cfg, name, ALIAS_PRODUCTION)
    if current is None:
        raise UsageError(f"{name}: no version has alias {ALIAS_PRODUCTION!r}; nothing to roll back")
    target = to_version if to_version is not None else alias_version(cfg, name, ALIAS_PREVIOUS)
    if target is None:
        raise UsageError(f"{name}: no {ALIAS_PREVIOUS!r} alias; give the version to roll back to")
    target = int(target)
    if target == current:
        raise UsageError(f"{name}: version {target} is already {ALIAS_PRODUCTION!r}")
    resolve_version(cfg, name, version=target)  # UsageError naming the versions that exist
    set_alias(cfg, name, ALIAS_PRODUCTION, target)
    set_alias(cfg, name, ALIAS_PREVIOUS, current)
    record_event(cfg, name, target, {**facts, "type": "rollback", "from_version": current})
    record_event(cfg, name, current, {"type": "rolled_back", "to_version": target})
    refresh_ui(cfg, name, [target, current])
    return current, target
