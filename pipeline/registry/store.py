"""The MLflow store: imported lazily (~2 s), pointed at the project's tracking URI, initialised once.

Concurrent first-time schema creation corrupts a sqlite store (docs/registry.md, "Measured"), so
the store is initialised once under a file lock before anything else touches it.
"""

from __future__ import annotations

import json
import os

from pipeline.config import ProjectConfig


def mlflow_for(cfg: ProjectConfig):
    """Import mlflow pointed at the project's store, initialised once under a lock."""
    os.environ.setdefault("MLFLOW_ENABLE_ASYNC_LOGGING", "false")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    import mlflow
    from filelock import FileLock

    uri = cfg.tracking_uri
    # mlflow.set_tracking_uri also exports MLFLOW_TRACKING_URI, which `ProjectConfig.tracking_uri`
    # prefers over the config file: the next config in this process (or any child, e.g. a test's
    # `pipeline register`) would silently use this store. Keep the environment as it was.
    env_before = os.environ.get("MLFLOW_TRACKING_URI")
    mlflow.set_tracking_uri(uri)
    if env_before is None:
        os.environ.pop("MLFLOW_TRACKING_URI", None)
    else:
        os.environ["MLFLOW_TRACKING_URI"] = env_before
    if cfg.registry.registry_uri:
        mlflow.set_registry_uri(cfg.registry.registry_uri)
    cfg.state_dir.mkdir(parents=True, exist_ok=True)
    marker = cfg.state_dir / f".mlflow-init-{_uri_key(uri)}"
    if not marker.exists():
        with FileLock(str(cfg.state_dir / "mlflow-init.lock"), timeout=300):
            if not marker.exists():
                ensure_experiment(cfg, mlflow)  # creates the schema and the experiment
                marker.write_text(uri + "\n")
    return mlflow


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


def flatten_params(d: dict, prefix: str = "") -> dict[str, str]:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten_params(v, key + "."))
        else:
            s = json.dumps(v) if isinstance(v, (list, tuple)) else str(v)
            out[key] = s[:6000]
    return out


def client(cfg: ProjectConfig):
    """An `mlflow.MlflowClient` on the project's store (initialised)."""
    return mlflow_for(cfg).MlflowClient()
