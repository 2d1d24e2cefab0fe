"""Events on a model version (publish, rollout, rollback...): one `events` tag, and the latest of each type in summary tags.

The history of a version is one tag, `events` (a JSON list, oldest first), not a tag per event:
MLflow's version page lists every tag, sorted by name, in one small box, and a tag per event
pushed `published.path` below a growing pile of event JSON (issue 27 item 10). Versions written
by an older pipeline keep their `event.<stamp>.<type>` tags; `events()` reads both.
"""

from __future__ import annotations

import datetime as dt
import json
import re
import uuid

from pipeline.artifacts.bounded import loads_json
from pipeline.config import ProjectConfig
from pipeline.errors import StoreError, UsageError
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
EVENTS_TAG = "events"
EVENT_TAG_PREFIX = "event."  # older pipelines: one tag per event, `event.<stamp>Z.<type>`
# The list keeps the newest events within this many characters (MLflow allows 100,000 in a
# registry tag); the summary tags keep the latest of each type whatever is dropped.
MAX_EVENTS_CHARS = 20_000
MAX_TAG_BYTES = 64 * 1024  # what is parsed of one tag (bounded: pipeline.artifacts.bounded)
SHIP_EVENTS = ("publish", "rollback")


# Summary-tag prefix per event type; other types use their own name (`rollout.instances`, ...).
_SUMMARY_PREFIX = {"publish": "published"}


_SUMMARY_FIELDS = ("time", "stamp", "path", "instances", "from_version", "to_version")


def record_event(cfg: ProjectConfig, name: str, version: int, event: dict, txn: str | None = None) -> dict:
    """Record what happened to version `version` of `name` (publish, rollout, rollback...).


    `event`: a JSON-able dict with `type` (lower-case word: `publish`, `rollout`, `rollback`,
    `rolled_back`, ...) and any facts, by convention `instances` (names of the fleet instances
    that confirmed, list of str), `path` (the published directory), `from_version` /
    `to_version` (ints). `time` (UTC ISO-8601) is added when absent, `stamp` (the same instant to
    the microsecond, `yyyymmddThhmmss.ffffffZ`: the order of events across versions) and `id`
    always.

    Stored as model-version tags, so the version page shows them and `search_model_versions`
    can filter on them:
      - `<type>.<field>` for time/stamp/path/instances/from_version/to_version (latest of that type;
        type `publish` uses `published.`, matching `pipeline.release.publish`). Lists are joined
        with ","; written first;
      - `events`: the version's history, a JSON list oldest first (the newest within
        `MAX_EVENTS_CHARS`), with the event appended last: the event in the list is what says
        "recorded". The append is checked after the write and merged again if a concurrent writer
        replaced the list meanwhile.


    `txn`: the id of the transaction recording it (`pipeline.release.transaction`); stored as the
    event's `txn`, and an event of the same type and `txn` already on the version is not recorded
    again (a transaction completed after a crash records each event once); its summary tags are
    written again if a run killed between the two writes left them out.

    Returns the stored event. Raises UsageError: no `type`, or the version does not exist;
    StoreError: the event could not be kept against concurrent writers.
    """
    from mlflow.exceptions import MlflowException

    etype = str(event.get("type") or "")
    if not re.fullmatch(r"[a-z][a-z0-9_]{0,40}", etype):
        raise UsageError(f"record_event: event needs a 'type' like 'publish' or 'rollout' (got {etype!r})")
    now = dt.datetime.now(dt.UTC)
    stored = {"time": now.isoformat(timespec="seconds"), **event}
    stored |= {"stamp": now.strftime("%Y%m%dT%H%M%S.%fZ"), "id": uuid.uuid4().hex[:12]}
    if txn:
        stored["txn"] = txn
    client = mlflow_for(cfg).MlflowClient()
    try:
        mv = client.get_model_version(name, str(version))
    except MlflowException as e:
        raise UsageError(f"record_event: {name} version {version} not found in {cfg.tracking_uri}") from e
    prefix = _SUMMARY_PREFIX.get(etype, etype)
    if txn:
        recorded = events(mv)
        for i, e in enumerate(recorded):
            if e.get("txn") == txn and e.get("type") == etype:
                if not any(x.get("type") == etype for x in recorded[i + 1 :]):  # still the latest
                    _set_summary(cfg, name, version, prefix, e, mv.tags or {})
                return e
    _set_summary(cfg, name, version, prefix, stored, mv.tags or {})
    _append(client, name, version, stored)
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


def _listed(tags: dict) -> list[dict]:
    """The `events` tag as a list (empty when absent or unreadable)."""
    try:
        out = loads_json((tags or {}).get(EVENTS_TAG) or "[]", f"version tag {EVENTS_TAG}", MAX_TAG_BYTES)
    except ValueError:  # not JSON, or over the bounds
        return []
    return [e for e in out if isinstance(e, dict)] if isinstance(out, list) else []


def _bounded(items: list[dict]) -> str:
    """`items` as JSON, dropping the oldest until it fits `MAX_EVENTS_CHARS` (the newest always stays)."""
    while True:
        text = json.dumps(items, sort_keys=True, default=str)
        if len(text) <= MAX_EVENTS_CHARS or len(items) <= 1:
            return text
        items = items[1:]


def _append(client, name: str, version: int, event: dict, attempts: int = 5) -> None:
    """Append `event` to the version's `events` tag; re-read to be sure it stayed (read-modify-write)."""
    for _ in range(attempts):
        have = _listed(client.get_model_version(name, str(version)).tags)
        if any(e.get("id") == event["id"] for e in have):
            return
        client.set_model_version_tag(name, str(version), EVENTS_TAG, _bounded([*have, event]))
        if any(
            e.get("id") == event["id"] for e in _listed(client.get_model_version(name, str(version)).tags)
        ):
            return
    raise StoreError(
        f"{name} v{version}: the {event['type']} event could not be kept in tag {EVENTS_TAG!r}: "
        f"{attempts} concurrent rewrites replaced it; run the command again"
    )


def events(mv) -> list[dict]:
    """The events recorded on a ModelVersion, oldest first (the `events` tag and older `event.*` tags)."""
    tags = mv.tags or {}
    out = list(_listed(tags))
    for k in sorted(tags):
        if k.startswith(EVENT_TAG_PREFIX):
            stamp = k[len(EVENT_TAG_PREFIX) :].rsplit(".", 1)[0]
            try:
                e = loads_json(tags[k], f"version tag {k}", MAX_TAG_BYTES)
            except ValueError:  # not JSON, or over the bounds: shown raw
                e = None
            e = e if isinstance(e, dict) else {"type": k.rsplit(".", 1)[-1], "raw": tags[k]}
            out.append({"stamp": stamp, **e})
    return sorted(out, key=lambda e: str(e.get("stamp") or e.get("time") or ""))


def ship_history(versions: list) -> list[int]:
    """Version numbers in the order they were shipped (their publish/rollback events), oldest first."""
    shipped = [
        (str(e.get("stamp") or e.get("time") or ""), int(mv.version))
        for mv in versions
        for e in events(mv)
        if e.get("type") in SHIP_EVENTS
    ]
    return [v for _, v in sorted(shipped)]


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
