"""A database registry store (PostgreSQL, MySQL, MS SQL) checked before MLflow touches it.

`pipeline.registry.store.check_store` calls `probe` for every `postgresql`, `mysql` and `mssql`
tracking/registry URI. Within `registry.connect_timeout_s` (plus a bounded margin: one connection,
two catalogue queries) it finds, instead of MLflow's retries, a `ModuleNotFoundError` traceback
or a failure after the volume changed:

- the URI's driver is not installed: `postgresql://` is SQLAlchemy's default driver, psycopg 3
  since SQLAlchemy 2.1; the project ships psycopg2 (`psycopg2-binary` in pyproject.toml), so
  `engine_uri` hands a plain `postgresql://` (or `postgres://`) to that driver when psycopg 3 is
  not installed. Any other missing driver is a StoreError naming the package to install;
- the server refuses the connection (wrong password, unknown database, not accepting);
- which tables the database has (`Probe.tables`: the caller tells an empty or foreign database
  from an MLflow one);
- for a command that writes (`write=True`, PostgreSQL): a session that cannot write
  (`default_transaction_read_only`, a hot standby), or an MLflow table this role may not
  INSERT, UPDATE or DELETE: a read-only role fails here, before the volume or the fleet change.

Raises StoreError (exit 2) naming the store (password redacted), what is wrong and how to fix it.
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass, field

from pipeline.errors import StoreError
from pipeline.redact import redact, redact_uri

# module SQLAlchemy imports for a dialect's driver -> the package that provides it
PACKAGES = {
    "psycopg": "psycopg[binary]",
    "psycopg2": "psycopg2-binary",
    "MySQLdb": "mysqlclient",
    "pymysql": "PyMySQL",
    "mysql": "mysql-connector-python",
    "pyodbc": "pyodbc",
    "pymssql": "pymssql",
    "pg8000": "pg8000",
}
# drivers whose connect() takes `connect_timeout` in whole seconds (libpq, MySQL clients)
TIMEOUT_ARG = {"psycopg2": "connect_timeout", "psycopg": "connect_timeout", "pymysql": "connect_timeout",
               "mysqldb": "connect_timeout", "pg8000": "timeout", "pymssql": "login_timeout"}  # fmt: skip
# any of these: MLflow's schema (whole, or half-way through its creation by another process)
MLFLOW_TABLES = frozenset({"alembic_version", "experiments", "runs", "registered_models", "model_versions"})


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def engine_uri(uri: str) -> str:
    """`uri` as SQLAlchemy and MLflow are given it: `postgresql://` / `postgres://` -> the shipped
    psycopg2 driver when psycopg 3 is not installed; every other URI unchanged."""
    scheme, sep, rest = uri.partition(":")
    if sep and scheme.lower() in ("postgresql", "postgres") and not _importable("psycopg"):
        if _importable("psycopg2"):
            return "postgresql+psycopg2:" + rest
    if sep and scheme.lower() == "postgres":
        return "postgresql:" + rest
    return uri


def is_database_uri(uri: str) -> bool:
    """A URI MLflow opens through SQLAlchemy itself (not sqlite): postgresql, mysql, mssql (any driver)."""
    db = uri.split(":", 1)[0].split("+", 1)[0].lower()
    return db in ("postgresql", "postgres", "mysql", "mssql")


@dataclass
class Probe:
    """What `probe` found: the database's tables (its default schema), and who is connected."""

    tables: set[str] = field(default_factory=set)
    user: str | None = None

    @property
    def is_mlflow(self) -> bool:
        return bool(MLFLOW_TABLES & self.tables)


def _driver_error(uri: str, drivername: str, e: ImportError) -> StoreError:
    module = (e.name or "").split(".")[0] or drivername
    pkg = PACKAGES.get(module, module)
    hint = (
        " (or write the URI as postgresql+psycopg2://..., the driver the project ships)"
        if drivername.startswith("postgresql")
        else ""
    )
    return StoreError(
        f"the MLflow store {redact_uri(uri)} needs the database driver {module!r}, which is not installed: "
        f"install it into the virtualenv with `.venv/bin/pip install '{pkg}'`{hint}"
    )


def check_driver(uri: str):
    """(SQLAlchemy URL, dialect) for `uri` with its driver importable; StoreError naming the package
    to install, or the URI that is not SQLAlchemy's. Touches no network."""
    import sqlalchemy as sa

    shown = redact_uri(uri)
    try:
        url = sa.engine.make_url(engine_uri(uri))
        dialect = url.get_dialect()
    except (sa.exc.ArgumentError, sa.exc.NoSuchModuleError, ValueError) as e:
        raise StoreError(
            f"the MLflow store URI {shown} is not one SQLAlchemy can open ({e}): use e.g. "
            "postgresql://USER:PASSWORD@HOST:5432/DB or mysql+pymysql://USER:PASSWORD@HOST:3306/DB"
        ) from e
    try:
        dialect.import_dbapi()
    except ImportError as e:
        raise _driver_error(uri, url.drivername, e) from e
    return url, dialect


def probe(uri: str, timeout_s: float, write: bool) -> Probe:
    """Connect to the database at `uri` once; return its tables. See the module doc for what is refused."""
    import sqlalchemy as sa
    from sqlalchemy.pool import NullPool

    shown = redact_uri(uri)
    url, dialect = check_driver(uri)
    seconds = max(2, math.ceil(timeout_s))  # libpq's minimum is 2 s
    args: dict = {}
    if (arg := TIMEOUT_ARG.get(dialect.driver)) is not None:
        args[arg] = seconds
    if dialect.name == "postgresql" and dialect.driver in ("psycopg2", "psycopg"):
        args["options"] = f"-c statement_timeout={seconds * 1000}"  # a server that answers nothing
    engine = sa.create_engine(url, poolclass=NullPool, connect_args=args)
    try:
        with engine.connect() as con:
            found = Probe(set(sa.inspect(con).get_table_names()))
            if dialect.name == "postgresql":
                found.user = con.execute(sa.text("SELECT current_user")).scalar()
                if write:
                    _check_postgres_writable(con, shown, found)
            return found
    except StoreError:
        raise
    except sa.exc.DBAPIError as e:
        first = redact(
            str(e.orig or e).strip().splitlines()[0] if str(e.orig or e).strip() else type(e).__name__
        )
        raise StoreError(
            f"the MLflow store {shown} refused the connection or query: {first} (within {seconds} s, "
            "registry.connect_timeout_s); check the user, password and database name in "
            "MLFLOW_TRACKING_URI / registry.tracking_uri, and that the server accepts this client"
        ) from e
    except sa.exc.SQLAlchemyError as e:
        raise StoreError(
            f"the MLflow store {shown} cannot be used: {type(e).__name__}: {redact(str(e))[:300]}"
        ) from e
    finally:
        engine.dispose()


def _check_postgres_writable(con, shown: str, found: Probe) -> None:
    """StoreError unless this session may write every MLflow table (read-only role, standby, read-only
    session default)."""
    import sqlalchemy as sa

    if con.execute(sa.text("SELECT pg_is_in_recovery()")).scalar():
        raise StoreError(
            f"the MLflow store {shown} is a read-only standby (hot standby, in recovery): point "
            "MLFLOW_TRACKING_URI / registry.tracking_uri at the primary; nothing was changed"
        )
    if str(con.execute(sa.text("SHOW transaction_read_only")).scalar()).lower() == "on":
        raise StoreError(
            f"the MLflow store {shown}: sessions of role {found.user!r} are read-only "
            "(default_transaction_read_only): use a role that may write, or "
            f"`ALTER ROLE {found.user} SET default_transaction_read_only = off`; nothing was changed"
        )
    if not found.is_mlflow:
        if found.tables:
            return  # a foreign database: the caller refuses it
        ok = con.execute(sa.text("SELECT has_schema_privilege(current_schema(), 'CREATE')")).scalar()
        if not ok:
            raise StoreError(
                f"the MLflow store {shown} is empty and role {found.user!r} may not create tables in it "
                "(MLflow creates its schema on first use): grant CREATE on the schema, or use the owner; "
                "nothing was changed"
            )
        return
    denied = (
        con.execute(
            sa.text(
                "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
                "WHERE n.nspname = current_schema() AND ((c.relkind IN ('r', 'p') AND c.relname <> 'alembic_version' "
                "AND NOT (has_table_privilege(c.oid, 'INSERT') AND has_table_privilege(c.oid, 'UPDATE') "
                "AND has_table_privilege(c.oid, 'DELETE'))) "
                "OR (c.relkind = 'S' AND NOT has_sequence_privilege(c.oid, 'USAGE'))) ORDER BY c.relname"
            )
        )
        .scalars()
        .all()
    )
    if denied:
        schema = con.execute(sa.text("SELECT current_schema()")).scalar()
        more = f" and {len(denied) - 5} more" if len(denied) > 5 else ""
        raise StoreError(
            f"the MLflow store {shown} cannot be written by role {found.user!r}: no INSERT, UPDATE and DELETE "
            f"(USAGE on a sequence) on {', '.join(denied[:5])}{more} (a read-only role?). Nothing was changed: run "
            "the command with a role that owns the MLflow tables (or `GRANT INSERT, UPDATE, DELETE ON ALL TABLES "
            f"IN SCHEMA {schema} TO {found.user}` and `GRANT USAGE ON ALL SEQUENCES IN SCHEMA {schema} TO "
            f"{found.user}`); reading (`pipeline status`) works with this role"
        )
