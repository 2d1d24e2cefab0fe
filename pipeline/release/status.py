"""`pipeline status`: versions, aliases, validation, published path and fleet serving, in one view.

The registry part reads MLflow only. The fleet part comes from `pipeline.fleet.reconcile.status`
(HTTP to each configured instance) when `fleet.instances` is configured; otherwise the column
stays empty. A fleet that
cannot be read never fails the command: its error is shown (and given in `fleet_error`).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import re

from pipeline import registry
from pipeline.canary import show as canary_show
from pipeline.config import ProjectConfig
from pipeline.fleet.reconcile import status as fleet_status
from pipeline.registry.store import redact_uri
from pipeline.release.desired import volume_rows

_VERSION = re.compile(r"^v?(\d+)$")


def _fleet_rows(cfg: ProjectConfig) -> tuple[list[dict] | None, str | None]:
    """[{instance, adapter, desired, serving, state, detail}] or (None, why not)."""
    if not cfg.fleet.instances:
        return None, None
    try:
        rows = fleet_status(cfg)
    except Exception as e:  # a broken fleet must not hide the registry
        return None, f"{type(e).__name__}: {e}"
    return [dataclasses.asdict(r) if dataclasses.is_dataclass(r) else dict(r) for r in rows], None


def collect(cfg: ProjectConfig, name: str | None = None, fleet: bool = True) -> dict:
    """Everything `pipeline status` shows, as JSON-able data.

    Returns {"tracking_uri", "models": [{"name", "aliases": {alias: version}, "versions": [{
    "version", "aliases", "verdict", "eval_loss", "weights_sha256", "published_path",
    "published_time", "run_id", "created", "events", "serving": [{"instance", "state"}],
    "canary": None | {"verdict", "token_agreement", "acceptance_length", "speed_ratio", ...}}]}],
    "fleet": [...] | None, "fleet_error": str | None, "volume": [{"adapter", "desired", "state":
    drift | corrupt | absent | error, "detail"}]}; versions newest first.
    Raises UsageError: `name` is not a registered model.
    """

    names = [name] if name else registry.model_names(cfg)
    fleet_rows, fleet_error = _fleet_rows(cfg) if fleet else (None, None)
    models = []
    for n in names:
        versions = registry.versions(cfg, n)
        aliases = registry.aliases(cfg, n)
        by_version: dict[int, list[str]] = {}
        for a, v in sorted(aliases.items()):
            by_version.setdefault(v, []).append(a)
        rows = []
        for mv in versions:
            t = mv.tags or {}
            v = int(mv.version)
            serving = []
            for r in fleet_rows or []:
                m = _VERSION.match(str(r.get("serving") or ""))
                if r.get("adapter") == n and m and int(m[1]) == v:
                    serving.append({"instance": r["instance"], "state": r.get("state")})
            rows.append(
                {
                    "version": v,
                    "aliases": by_version.get(v, []),
                    "verdict": t.get("validation.verdict"),
                    "eval_loss": t.get("eval_loss"),
                    "weights_sha256": t.get("weights_sha256"),
                    "published_path": t.get("published.path"),
                    "published_time": t.get("published.time"),
                    "run_id": mv.run_id,
                    "created": dt.datetime.fromtimestamp(mv.creation_timestamp / 1000, dt.UTC).isoformat(
                        timespec="seconds"
                    ),
                    "events": registry.events(mv),
                    "serving": serving,
                    "canary": canary_show(t),
                }
            )
        models.append({"name": n, "aliases": aliases, "versions": rows})
    # what the volume says against the registry: drift, unfinished transactions, corrupt versions
    production = {m["name"]: m["aliases"].get(registry.ALIAS_PRODUCTION) for m in models}
    volume = [dataclasses.asdict(r) for r in volume_rows(cfg, [name] if name else None, production)]
    return {
        "tracking_uri": redact_uri(cfg.tracking_uri),
        "models": models,
        "fleet": fleet_rows,
        "fleet_error": fleet_error,
        "volume": volume,
    }


def _canary_cell(c: dict | None) -> str:
    """`pass agree 1.000 AL 2.10/3.21 speed x0.49`: verdict, token agreement, acceptance length adapter/base, speed."""
    if not c:
        return ""
    color = {"pass": "green", "fail": "red"}.get(c.get("verdict"), "yellow")
    parts = [f"[{color}]{c.get('verdict')}[/]", f"agree {c.get('token_agreement')}"]
    if c.get("acceptance_length"):
        parts.append(f"AL {c['acceptance_length']}/{c.get('base_acceptance_length')}")
    if c.get("speed_ratio"):
        parts.append(f"speed x{c['speed_ratio']}")
    return " ".join(parts)


def render(data: dict, console=None) -> None:
    """One rich table: a row per model version."""
    from rich.console import Console
    from rich.table import Table

    con = console or Console()
    t = Table(title=f"registry: {data['tracking_uri']}")
    for col in (
        "model",
        "version",
        "aliases",
        "validation",
        "eval loss",
        "canary",
        "published path",
        "serving",
        "created",
    ):
        t.add_column(col, overflow="fold")
    colors = {"pass": "green", "fail": "red"}
    for m in data["models"]:
        for r in m["versions"]:
            verdict = r["verdict"] or "?"
            serving = ", ".join(
                s["instance"] + ("" if s.get("state") in (None, "ok") else f" ({s['state']})")
                for s in r["serving"]
            )
            t.add_row(
                m["name"],
                str(r["version"]),
                ", ".join(r["aliases"]),
                f"[{colors.get(verdict, 'yellow')}]{verdict}[/]",
                r["eval_loss"] or "",
                _canary_cell(r.get("canary")),
                r["published_path"] or "",
                serving,
                r["created"],
            )
    if not data["models"]:
        con.print(f"no registered models in {data['tracking_uri']}")
        return
    con.print(t)
    for r in data.get("fleet") or []:
        if r.get("state") not in ("ok", None) and not r.get("serving"):
            what = " ".join(str(x) for x in (r.get("adapter"), r["state"], r.get("detail")) if x)
            con.print(f"fleet: {r['instance']}: {what}", highlight=False, markup=False)
    if data.get("fleet_error"):
        con.print(f"[yellow]fleet not read:[/] {data['fleet_error']}")
    for r in data.get("volume") or []:
        con.print(f"[bold red]{r['state']}:[/] " + r["detail"].replace("[", "\\["), highlight=False)
