"""`pipeline status`: versions, aliases, validation, gate, published path and fleet serving, as data.

The registry part is read without importing mlflow (`pipeline.registry.read`: the sqlite file
read-only, SQL through SQLAlchemy, or the server's REST API), so the command answers in about a
second; an embedded store that does not exist yet reads as empty and is not created. The fleet
part comes from `pipeline.fleet.reconcile.status` (HTTP to each configured instance) when
`fleet.instances` is configured; otherwise the column stays empty. A fleet that cannot be read
never fails the command: its error is shown (and given in `fleet_error`). `pipeline.cli.render`
prints it; nothing here prints.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import re
from types import SimpleNamespace

from pipeline.config import ProjectConfig
from pipeline.errors import UsageError
from pipeline.registry.events import events
from pipeline.registry.presentation import published_path
from pipeline.registry.read import backend, read_models
from pipeline.registry.speed import show as show_speed
from pipeline.registry.store import redact_uri
from pipeline.registry.versions import ALIAS_PRODUCTION, GATE_REASON_TAG, GATE_VERDICT_TAG
from pipeline.release.desired import volume_rows

_VERSION = re.compile(r"v?(\d+)\Z")
CANARY_TAG = "canary."  # pipeline.canary.record.TAG
MERGED_TAG = "merge.served."  # pipeline.merge.served.TAG (`pipeline merge-parity`: merged vs hot-loaded)
MERGED_TEXT = ("verdict", "time", "merged_dir")
# Version tags that hold numbers: `status --json` gives them as numbers.
NUMERIC_TAGS = ("eval_loss", "train_loss", "tokens_per_s", "mfu")


def number(v) -> float | int | None:
    """A tag value as a number (int when integral text), None when absent or not a number."""
    if v is None or v == "":
        return None
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return int(f) if str(v).lstrip("-").isdigit() else f


def _fleet_rows(cfg: ProjectConfig) -> tuple[list[dict] | None, str | None]:
    """[{instance, adapter, desired, serving, state, detail}] or (None, why not)."""
    if not cfg.fleet.instances:
        return None, None
    try:
        # httpx + the fleet client cost ~1 s; only a project with instances needs them
        from pipeline.fleet import reconcile  # lazy: httpx + fleet client, only with instances

        fleet_status = reconcile.status

        rows = fleet_status(cfg)
    except Exception as e:  # a broken fleet must not hide the registry
        return None, f"{type(e).__name__}: {e}"
    return [dataclasses.asdict(r) if dataclasses.is_dataclass(r) else dict(r) for r in rows], None


def _canary(tags: dict) -> dict | None:
    if CANARY_TAG + "verdict" not in tags:
        return None
    from pipeline.canary.record import show  # lazy: pipeline.canary pulls the engine client (httpx); rare

    c = show(tags)
    for k, v in list((c or {}).items()):
        if k not in ("verdict", "time", "checkpoint", "engine_model", "weights_sha256"):
            c[k] = number(v)
    return c


def _merged(tags: dict) -> dict | None:
    """The merged-vs-hot-loaded side-by-side of a version (`pipeline merge-parity`), numbers as numbers."""
    keys = [k[len(MERGED_TAG) :] for k in tags if k.startswith(MERGED_TAG)]
    if "verdict" not in keys:
        return None
    return {
        k: tags[MERGED_TAG + k] if k in MERGED_TEXT else number(tags[MERGED_TAG + k]) for k in sorted(keys)
    }


def collect(cfg: ProjectConfig, name: str | None = None, fleet: bool = True) -> dict:
    """Everything `pipeline status` shows, as JSON-able data (numbers as numbers).

    Returns {"tracking_uri", "reader", "project", "store_exists", "volume_path", "models": [{"name", "aliases":
    {alias: version}, "versions": [{"version", "aliases", "verdict", "gate": None | {"verdict",
    "reason"}, "eval_loss", "train_loss", "tokens_per_s", "weights_sha256", "published_path",
    "published_time", "run_id", "created", "events", "serving": [{"instance", "state"}],
    "canary": None | {"verdict", "token_agreement", ...}, "merged": None | {"verdict", "hot_tok_s",
    "merged_tok_s", "hot_acceptance_length", "merged_acceptance_length", "agreement", ...}, "speed": None |
    {"acceptance.length_base", "acceptance.length_adapter", "acceptance.ratio", "acceptance.speed_ratio",
    "drafter.length_after", ...} (`pipeline.registry.speed.show`)}]}], "fleet": [...] | None,
    "fleet_error": str | None, "volume": [{"adapter", "desired", "state": drift | corrupt | absent
    | error, "detail"}]}; versions newest first; losses in nats, tokens_per_s per second.
    Raises UsageError: `name` is not a registered model (the message lists those that exist).
    """
    records = read_models(cfg, [name] if name else None)
    if name and not records:
        have = [m.name for m in read_models(cfg)] if cfg.store_exists() else []
        raise UsageError(
            f"registered model {name!r} not found in {redact_uri(cfg.tracking_uri)} (have: {have})"
        )
    fleet_rows, fleet_error = _fleet_rows(cfg) if fleet else (None, None)
    if name and fleet_rows is not None:  # another adapter's rows are not this model's status
        fleet_rows = [r for r in fleet_rows if r.get("adapter") in (None, name)]
    models = []
    for rec in records:
        n = rec.name
        by_version: dict[int, list[str]] = {}
        for a, v in sorted(rec.aliases.items()):
            by_version.setdefault(v, []).append(a)
        rows = []
        for mv in rec.versions:
            t = mv.tags
            v = mv.version
            serving = []
            for r in fleet_rows or []:
                m = _VERSION.match(str(r.get("serving") or ""))
                if r.get("adapter") == n and m and int(m[1]) == v:
                    serving.append({"instance": r["instance"], "state": r.get("state")})
            gate = (
                {"verdict": t[GATE_VERDICT_TAG], "reason": t.get(GATE_REASON_TAG) or None}
                if t.get(GATE_VERDICT_TAG)
                else None
            )
            rows.append(
                {
                    "version": v,
                    "aliases": by_version.get(v, []),
                    "verdict": t.get("validation.verdict"),
                    "gate": gate,
                    **{k: number(t.get(k)) for k in NUMERIC_TAGS},
                    "weights_sha256": t.get("weights_sha256"),
                    "published_path": published_path(t),
                    "published_time": t.get("published.time"),
                    "run_id": mv.run_id,
                    "created": dt.datetime.fromtimestamp(mv.creation_timestamp / 1000, dt.UTC).isoformat(
                        timespec="seconds"
                    ),
                    "events": events(SimpleNamespace(tags=t)),
                    "serving": serving,
                    "canary": _canary(t),
                    "merged": _merged(t),
                    "speed": show_speed(t),
                }
            )
        models.append({"name": n, "aliases": rec.aliases, "versions": rows})
    # what the volume says against the registry: drift, unfinished transactions, corrupt versions
    production = {m["name"]: m["aliases"].get(ALIAS_PRODUCTION) for m in models}
    volume = [dataclasses.asdict(r) for r in volume_rows(cfg, [name] if name else None, production)]
    return {
        "tracking_uri": redact_uri(cfg.tracking_uri),
        "reader": backend(cfg),
        "project": str(cfg.source or cfg.root) if cfg.found else None,
        "store_exists": cfg.store_exists(),
        "volume_path": str(cfg.volume.path),
        "models": models,
        "fleet": fleet_rows,
        "fleet_error": fleet_error,
        "volume": volume,
    }
