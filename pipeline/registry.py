"""MLflow: training runs, the adapter as a LoggedModel, model versions and aliases.

Embedded default: sqlite at `<state_dir>/mlflow.db`, artifacts under `<state_dir>/mlartifacts`;
`MLFLOW_TRACKING_URI` or `registry.tracking_uri` select a server or PostgreSQL instead.
Concurrent first-time schema creation corrupts sqlite (../shared/design/mlflow.md), so the
store is initialised once under a file lock before anything else touches it.

mlflow is imported inside functions: `pipeline --help` must not pay ~2 s for it.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from pipeline.config import ProjectConfig
from pipeline.errors import PipelineError, UsageError

ALIAS_CANDIDATE = "candidate"
ALIAS_PRODUCTION = "production"
ALIAS_PREVIOUS = "previous"
MODEL_TYPE = "peft-lora"


class RegistryError(PipelineError):
    exit_code = 2


def _mlflow(cfg: ProjectConfig):
    """Import mlflow pointed at the project's store, initialised once under a lock."""
    os.environ.setdefault("MLFLOW_ENABLE_ASYNC_LOGGING", "false")
    import mlflow
    from filelock import FileLock

    uri = cfg.tracking_uri
    mlflow.set_tracking_uri(uri)
    if cfg.registry.registry_uri:
        mlflow.set_registry_uri(cfg.registry.registry_uri)
    cfg.state_dir.mkdir(parents=True, exist_ok=True)
    marker = cfg.state_dir / f".mlflow-init-{_uri_key(uri)}"
    if not marker.exists():
        with FileLock(str(cfg.state_dir / "mlflow-init.lock"), timeout=300):
            if not marker.exists():
                _experiment_id(cfg, mlflow)  # creates the schema and the experiment
                marker.write_text(uri + "\n")
    return mlflow


def _uri_key(uri: str) -> str:
    import hashlib

    return hashlib.sha256(uri.encode()).hexdigest()[:12]


def _experiment_id(cfg: ProjectConfig, mlflow) -> str:
    client = mlflow.MlflowClient()
    exp = client.get_experiment_by_name(cfg.registry.experiment)
    if exp is not None:
        return exp.experiment_id
    location = None
    if cfg.tracking_uri.startswith(("sqlite:", "file:")) or "://" not in cfg.tracking_uri:
        cfg.artifact_root.mkdir(parents=True, exist_ok=True)
        location = cfg.artifact_root.as_uri()
    try:
        return client.create_experiment(cfg.registry.experiment, artifact_location=location)
    except Exception:  # created concurrently
        return client.get_experiment_by_name(cfg.registry.experiment).experiment_id


def experiment_id(cfg: ProjectConfig) -> str:
    return _experiment_id(cfg, _mlflow(cfg))


def _flatten(d: dict, prefix: str = "") -> dict[str, str]:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            s = json.dumps(v) if isinstance(v, (list, tuple)) else str(v)
            out[key] = s[:6000]
    return out


# -- training runs --------------------------------------------------------------------------
def start_training_run(cfg: ProjectConfig, run_name: str, params: dict, datasets: list[dict]) -> str:
    """Create the MLflow run for one training; returns its run id.

    `datasets`: [{"name", "path", "sha256", "role"}]; each becomes a run input with its digest.
    """
    mlflow = _mlflow(cfg)
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.data.sources import LocalArtifactDatasetSource

    client = mlflow.MlflowClient()
    run = client.create_run(_experiment_id(cfg, mlflow), run_name=run_name, tags={"pipeline.stage": "train"})
    rid = run.info.run_id
    flat = _flatten(params)
    from mlflow.entities import Param

    items = [Param(k, v) for k, v in sorted(flat.items())]
    for i in range(0, len(items), 100):
        client.log_batch(rid, params=items[i : i + 100])
    with mlflow.start_run(run_id=rid):
        for d in datasets:
            ds = MetaDataset(source=LocalArtifactDatasetSource(str(d["path"])), name=d["name"], digest=d["sha256"][:36])
            mlflow.log_input(ds, context=d["role"])
    return rid


def finish_training_run(cfg: ProjectConfig, run_id: str, metrics: dict, artifacts: list[Path], ok: bool) -> None:
    mlflow = _mlflow(cfg)
    client = mlflow.MlflowClient()
    for k, v in metrics.items():
        if isinstance(v, (int, float)) and v == v:
            client.log_metric(run_id, k, float(v))
    for a in artifacts:
        if Path(a).exists():
            client.log_artifact(run_id, str(a))
    client.set_terminated(run_id, "FINISHED" if ok else "FAILED")


# -- model versions -------------------------------------------------------------------------
@dataclass
class Registered:
    name: str
    version: int
    model_id: str
    run_id: str | None
    source: str


def _describe(manifest: dict, report: dict) -> str:
    base = manifest.get("base_model", {})
    served = manifest.get("served", {})
    m = manifest.get("metrics", {})
    return (
        f"LoRA r={manifest.get('adapter', {}).get('r')} on {base.get('id')} @ {base.get('revision') or base.get('fingerprint', '')[:12]}; "
        f"served on {served.get('checkpoint')} @ {served.get('revision')}; "
        f"dataset {manifest.get('dataset', {}).get('fingerprint', '')[:12]}; "
        f"eval_loss {m.get('eval_loss')}; validation {report.get('verdict')}"
    )


def register_adapter(cfg: ProjectConfig, adapter_dir: Path, name: str, report: dict) -> Registered:
    """Record `adapter_dir` as a LoggedModel, register it as a version of `name`, alias `candidate`.

    The artifact is exactly the adapter directory (config, safetensors, tokenizer, manifest):
    never base weights. `report` is the validation report dict (verdict, weights_sha256).

    Raises:
        RegistryError: the directory has no manifest.json (train it with `pipeline train`).
    """
    from pipeline.manifest import read_manifest

    adapter_dir = Path(adapter_dir)
    try:
        manifest = read_manifest(adapter_dir)
    except FileNotFoundError as e:
        raise RegistryError(f"{adapter_dir}: no manifest.json; adapters are registered from `pipeline train` output") from e
    mlflow = _mlflow(cfg)
    client = mlflow.MlflowClient()
    run_id = manifest.get("mlflow_run_id")
    if run_id:
        try:
            client.get_run(run_id)
        except Exception:
            run_id = None  # trained against another store
    base = manifest.get("base_model", {})
    tags = {
        "base_model": str(base.get("id")),
        "base_revision": str(base.get("revision") or ""),
        "base_fingerprint": str(base.get("fingerprint") or ""),
        "served_checkpoint": cfg.served.checkpoint,
        "served_revision": str(cfg.served.revision or ""),
        "dataset_fingerprint": str(manifest.get("dataset", {}).get("fingerprint", "")),
        "weights_sha256": manifest.get("files", {}).get("adapter_model.safetensors", ""),
        "validation.verdict": report.get("verdict", "unknown"),
        "validation.weights_sha256": str(report.get("weights_sha256")),
        "lora_r": str(manifest.get("adapter", {}).get("r")),
    }
    params = _flatten({k: v for k, v in manifest.get("adapter", {}).items()})
    model = mlflow.initialize_logged_model(
        name=name, source_run_id=run_id, tags=tags, params=params, model_type=MODEL_TYPE,
        experiment_id=_experiment_id(cfg, mlflow),
    )
    try:
        client.log_model_artifacts(model.model_id, str(adapter_dir))
        with tempfile.TemporaryDirectory() as td:
            rp = Path(td) / "validation.json"
            rp.write_text(json.dumps(report, indent=2))
            if run_id:
                client.log_artifact(run_id, str(rp), artifact_path=f"validation/{name}")
        for k, v in (manifest.get("metrics") or {}).items():
            if isinstance(v, (int, float)):
                mlflow.log_metric(k, float(v), model_id=model.model_id, run_id=run_id)
        mlflow.finalize_logged_model(model.model_id, "READY")
    except BaseException:
        mlflow.finalize_logged_model(model.model_id, "FAILED")
        raise
    mv = mlflow.register_model(f"models:/{model.model_id}", name, tags=tags)
    client.update_model_version(name, mv.version, description=_describe(manifest, report))
    client.set_model_version_tag(name, mv.version, "validation.report", json.dumps(_compact(report))[:4900])
    client.set_registered_model_alias(name, ALIAS_CANDIDATE, mv.version)
    return Registered(name, int(mv.version), model.model_id, run_id, mv.source)


def _compact(report: dict) -> dict:
    return {
        "verdict": report.get("verdict"),
        "weights_sha256": report.get("weights_sha256"),
        "errors": [c["id"] for c in report.get("checks", []) if c.get("severity") == "error"],
        "warnings": [c["id"] for c in report.get("checks", []) if c.get("severity") == "warning"],
    }


def resolve_version(cfg: ProjectConfig, name: str, version: int | None = None, alias: str | None = None):
    """The ModelVersion for `name` at `version` or `alias`.

    Raises UsageError naming what exists when the model, version or alias does not.
    """
    mlflow = _mlflow(cfg)
    client = mlflow.MlflowClient()
    from mlflow.exceptions import MlflowException

    if (version is None) == (alias is None):
        raise UsageError("give exactly one of --version N or --alias A")
    try:
        client.get_registered_model(name)
    except MlflowException as e:
        raise UsageError(f"registered model {name!r} not found in {cfg.tracking_uri}") from e
    try:
        if alias is not None:
            return client.get_model_version_by_alias(name, alias)
        return client.get_model_version(name, str(version))
    except MlflowException as e:
        versions = sorted(int(v.version) for v in client.search_model_versions(f"name='{name}'"))
        aliases = client.get_registered_model(name).aliases
        what = f"alias {alias!r}" if alias is not None else f"version {version}"
        raise UsageError(f"{name}: {what} not found (versions {versions}, aliases {aliases})") from e


def download_version(cfg: ProjectConfig, mv, dst: Path) -> Path:
    """Download a version's artifact (the adapter directory) into `dst`; returns the directory."""
    mlflow = _mlflow(cfg)
    path = mlflow.artifacts.download_artifacts(artifact_uri=mv.source, dst_path=str(dst))
    return Path(path)


def set_alias(cfg: ProjectConfig, name: str, alias: str, version: int) -> int | None:
    """Point `alias` at `version`; returns the version it pointed at before (or None)."""
    mlflow = _mlflow(cfg)
    client = mlflow.MlflowClient()
    from mlflow.exceptions import MlflowException

    try:
        prev = int(client.get_model_version_by_alias(name, alias).version)
    except MlflowException:
        prev = None
    client.set_registered_model_alias(name, alias, str(version))
    return prev


def set_version_tags(cfg: ProjectConfig, name: str, version: int, tags: dict[str, str]) -> None:
    client = _mlflow(cfg).MlflowClient()
    for k, v in tags.items():
        client.set_model_version_tag(name, str(version), k, str(v))
