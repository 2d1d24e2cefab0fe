"""Read the model registry without importing mlflow: the fast path of `pipeline status`.

Importing mlflow costs ~3 s on an idle 2-core machine (15 s under load); `status` only reads
names, aliases, versions and their tags. Where they are read from (docs/registry.md, "Speed"):

- the embedded sqlite default: MLflow's own tables (`registered_models`,
  `registered_model_aliases`, `model_versions`, `model_version_tags`), opened **read-only**
  through the standard library's sqlite3 (`mode=ro`): a missing file is "nothing registered
  yet", never a new empty store;
- another database URI (postgresql, mysql): the same queries through SQLAlchemy (mlflow's own
  dependency);
- a tracking server (http[s]://): MLflow's REST API (`/api/2.0/mlflow/registered-models/search`,
  `/model-versions/search`) through httpx, with MLflow's credential variables
  (`MLFLOW_TRACKING_TOKEN`, or `MLFLOW_TRACKING_USERNAME` / `MLFLOW_TRACKING_PASSWORD`);
- anything else, or a schema these queries do not fit (a future MLflow): the MLflow client.

Versions MLflow deleted (stage `Deleted_Internal`) are left out, as MLflow's search does; rows
are filtered by MLflow's workspace (`MLFLOW_WORKSPACE`, default `default`) when the schema has one.
"""

from __future__ import annotations

import os
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote, urlparse

from pipeline.config import ProjectConfig
from pipeline.errors import UsageError
from pipeline.registry.database import engine_uri, is_database_uri
from pipeline.registry.store import check_store, is_server_uri
from pipeline.registry.versions import aliases, model_exists, model_names, versions

DELETED_STAGE = "Deleted_Internal"  # mlflow.entities.model_registry.model_version_stages


@dataclass
class VersionRecord:
    """One model version as `status` needs it."""

    version: int
    run_id: str | None
    creation_timestamp: int  # ms since the epoch (UTC)
    description: str | None = None
    tags: dict[str, str] = field(default_factory=dict)


@dataclass
class ModelRecord:
    name: str
    aliases: dict[str, int] = field(default_factory=dict)
    versions: list[VersionRecord] = field(default_factory=list)  # newest first


class SchemaMismatch(Exception):
    """The database does not have the tables/columns these queries expect: use the MLflow client."""


# -- SQL (sqlite3 or SQLAlchemy) ---------------------------------------------------------------------------
_Q_MODELS = "SELECT name FROM registered_models{w} ORDER BY name"
_Q_ALIASES = "SELECT name, alias, version FROM registered_model_aliases{w}"
_Q_VERSIONS = (
    "SELECT name, version, run_id, creation_time, description FROM model_versions "
    "WHERE current_stage != :deleted{w_and}"
)
_Q_TAGS = "SELECT name, version, key, value FROM model_version_tags{w}"


def _workspace() -> str:
    return os.environ.get("MLFLOW_WORKSPACE") or "default"


def _records(run, names: list[str] | None) -> list[ModelRecord]:
    """Assemble records from `run(sql, params) -> rows`; `names` None = every model."""
    all_names = [r[0] for r in run(_Q_MODELS, {})]
    wanted = all_names if names is None else [n for n in names if n in set(all_names)]
    models = {n: ModelRecord(n) for n in wanted}
    for n, alias, v in run(_Q_ALIASES, {}):
        if n in models:
            models[n].aliases[alias] = int(v)
    by_key: dict[tuple[str, int], VersionRecord] = {}
    for n, v, run_id, created, desc in run(_Q_VERSIONS, {"deleted": DELETED_STAGE}):
        if n in models:
            rec = VersionRecord(int(v), run_id or None, int(created or 0), desc)
            by_key[(n, int(v))] = rec
            models[n].versions.append(rec)
    for n, v, k, val in run(_Q_TAGS, {}):
        rec = by_key.get((n, int(v)))
        if rec is not None:
            rec.tags[k] = val
    for m in models.values():
        m.versions.sort(key=lambda r: -r.version)
    return [models[n] for n in wanted]


def _sql(template: str, workspace: bool) -> str:
    w = " WHERE workspace = :workspace" if workspace else ""
    return template.format(w=w, w_and=" AND workspace = :workspace" if workspace else "")


def _sqlite_path(uri: str) -> Path:
    # sqlite:////abs/path (absolute) or sqlite:///rel/path (relative to the working directory)
    return Path(unquote(uri[len("sqlite:///") :]))


def read_sqlite(db: Path, names: list[str] | None) -> list[ModelRecord]:
    """Records from an MLflow sqlite file opened read-only ([] when the file does not exist)."""
    if not db.exists():
        return []
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)
    try:
        cols = {r[1] for r in con.execute("PRAGMA table_info(model_versions)")}
        if not {"name", "version", "run_id", "creation_time", "description", "current_stage"} <= cols:
            raise SchemaMismatch(f"{db}: model_versions has columns {sorted(cols)}")
        ws = "workspace" in cols

        def run(sql: str, params: dict):
            return con.execute(_sql(sql, ws), {**params, "workspace": _workspace()}).fetchall()

        try:
            return _records(run, names)
        except sqlite3.OperationalError as e:
            if "locked" in str(e) or "busy" in str(e):
                raise UsageError(f"registry {db} is locked by another process for more than 10 s: {e}") from e
            raise SchemaMismatch(str(e)) from e
    finally:
        con.close()


def read_sqlalchemy(uri: str, names: list[str] | None) -> list[ModelRecord]:
    """Records from another database MLflow uses (postgresql, mysql, mssql), read through SQLAlchemy."""
    import sqlalchemy as sa

    engine = sa.create_engine(engine_uri(uri), pool_pre_ping=False, connect_args=_connect_args(uri))
    try:
        with engine.connect() as con:
            cols = {c["name"] for c in sa.inspect(con).get_columns("model_versions")}
            if not cols:
                raise SchemaMismatch(f"{uri}: no model_versions table")
            ws = "workspace" in cols

            def run(sql: str, params: dict):
                return con.execute(sa.text(_sql(sql, ws)), {**params, "workspace": _workspace()}).fetchall()

            return _records(run, names)
    except sa.exc.OperationalError as e:
        raise UsageError(f"registry database not reachable ({e.orig})") from e
    except sa.exc.ProgrammingError as e:
        raise SchemaMismatch(str(e)) from e
    finally:
        engine.dispose()


def _connect_args(uri: str) -> dict:
    return {"connect_timeout": 5} if uri.startswith(("postgres", "mysql")) else {}


# -- REST (a tracking server) ------------------------------------------------------------------------------
def _auth_headers() -> dict[str, str]:
    import base64

    if os.environ.get("MLFLOW_TRACKING_TOKEN"):
        return {"Authorization": f"Bearer {os.environ['MLFLOW_TRACKING_TOKEN']}"}
    user, pw = os.environ.get("MLFLOW_TRACKING_USERNAME"), os.environ.get("MLFLOW_TRACKING_PASSWORD")
    if user and pw:
        return {"Authorization": "Basic " + base64.b64encode(f"{user}:{pw}".encode()).decode()}
    return {}


def read_rest(uri: str, names: list[str] | None, timeout_s: float = 10.0) -> list[ModelRecord]:
    """Records from an MLflow tracking server's REST API (paged searches)."""
    import httpx

    base = uri.rstrip("/") + "/api/2.0/mlflow"
    verify = os.environ.get("MLFLOW_TRACKING_INSECURE_TLS", "").lower() != "true"
    with httpx.Client(headers=_auth_headers(), timeout=timeout_s, verify=verify) as http:

        def pages(path: str, key: str, params: dict):
            token = None
            while True:
                q = dict(params, **({"page_token": token} if token else {}))
                try:
                    r = http.get(f"{base}/{path}", params=q)
                except httpx.HTTPError as e:
                    raise UsageError(f"registry server {uri} not reachable: {e}") from e
                if r.status_code in (401, 403):
                    raise UsageError(f"registry server {uri}: HTTP {r.status_code} (credentials?)")
                if r.status_code == 404:
                    raise SchemaMismatch(f"{uri}: no {path} endpoint")
                r.raise_for_status()
                body = r.json()
                yield from body.get(key) or []
                token = body.get("next_page_token")
                if not token:
                    return

        out = []
        for m in pages("registered-models/search", "registered_models", {"max_results": 1000}):
            if names is not None and m["name"] not in names:
                continue
            rec = ModelRecord(m["name"], {a["alias"]: int(a["version"]) for a in m.get("aliases") or []})
            name_q = m["name"].replace("'", "\\'")
            for v in pages("model-versions/search", "model_versions", {"filter": f"name='{name_q}'"}):
                if v.get("current_stage") == DELETED_STAGE:
                    continue
                rec.versions.append(
                    VersionRecord(
                        int(v["version"]),
                        v.get("run_id") or None,
                        int(v.get("creation_timestamp") or 0),
                        v.get("description"),
                        {t["key"]: t.get("value") for t in v.get("tags") or []},
                    )
                )
            rec.versions.sort(key=lambda r: -r.version)
            out.append(rec)
        return sorted(out, key=lambda r: r.name)


# -- the MLflow client (fallback) --------------------------------------------------------------------------
def read_mlflow(cfg: ProjectConfig, names: list[str] | None) -> list[ModelRecord]:
    """Records through the MLflow client (the slow, always-correct path)."""
    out = []
    for n in names if names is not None else model_names(cfg):
        if not model_exists(cfg, n):
            continue
        rec = ModelRecord(n, aliases(cfg, n))
        for mv in versions(cfg, n):
            rec.versions.append(
                VersionRecord(
                    int(mv.version),
                    mv.run_id,
                    int(mv.creation_timestamp or 0),
                    mv.description,
                    dict(mv.tags or {}),
                )
            )
        out.append(rec)
    return out


def backend(cfg: ProjectConfig) -> str:
    """Which reader `read_models` uses for this config: sqlite | sql | rest | mlflow."""
    uri = cfg.tracking_uri
    if uri.startswith("sqlite:///") and not cfg.registry.registry_uri:
        return "sqlite"
    if is_server_uri(uri) and urlparse(uri).scheme in ("http", "https") and not cfg.registry.registry_uri:
        return "rest"
    if is_database_uri(uri) and not cfg.registry.registry_uri:
        return "sql"
    return "mlflow"


def read_models(cfg: ProjectConfig, names: list[str] | None = None) -> list[ModelRecord]:
    """Registered models (all, or `names` that exist) with aliases and versions, newest version first.

    Never creates a store. Falls back to the MLflow client when the direct read does not fit the
    schema. Raises StoreError (a UsageError, exit 2) when the store cannot be used: the same checks
    and messages as every command that writes (`pipeline.registry.store.check_store`: unreachable,
    not a database, a sqlite file this project created that is gone, a refused file store).
    """
    check_store(cfg, write=False)  # a read-only store can still be read
    kind = backend(cfg)
    try:
        if kind == "sqlite":
            return read_sqlite(_sqlite_path(cfg.tracking_uri), names)
        if kind == "rest":
            return read_rest(cfg.tracking_uri, names)
        if kind == "sql":
            return read_sqlalchemy(cfg.registry.registry_uri or cfg.tracking_uri, names)
    except SchemaMismatch:
        pass
    return read_mlflow(cfg, names)
