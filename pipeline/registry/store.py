"""The MLflow store: checked first, imported lazily (~2 s), pointed at the project's tracking URI, initialised once.

Concurrent first-time schema creation corrupts a sqlite store (docs/registry.md, "Measured"), so
the store is initialised once under a file lock before anything else touches it.

Before MLflow is imported, `check_store` makes sure the store can be used at all, within
`registry.connect_timeout_s` seconds, and says what is wrong and which store (`StoreError`,
exit 2) instead of MLflow's retries (a closed port took 251 s: 7 retries with backoff factor 2)
and tracebacks:
  - sqlite: the database file was deleted after the project created it (MLflow would silently
    create an empty one and version numbers would start again at 1), is locked by another
    process, or is not a database;
  - http(s) tracking server, PostgreSQL/MySQL: the host does not accept connections, or the
    server does not answer `/health`;
  - a file store (`./mlruns`, `file:`): MLflow >= 3.14 refuses it unless
    `MLFLOW_ALLOW_FILE_STORE=true` (mlflow/store/tracking/file_store.py).
`as_store_error` turns MLflow/SQLAlchemy/HTTP exceptions met later into `StoreError`.
"""

from __future__ import annotations

import json
import os
import socket
import sqlite3
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from pipeline.artifacts.locks import private_lock
from pipeline.artifacts.modes import make_dir
from pipeline.artifacts.volume import version_dirs
from pipeline.config import ProjectConfig
from pipeline.errors import StoreError
from pipeline.redact import quiet_third_party, redact, redact_uri
from pipeline.registry.database import MLFLOW_TABLES, check_driver, engine_uri, is_database_uri, probe

# MLflow's HTTP client retries 7 times with backoff factor 2 (~4 minutes) by default; a pipeline
# command should fail within seconds. The user's environment still wins.
HTTP_DEFAULTS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "60",
}
_checked: set[tuple[str, bool]] = set()  # (uri, checked for writing)
NEW_REGISTRY_ENV = (
    "PIPELINE_NEW_REGISTRY"  # =1: start a new, empty registry although the volume holds versions
)
_last_uri: list[str] = []


def _marker(cfg: ProjectConfig, uri: str) -> Path:
    """`<state_dir>/.mlflow-init-<hash>`: this project created the store at `uri` (`mlflow_for`)."""
    return cfg.state_dir / f".mlflow-init-{_uri_key(engine_uri(uri))}"


def _sqlite_path(uri: str) -> Path | None:
    rest = uri.split(":", 1)[1].removeprefix("///")
    rest = rest.split("?", 1)[0]
    if not rest or rest == ":memory:":
        return None
    return Path(rest if rest.startswith("/") else os.path.abspath(rest))


def _check_sqlite(cfg: ProjectConfig, uri: str, timeout_s: float, write: bool = True) -> None:
    path = _sqlite_path(uri)
    if path is None:
        raise StoreError(
            f"the sqlite URI {uri!r} names no database file (an in-memory store: nothing registered would "
            "outlive the command): use sqlite:///RELATIVE/PATH or sqlite:////ABSOLUTE/PATH, or unset "
            "MLFLOW_TRACKING_URI for the project's own store"
        )
    marker = _marker(cfg, uri)
    if not path.exists():
        if marker.exists():
            raise StoreError(
                f"the MLflow database {path} is gone, but this project created it before ({marker}): "
                f"MLflow would silently start an empty registry whose version numbers collide with the "
                f"published ones. Restore the file from a backup; or, to start a new empty registry on "
                f"purpose, delete {marker} (published versions from the old registry are then refused "
                f"by `publish`, which checks where each version directory came from)"
            )
        refuse_new_over_published(cfg, f"the MLflow database {path}")
        return
    if path.is_dir():
        raise StoreError(f"the MLflow database {path} is a directory, not a sqlite file")
    if not os.access(path, os.R_OK):
        raise StoreError(f"the MLflow database {path} {_owner_hint(path, 'read')}")
    if write and not (os.access(path, os.W_OK) and os.access(path.parent, os.W_OK)):
        # sqlite takes its locks on a read-only file without complaint; the first write fails later,
        # after a publish may already have moved the volume: refuse before anything is written
        raise StoreError(
            f"the MLflow database {path} (or its directory, for sqlite's journal) "
            + _owner_hint(path, "write")
        )
    if not write:
        recover_hot_journal(path, timeout_s)
    try:
        conn = sqlite3.connect(f"file:{path}?mode={'rw' if write else 'ro'}", uri=True, timeout=timeout_s)
    except sqlite3.Error as e:
        raise StoreError(f"cannot open the MLflow database {path}: {e}") from e
    try:
        conn.execute("SELECT count(*) FROM sqlite_master").fetchone()  # fails under an exclusive lock
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        refuse_unknown_state(
            cfg, uri, tables - {"sqlite_sequence", "sqlite_stat1"}, f"the MLflow database {path}"
        )
        if write:  # a reader need not wait for a writer's (reserved) lock: sqlite lets it read
            conn.execute("BEGIN IMMEDIATE")  # takes the write lock: another process holding it blocks us
            conn.rollback()
    except sqlite3.OperationalError as e:
        if "locked" in str(e) or "busy" in str(e):
            raise StoreError(
                f"the MLflow database {path} is locked by another process (waited {timeout_s:.0f} s, "
                f"registry.connect_timeout_s): find it with `fuser {path}` and let it finish"
            ) from e
        if "readonly" in str(e) or "read-only" in str(e):
            raise StoreError(f"the MLflow database {path} is read-only here: {e}") from e
        raise StoreError(f"the MLflow database {path} cannot be used: {e}") from e
    except sqlite3.DatabaseError as e:
        if marker.exists():
            raise StoreError(
                f"the MLflow database {path} is damaged or truncated ({e}), and this project created it "
                f"({marker}). Nothing was changed: {_restore_or_anew(marker)}"
            ) from e
        raise StoreError(f"{path} is not an MLflow sqlite database ({e}); check MLFLOW_TRACKING_URI") from e
    finally:
        conn.close()


def _restore_or_anew(marker: Path) -> str:
    return (
        f"restore it from a backup; or, to start a new empty registry on purpose, move it aside, delete "
        f"{marker} and run the command once with {NEW_REGISTRY_ENV}=1 (versions published from the old "
        "registry are then refused by `publish` and `rollback`, which check where each version directory "
        "came from)"
    )


def refuse_new_over_published(cfg: ProjectConfig, where: str) -> None:
    """StoreError when an empty store would be initialised while the volume holds published versions.

    The marker (`_marker`) says this project created a store; with the whole state directory lost it is
    gone too, but the versions on the volume still say a registry numbered them: a new one would number
    its versions from 1 again beside them (issue 40). Starting anew is then explicit: `PIPELINE_NEW_REGISTRY=1`.
    """
    if os.environ.get(NEW_REGISTRY_ENV) == "1" or cfg.volume.path is None:
        return
    try:
        published = version_dirs(Path(cfg.volume.path))
    except Exception:  # an unreadable volume is the volume checks' to report, not the store's
        return
    if not published:
        return
    shown = ", ".join(f"{n} v{','.join(map(str, v[:3]))}" for n, v in sorted(published.items())[:3])
    raise StoreError(
        f"{where} holds no registry, but the volume {cfg.volume.path} holds {sum(map(len, published.values()))} "
        f"published version(s) ({shown}{', ...' if len(published) > 3 else ''}) that a registry numbered: a new "
        "one would number its versions from 1 again beside them. Nothing was changed. Point "
        "MLFLOW_TRACKING_URI / registry.tracking_uri at the store they came from or restore it from a backup; "
        f"or start a new, empty registry on purpose by running the command once with {NEW_REGISTRY_ENV}=1 "
        "(versions published from the old registry are then refused by `publish` and `rollback`)"
    )


def refuse_unknown_state(cfg: ProjectConfig, uri: str, tables: set[str], where: str) -> None:
    """StoreError for a store in a state this project did not leave: MLflow would initialise it silently.

    `tables`: the store's tables. Foreign (tables, none of MLflow's): always. Empty (no tables: a
    sqlite file truncated to 0 bytes, a dropped schema, a new database at the same URI) while this
    project's marker says it created the store here (`mlflow_for`): its versions would be numbered
    from 1 again while the old ones are on the volume. A new, empty store the project never used is
    initialised as before (first use).
    """
    if tables and not MLFLOW_TABLES & tables:
        shown = ", ".join(sorted(tables)[:5]) + (", ..." if len(tables) > 5 else "")
        raise StoreError(
            f"{where} is not an MLflow store: it has tables ({shown}) but none of MLflow's "
            f"({', '.join(sorted(MLFLOW_TABLES))}), and MLflow would add its own next to them. Nothing was "
            "changed: check MLFLOW_TRACKING_URI / registry.tracking_uri, or point it at an empty database"
        )
    marker = _marker(cfg, uri)
    if not tables and not marker.exists():
        refuse_new_over_published(cfg, where)
    if not tables and marker.exists():
        raise StoreError(
            f"{where} is empty (no tables), but this project created its registry there before ({marker}): "
            "it was truncated, dropped or replaced, and MLflow would silently start a new registry whose "
            f"version numbers collide with the published ones. Nothing was changed: {_restore_or_anew(marker)}"
        )


def _owner_hint(path: Path, what: str) -> str:
    """`cannot be read/written by this user ...` with the fix that fits: run as its owner, or make it writable."""
    try:
        owner = path.stat().st_uid
    except OSError:
        owner = None
    me = os.geteuid()
    try:  # a read-only mount: no chmod helps (the hint it gave before)
        read_only_fs = bool(os.statvfs(path.parent).f_flag & os.ST_RDONLY)
    except OSError:
        read_only_fs = False
    if what == "write" and read_only_fs:
        return (
            f"is on a filesystem mounted read-only ({path.parent}): run the command where the store is "
            "mounted read-write, or point MLFLOW_TRACKING_URI at a store that is"
        )
    if owner is not None and owner != me:
        return (
            f"cannot be {'read' if what == 'read' else 'written'} by this user (uid {me}); it belongs to "
            f"uid {owner}: run the command as that user (the registry is the operator's alone)"
        )
    return (
        f"is {'unreadable' if what == 'read' else 'read-only'} here: make it "
        f"{'readable' if what == 'read' else 'writable'} (chmod u+rw, and u+w on its directory), "
        "or point MLFLOW_TRACKING_URI at another store"
    )


def recover_hot_journal(path: Path, timeout_s: float) -> None:
    """Roll back what a killed writer left (`<db>-journal`, a "hot journal"), so that readers can read.

    A reader opens the database read-only, and sqlite must roll a hot journal back before anyone
    reads, which a read-only connection cannot do ("attempt to write a readonly database"). A user
    who may write the file does it here with one read-write connection (sqlite's own recovery,
    under its locks; https://www.sqlite.org/atomiccommit.html#hot_rollback_journals); any other
    user gets a StoreError saying who must run what. No journal: nothing happens.
    """
    journal = Path(f"{path}-journal")
    try:
        if journal.stat().st_size == 0:
            return
    except OSError:
        return
    probe = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=timeout_s)
    try:
        probe.execute("SELECT count(*) FROM sqlite_master").fetchone()
        return  # a live writer's journal (it holds the lock), or already rolled back
    except sqlite3.OperationalError as e:
        if "readonly" not in str(e) and "read-only" not in str(e):
            return  # locked, busy...: the caller's checks say so
    finally:
        probe.close()
    if not (os.access(path, os.W_OK) and os.access(path.parent, os.W_OK)):
        raise StoreError(
            f"the MLflow database {path} has a hot journal ({journal}): a writer was killed mid-commit, and "
            f"sqlite must roll that back before anyone can read. This user (uid {os.geteuid()}) cannot: run "
            f"any pipeline command (e.g. `pipeline status`) once as the store's owner (uid {path.stat().st_uid}), "
            f"or `sqlite3 {path} 'PRAGMA integrity_check'` as that user"
        )
    conn = sqlite3.connect(f"file:{path}?mode=rw", uri=True, timeout=timeout_s)
    try:
        conn.execute("SELECT count(*) FROM sqlite_master").fetchone()  # sqlite rolls the journal back
    except sqlite3.Error as e:
        raise StoreError(
            f"the MLflow database {path}: rolling back its hot journal {journal} failed: {e}"
        ) from e
    finally:
        conn.close()


def _check_tcp(uri: str, host: str | None, port: int, timeout_s: float) -> None:
    if not host:
        return
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            pass
    except OSError as e:
        why = "timed out" if isinstance(e, TimeoutError) else (e.strerror or str(e))
        raise StoreError(
            f"the MLflow store {redact_uri(uri)} is unreachable: {host}:{port} {why} "
            f"(within {timeout_s:.0f} s, registry.connect_timeout_s); is the server running, and is "
            f"MLFLOW_TRACKING_URI / registry.tracking_uri right?"
        ) from e


def _check_http(uri: str, timeout_s: float) -> None:
    u = urllib.parse.urlparse(uri)
    _check_tcp(uri, u.hostname, u.port or (443 if u.scheme == "https" else 80), timeout_s)
    health = urllib.parse.urlunparse((u.scheme, u.netloc, u.path.rstrip("/") + "/health", "", "", ""))
    try:
        with urllib.request.urlopen(health, timeout=timeout_s) as r:
            r.read(64)
    except urllib.error.HTTPError:
        return  # it answers HTTP (a proxy may guard /health): MLflow's own errors will be specific
    except (OSError, ValueError) as e:
        raise StoreError(
            f"the MLflow tracking server {redact_uri(uri)} does not answer ({type(e).__name__}: {e}) "
            f"within {timeout_s:.0f} s (registry.connect_timeout_s)"
        ) from e


def _check_uri(cfg: ProjectConfig, uri: str, write: bool = True) -> None:
    timeout_s = cfg.registry.connect_timeout_s
    scheme = urllib.parse.urlparse(uri).scheme.lower()
    db = scheme.split("+", 1)[0]
    if db == "sqlite":
        _check_sqlite(cfg, uri, timeout_s, write)
    elif scheme in ("http", "https"):
        _check_http(uri, timeout_s)
    elif is_database_uri(uri):
        u = urllib.parse.urlparse(uri)
        default = {"mysql": 3306, "mssql": 1433}.get(db, 5432)
        check_driver(uri)  # a missing driver is named before any connection
        _check_tcp(uri, u.hostname, u.port or default, timeout_s)
        found = probe(uri, timeout_s, write)  # driver, login, tables; for a writer: privileges
        refuse_unknown_state(cfg, uri, found.tables, f"the MLflow store {redact_uri(uri)}")
    elif scheme in ("", "file") or len(scheme) == 1:
        allowed = os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").strip().lower() in ("1", "true", "yes")
        if not allowed:
            raise StoreError(
                f"the MLflow store {uri!r} is a file store, which MLflow >= 3.14 refuses (maintenance "
                f"mode): use a database, e.g. MLFLOW_TRACKING_URI=sqlite:///mlflow.db (unset it to use "
                f"the project's {cfg.state_dir}/mlflow.db); migrate old data with `mlflow migrate-filestore`, "
                f"or set MLFLOW_ALLOW_FILE_STORE=true to keep the file store"
            )
    elif not scheme.startswith("databricks"):
        raise StoreError(
            f"the MLflow store URI {redact_uri(uri)} has the scheme {scheme!r}, which this pipeline does not "
            "support: use sqlite:///PATH (the default, in the state directory), postgresql://USER:PASSWORD@HOST/DB, "
            "mysql+pymysql://USER:PASSWORD@HOST/DB or http(s)://HOST:PORT (a tracking server); see docs/registry.md"
        )


def store_exists(cfg: ProjectConfig) -> bool:
    """False only for an embedded sqlite store whose file does not exist yet (nothing registered)."""
    uri = cfg.tracking_uri
    if uri.startswith("sqlite:") and (p := _sqlite_path(uri)) is not None:
        return p.exists()
    return True


def check_store(cfg: ProjectConfig, write: bool = True) -> None:
    """Make sure the tracking (and registry) store can be used; once per store and process.

    Writes nothing (a sqlite file that does not exist yet is fine: MLflow creates it). Raises
    StoreError naming the store, what is wrong and how to fix it, within about
    `registry.connect_timeout_s` seconds.
    """
    uris = [cfg.tracking_uri] + ([cfg.registry.registry_uri] if cfg.registry.registry_uri else [])
    for uri in uris:
        if (uri, write) in _checked or (uri, True) in _checked:
            continue
        _check_uri(cfg, uri, write)
        _checked.add((uri, write))


def as_store_error(exc: BaseException, uri: str | None = None) -> StoreError | None:
    """`exc` (raised by MLflow, SQLAlchemy or the HTTP stack) as a StoreError naming the store, else None."""
    mod = type(exc).__module__ or ""
    if not mod.startswith(("mlflow", "sqlalchemy", "sqlite3", "requests", "urllib3", "psycopg2", "pymysql")):
        return None
    uri = uri or (_last_uri[-1] if _last_uri else "the MLflow store")
    text = redact(str(exc).strip().splitlines()[0]) if str(exc).strip() else type(exc).__name__
    if "database is locked" in str(exc):
        return StoreError(
            f"the MLflow store {redact_uri(uri)} is locked by another process (sqlite 'database is locked'); "
            f"let it finish and run the command again"
        )
    return StoreError(f"the MLflow store {redact_uri(uri)} failed: {type(exc).__name__}: {text[:500]}")


def mlflow_for(cfg: ProjectConfig):
    """Import mlflow pointed at the project's store, initialised once under a lock."""
    os.environ.setdefault("MLFLOW_ENABLE_ASYNC_LOGGING", "false")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    for k, v in HTTP_DEFAULTS.items():
        os.environ.setdefault(k, v)
    uri = cfg.tracking_uri
    check_store(cfg)  # before the ~2 s import, and before MLflow creates or retries anything
    _last_uri[:] = [uri]
    import mlflow

    quiet_third_party()  # MLflow just configured its loggers: at the CLI's default level, quiet again

    # mlflow.set_tracking_uri also exports MLFLOW_TRACKING_URI, which `ProjectConfig.tracking_uri`
    # prefers over the config file: the next config in this process (or any child, e.g. a test's
    # `pipeline register`) would silently use this store. Keep the environment as it was.
    env_before = os.environ.get("MLFLOW_TRACKING_URI")
    mlflow.set_tracking_uri(engine_uri(uri))  # `postgresql://`: the driver the project ships
    if env_before is None:
        os.environ.pop("MLFLOW_TRACKING_URI", None)
    else:
        os.environ["MLFLOW_TRACKING_URI"] = env_before
    if cfg.registry.registry_uri:
        mlflow.set_registry_uri(engine_uri(cfg.registry.registry_uri))
    try:
        make_dir(cfg.state_dir)  # 0755 whatever the umask: nobody else writes into it
    except OSError as e:
        raise StoreError(f"cannot create the state directory {cfg.state_dir}: {e.strerror or e}") from e
    marker = _marker(cfg, uri)
    if not marker.exists():
        with private_lock(cfg.state_dir / "mlflow-init.lock").acquire(timeout=300):
            if not marker.exists():
                ensure_experiment(cfg, mlflow)  # creates the schema and the experiment
                marker.write_text(uri + "\n")
                os.chmod(marker, 0o644)  # not the umask's: nobody else may write the store's marker
    elif uri.startswith("sqlite:") and (p := _sqlite_path(uri)) is not None and not p.exists():
        raise StoreError(f"the MLflow database {p} disappeared while this command ran")
    keep_private(cfg)
    return mlflow


def keep_private(cfg: ProjectConfig) -> None:
    """The embedded store is the operator's: the sqlite file 0600 and the artifact store 0700.

    Created with the umask (0644, 0755), any local user could read every version, tag and artifact
    straight from disk, past the UI's login (pipeline.registry.ui). Only files this user owns are
    changed; a store configured elsewhere (a server, PostgreSQL, S3) keeps its own access rules.
    """
    for path, mode in (
        (cfg.embedded_store, 0o600),
        (cfg.artifact_root if cfg.embedded_store else None, 0o700),
    ):
        try:
            st = os.lstat(path) if path is not None else None
        except OSError:
            continue
        if st is not None and st.st_uid == os.geteuid() and (st.st_mode & 0o777) & ~mode:
            os.chmod(path, (st.st_mode & 0o777) & mode)


def store_identity(cfg: ProjectConfig) -> dict:
    """Which registry this is: {"tracking_uri" (redacted), "experiment_id", "experiment_created" (ms)}.

    The project experiment's id and creation time differ between a store and one recreated at the
    same URI (a deleted sqlite file, a new database), so a version directory that records them
    can tell a new "v1" from the one it was published from.
    """
    mlflow = mlflow_for(cfg)
    exp = mlflow.MlflowClient().get_experiment_by_name(cfg.registry.experiment)
    return {
        "tracking_uri": redact_uri(cfg.tracking_uri),
        "experiment_id": exp.experiment_id if exp else None,
        "experiment_created": getattr(exp, "creation_time", None) if exp else None,
    }


def _uri_key(uri: str) -> str:
    import hashlib

    return hashlib.sha256(uri.encode()).hexdigest()[:12]


def ensure_experiment(cfg: ProjectConfig, mlflow) -> str:
    client = mlflow.MlflowClient()
    exp = client.get_experiment_by_name(cfg.registry.experiment)
    if exp is not None:
        return exp.experiment_id
    location = artifact_location(cfg)
    if location and location.startswith("file:"):
        cfg.artifact_root.mkdir(parents=True, exist_ok=True)
    try:
        return client.create_experiment(cfg.registry.experiment, artifact_location=location)
    except Exception:  # created concurrently
        return client.get_experiment_by_name(cfg.registry.experiment).experiment_id


def is_server_uri(uri: str) -> bool:
    """True for a tracking server (http[s]://, databricks): it chooses artifact locations itself."""
    return uri.startswith(("http://", "https://", "databricks"))


def artifact_location(cfg: ProjectConfig) -> str | None:
    """Where the experiment keeps artifacts when this process talks to the database directly.


    `registry.artifact_location` (e.g. `s3://bucket/prefix`, credentials and
    `MLFLOW_S3_ENDPOINT_URL` from the environment), else `<state_dir>/mlartifacts` for a
    database URI (sqlite, postgresql, mysql), else None: a server decides.
    """
    if cfg.registry.artifact_location:
        return cfg.registry.artifact_location
    if is_server_uri(cfg.tracking_uri):
        return None
    return cfg.artifact_root.as_uri()


def experiment_id(cfg: ProjectConfig) -> str:
    return ensure_experiment(cfg, mlflow_for(cfg))


def initialised(cfg: ProjectConfig) -> bool:
    """This project created the store's schema and experiment already (`mlflow_for`'s marker), and
    an embedded database is still there: no need to import mlflow (~2 s) to make sure."""
    uri = cfg.tracking_uri
    p = _sqlite_path(uri) if uri.startswith("sqlite:") else None
    return _marker(cfg, uri).exists() and (p is None or p.exists())


def flatten_params(d: dict, prefix: str = "") -> dict[str, str]:
    """`{"a": {"b": 1}}` -> `{"a.b": "1"}`: MLflow params (strings, at most 6000 characters), redacted
    (pipeline.redact: a dataset URL's token or a URI's password never becomes a param that every
    reader of the run sees)."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten_params(v, key + "."))
        else:
            s = json.dumps(v) if isinstance(v, (list, tuple)) else str(v)
            out[key] = redact(s)[:6000]
    return out


def client(cfg: ProjectConfig):
    """An `mlflow.MlflowClient` on the project's store (initialised)."""
    return mlflow_for(cfg).MlflowClient()
